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
    cargo nextest run --workspace --locked --no-fail-fast
else
    cargo test --workspace --locked --all-targets --no-fail-fast
fi
