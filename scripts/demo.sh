#!/usr/bin/env bash
# The demo (README): builds `cannabis`, walks one job through the protocol, then runs five
# real nodes on loopback, measures how fast offers spread between them and how long a
# group job takes from submission to countersigned leases, runs a three-node testnet's own
# ledger (faucet, a transfer, a rewarded proof-of-compute result and its inclusion proof)
# and a job paid through its escrow (locked, run, delivered, its product checked,
# accepted), simulates the market at 500 nodes, and runs the synthetic task in this
# machine's sandbox.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked -p cannabis-node
bin=./target/release/cannabis

echo "== one job through the protocol"
"$bin" demo "$@"

echo
echo "== five nodes on loopback: ads and offers gossiped, a group job placed and leased, work delivered, a group's channel"
dir=$(mktemp -d)
chmod 711 "$dir"   # the nodes' sandboxes run as uids of their own and must pass through
up_pid=
cleanup() {
    "$bin" testnet down --dir "$dir/net" >/dev/null 2>&1 || true
    "$bin" testnet down --dir "$dir/ledger" >/dev/null 2>&1 || true
    if [ -n "$up_pid" ]; then kill "$up_pid" 2>/dev/null || true; wait "$up_pid" 2>/dev/null || true; fi
    rm -rf "$dir"
}
trap cleanup EXIT
"$bin" testnet bench --nodes 5 --offers 10 --pings 100 --dir "$dir/net"

echo
echo "== the ledger: three nodes, node 0 sequencing; a faucet grant, a transfer, a result"
"$bin" testnet up --nodes 3 --dir "$dir/ledger" >"$dir/ledger.log" 2>&1 &
up_pid=$!
n0="$dir/ledger/node-0" n1="$dir/ledger/node-1" n2="$dir/ledger/node-2"
for _ in $(seq 1 600); do
    "$bin" --data-dir "$n2" ledger status >/dev/null 2>&1 && break
    sleep 0.1
done
"$bin" --data-dir "$n1" ledger status
"$bin" --data-dir "$n1" wallet faucet
"$bin" --data-dir "$n1" wallet send "$("$bin" --data-dir "$n2" keys address)" 250000
computed=$("$bin" --data-dir "$n1" ledger compute --size 256 --json)
result=$(printf '%s' "$computed" | grep -o '"result_id": *"[0-9a-f]*"' | cut -d'"' -f4)
echo "node 1 computed the task its newest block seeds: result $result, in a block"
# Node 2 may take the block a moment after node 1 did.
for _ in $(seq 1 100); do
    "$bin" --data-dir "$n2" ledger prove "$result" --out "$dir/proof.json" 2>/dev/null && break
    sleep 0.1
done
test -s "$dir/proof.json"
echo "node 2 proves it; node 0 checks the proof against the block it holds:"
"$bin" --data-dir "$n0" ledger verify-proof "$dir/proof.json"
echo "node 2's view of node 1's account:"
"$bin" --data-dir "$n2" wallet balance "$("$bin" --data-dir "$n1" keys address)"
"$bin" --data-dir "$n0" ledger blocks --limit 5

echo
echo "== a job paid through escrow: locked before any award, run, delivered, accepted"
cat >"$dir/job.toml" <<'JOB'
name = "paid"
deadline = "5m"
bid_window = "2s"
review_window = "10m"
[[task]]
name = "paid"
budget = 300_000
[task.workload]
adapter = "synthetic"
[task.resources]
cpu = 1
memory = "256MiB"
JOB
# Node 1 publishes once it holds the other nodes' ads.
for _ in $(seq 1 300); do
    ads=$("$bin" --data-dir "$n1" market ads --json 2>/dev/null | grep -c '"synthetic"' || true)
    [ "$ads" -ge 2 ] && break
    sleep 0.1
done
"$bin" --data-dir "$n1" job submit "$dir/job.toml" --dry-run | sed -n '1,8p'
job=$("$bin" --data-dir "$n1" job submit "$dir/job.toml" --yes --json |
    grep -o '"job_id": *"[0-9a-f-]*"' | cut -d'"' -f4)
for _ in $(seq 1 600); do
    "$bin" --data-dir "$n1" job status "$job" | grep -q "delivered; review window" && break
    sleep 0.1
done
"$bin" --data-dir "$n1" job accept "$job"
for _ in $(seq 1 300); do
    "$bin" --data-dir "$n1" job status "$job" | grep -q "^escrow: .*closed" && break
    sleep 0.1
done
"$bin" --data-dir "$n1" job status "$job"
"$bin" --data-dir "$n1" job status "$job" | grep -q "^escrow: .*closed"
"$bin" testnet down --dir "$dir/ledger" >/dev/null
kill "$up_pid" 2>/dev/null || true
wait "$up_pid" 2>/dev/null || true
up_pid=

echo
echo "== the market simulated: 500 nodes, 200 offers, lossy network, crashing workers"
"$bin" testnet sim --nodes 500 --offers 200

echo
echo "== the synthetic task in this machine's sandbox (the executor a worker runs)"
"$bin" exec run docs/examples/synthetic.toml --out "$dir/out"
