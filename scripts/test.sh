#!/usr/bin/env bash
# The test command (README, CI): formatting, lints, then every test of the workspace.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "==> cargo fmt --check"
cargo fmt --all -- --check

echo "==> cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings

echo "==> doc tests"
cargo test --workspace --locked --doc

echo "==> tests"
if cargo nextest --version >/dev/null 2>&1; then
    # The slow-reader penalty test passes when it is the only test of a nextest run and
    # times out when any other test ran in the same run (on 2 cores; seen on earlier
    # commits too, cause not found yet): it runs in a run of its own.
    alone='test(/^hostile::a_peer_that_stops_reading/)'
    status=0
    cargo nextest run --workspace --locked --no-fail-fast -E "not ($alone)" || status=$?
    cargo nextest run -p cannabis-node --test it --locked -E "$alone" || status=$?
    exit "$status"
else
    cargo test --workspace --locked --all-targets --no-fail-fast
fi
