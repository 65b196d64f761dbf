#!/usr/bin/env bash
# The demo (README): builds `cannabis`, then `cannabis testnet demo`: a testnet of five real
# node processes on loopback (a ledger sequencer, workers of different cores and prices, a
# requester) runs, step by step and checked, a synthetic job from offer to settlement, a
# proof-of-compute result proved in its block, the training example evaluated and paid, a
# 3-rank group over its private channel, and a job whose worker is killed mid-run. Exits 0
# only if every step happened; leaves no process or file behind. As root (the workers'
# sandboxes); the training example needs python3-numpy.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked -p cannabis-node
exec ./target/release/cannabis testnet demo "$@"
