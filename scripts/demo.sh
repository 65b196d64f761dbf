#!/usr/bin/env bash
# The demo (README): builds the `cannabis` binary and walks one job through the protocol.
# Extra arguments go to `cannabis demo` (try --json or --size 1024).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked -p cannabis-node
exec ./target/release/cannabis demo "$@"
