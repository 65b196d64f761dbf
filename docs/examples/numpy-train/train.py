"""Train a tiny MLP (2 -> hidden -> 3, tanh, softmax) on spiral data.

Runs as a cannabis task: writes $CANNABIS_WORK/model.safetensors.
Outside the sandbox it writes to the current directory.
"""
import argparse
import json
import os
import struct

import numpy as np

import data


def forward(x, w1, b1, w2, b2):
    h = np.tanh(x @ w1 + b1)
    z = h @ w2 + b2
    z = z - z.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    return h, p


def write_safetensors(path, tensors, metadata):
    """Write float32 tensors in safetensors format, in the given order."""
    header, blobs, offset = {}, [], 0
    for name, t in tensors:
        raw = np.ascontiguousarray(t, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)                    # pad the header to 8 bytes
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for raw in blobs:
            f.write(raw)
    os.replace(tmp, path)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.3)
    p.add_argument("--batch", type=int, default=50)
    p.add_argument("--count", type=int, default=1500, help="training rows")
    p.add_argument("--seed", type=int, default=1, help="data and init seed")
    a = p.parse_args()

    train = data.make(a.seed, a.count)
    x, y = train[:, :2].astype(np.float64), train[:, 2].astype(np.int64)
    onehot = np.eye(data.CLASSES)[y]

    rng = np.random.default_rng(a.seed + 1000)
    w1 = rng.normal(0, 1.0, (2, a.hidden))
    b1 = np.zeros(a.hidden)
    w2 = rng.normal(0, 1.0 / np.sqrt(a.hidden), (a.hidden, data.CLASSES))
    b2 = np.zeros(data.CLASSES)
    params = [w1, b1, w2, b2]
    velocity = [np.zeros_like(t) for t in params]

    report_every = max(1, a.epochs // 10)
    for epoch in range(1, a.epochs + 1):
        order = rng.permutation(a.count)
        for start in range(0, a.count, a.batch):
            i = order[start:start + a.batch]
            h, prob = forward(x[i], *params)
            dz = (prob - onehot[i]) / len(i)            # softmax cross-entropy gradient
            dh = (dz @ w2.T) * (1 - h * h)              # back through tanh
            grads = [x[i].T @ dh, dh.sum(0), h.T @ dz, dz.sum(0)]
            for t, v, g in zip(params, velocity, grads):  # SGD with momentum 0.9
                v *= 0.9
                v -= a.lr * g
                t += v
        if epoch % report_every == 0 or epoch == a.epochs:
            _, prob = forward(x, *params)
            loss = -np.log(prob[np.arange(a.count), y] + 1e-12).mean()
            acc = (prob.argmax(1) == y).mean()
            print(f"epoch {epoch}/{a.epochs} loss {loss:.4f} train_accuracy {acc:.4f}",
                  flush=True)

    out = os.path.join(os.environ.get("CANNABIS_WORK", "."), "model.safetensors")
    meta = {"epochs": str(a.epochs), "hidden": str(a.hidden), "lr": str(a.lr),
            "seed": str(a.seed)}
    write_safetensors(out, list(zip(["w1", "b1", "w2", "b2"], params)), meta)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
