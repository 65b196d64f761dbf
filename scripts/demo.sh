#!/usr/bin/env bash
# The demo (README): builds `cannabis`, walks one job through the protocol, then runs five
# real nodes on loopback and measures how fast offers spread between them.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked -p cannabis-node
bin=./target/release/cannabis

echo "== one job through the protocol"
"$bin" demo "$@"

echo
echo "== five nodes on loopback: ads and offers gossiped to every node"
dir=$(mktemp -d)
trap '"$bin" testnet down --dir "$dir/net" >/dev/null 2>&1 || true; rm -rf "$dir"' EXIT
"$bin" testnet bench --nodes 5 --offers 10 --pings 100 --dir "$dir/net"
