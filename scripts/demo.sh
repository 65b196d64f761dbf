#!/usr/bin/env bash
# The demo (README): builds `cannabis`, walks one job through the protocol, then runs five
# real nodes on loopback, measures how fast offers spread between them and how long a
# group job takes from submission to countersigned leases, simulates the market at
# 500 nodes, and runs the synthetic task in this machine's sandbox.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked -p cannabis-node
bin=./target/release/cannabis

echo "== one job through the protocol"
"$bin" demo "$@"

echo
echo "== five nodes on loopback: ads and offers gossiped, a group job placed and leased"
dir=$(mktemp -d)
chmod 711 "$dir"   # the nodes' sandboxes run as uids of their own and must pass through
trap '"$bin" testnet down --dir "$dir/net" >/dev/null 2>&1 || true; rm -rf "$dir"' EXIT
"$bin" testnet bench --nodes 5 --offers 10 --pings 100 --dir "$dir/net"

echo
echo "== the market simulated: 500 nodes, 200 offers, lossy network, crashing workers"
"$bin" testnet sim --nodes 500 --offers 200

echo
echo "== the synthetic task in this machine's sandbox (the executor a worker runs)"
"$bin" exec run docs/examples/synthetic.toml --out "$dir/out"
