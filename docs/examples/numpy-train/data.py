"""Deterministic synthetic data: three interleaved spirals in 2-D.

Each row is (x, y, label) as float32; the label is 0, 1 or 2.
The same (seed, count) always gives the same array.

    python3 data.py OUT.npy --seed 2 --count 2000
"""
import argparse

import numpy as np

CLASSES = 3


def make(seed, count):
    """Return a float32 array of shape (count, 3): x, y, label."""
    rng = np.random.default_rng(seed)
    label = rng.integers(0, CLASSES, size=count)
    r = rng.uniform(0.05, 1.0, size=count)             # distance from the centre
    angle = label * (2 * np.pi / CLASSES) + 6.0 * r    # each arm winds as it grows
    angle = angle + rng.normal(0.0, 0.4, size=count)   # noise, so the arms touch a little
    out = np.empty((count, 3), dtype=np.float32)
    out[:, 0] = r * np.cos(angle)
    out[:, 1] = r * np.sin(angle)
    out[:, 2] = label
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="where to write the .npy file")
    p.add_argument("--seed", type=int, default=2)
    p.add_argument("--count", type=int, default=2000)
    a = p.parse_args()
    data = make(a.seed, a.count)
    np.save(a.out, data, allow_pickle=False)
    print(f"wrote {a.out}: {data.shape[0]} rows, seed {a.seed}")


if __name__ == "__main__":
    main()
