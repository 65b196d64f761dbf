#!/bin/sh
# Build the two bundles and the held-out set next to job.toml.
# Run from this directory: sh make.sh
set -eu
cd "$(dirname "$0")"
# Files sit at the root of each tar, where the entrypoint expects them.
tar cf train.tar train.py data.py
tar cf evaluate.tar evaluate.py
# Held-out data: same generator, a different seed from training (seed 1).
python3 data.py heldout.npy --seed 2 --count 2000
echo "built train.tar, evaluate.tar, heldout.npy"
