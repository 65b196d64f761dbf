"""Score a delivered model.safetensors on the held-out set.

Reads from $CANNABIS_INPUTS: model.safetensors, heldout.npy and, if present,
configuration.json (the agreed configuration, e.g. {"hidden": "32"}).
Writes $CANNABIS_WORK/metrics.json: {"accuracy": ..., "loss": ...}.

Exit codes: 0 scored; 2 the model (or configuration) is refused;
1 the held-out set itself is unusable.  Never unpickles anything.
"""
import json
import math
import os
import struct
import sys

import numpy as np

CLASSES = 3
NAMES = ["w1", "b1", "w2", "b2"]


def fail(code, msg):
    print(f"evaluate: {msg}", file=sys.stderr)
    sys.exit(code)


def refuse(msg):
    fail(2, f"refused: {msg}")


def load_model(path):
    """Parse safetensors by hand: u64 header length, JSON header, raw data."""
    try:
        with open(path, "rb") as f:
            blob = f.read()
    except OSError as e:
        refuse(f"cannot read {path}: {e}")
    if len(blob) < 8:
        refuse(f"{path} is {len(blob)} bytes, too short for a safetensors header")
    (n,) = struct.unpack("<Q", blob[:8])
    if n > len(blob) - 8 or n > 1 << 20:
        refuse(f"header length {n} does not fit in a {len(blob)}-byte file")
    try:
        header = json.loads(blob[8:8 + n].decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        refuse(f"header is not valid JSON: {e}")
    if not isinstance(header, dict):
        refuse("header is not a JSON object")
    header.pop("__metadata__", None)
    if sorted(header) != sorted(NAMES):
        refuse(f"tensors are {sorted(header)}, expected {NAMES}")

    data = blob[8 + n:]
    spans, tensors = [], {}
    for name in NAMES:
        info = header[name]
        if not isinstance(info, dict) or info.get("dtype") != "F32":
            refuse(f"tensor {name}: dtype must be F32, got {info!r}")
        shape, offs = info.get("shape"), info.get("data_offsets")
        if (not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape)
                or not isinstance(offs, list) or len(offs) != 2
                or not all(type(o) is int for o in offs)):
            refuse(f"tensor {name}: bad shape or data_offsets in {info!r}")
        start, end = offs
        if not 0 <= start <= end <= len(data) or end - start != 4 * math.prod(shape):
            refuse(f"tensor {name}: data_offsets {offs} do not match shape {shape} "
                   f"in {len(data)} data bytes")
        spans.append((start, end))
        tensors[name] = np.frombuffer(data[start:end], dtype="<f4").reshape(shape)
    # Offsets must tile the data region exactly: no gaps, overlaps or trailing bytes.
    pos = 0
    for start, end in sorted(spans):
        if start != pos:
            refuse("tensor data is not contiguous")
        pos = end
    if pos != len(data):
        refuse(f"{len(data) - pos} trailing bytes after the tensor data")

    w1, b1, w2, b2 = (tensors[k] for k in NAMES)
    if w1.ndim != 2 or w1.shape[0] != 2:
        refuse(f"w1 has shape {list(w1.shape)}, expected [2, H]")
    hidden = w1.shape[1]
    want = {"b1": [hidden], "w2": [hidden, CLASSES], "b2": [CLASSES]}
    for name, shape in want.items():
        if list(tensors[name].shape) != shape:
            refuse(f"{name} has shape {list(tensors[name].shape)}, expected {shape}")
    for name in NAMES:
        if not np.all(np.isfinite(tensors[name])):
            refuse(f"tensor {name} holds NaN or infinite values")
    return hidden, [t.astype(np.float64) for t in (w1, b1, w2, b2)]


def main():
    inputs = os.environ.get("CANNABIS_INPUTS", ".")
    work = os.environ.get("CANNABIS_WORK", ".")

    hidden, (w1, b1, w2, b2) = load_model(os.path.join(inputs, "model.safetensors"))

    conf_path = os.path.join(inputs, "configuration.json")
    if os.path.exists(conf_path):
        try:
            with open(conf_path) as f:
                conf = json.load(f)
        except ValueError as e:
            refuse(f"configuration.json is not valid JSON: {e}")
        if not isinstance(conf, dict):
            refuse("configuration.json is not a JSON object")
        if "hidden" in conf and str(conf["hidden"]).strip() != str(hidden):
            refuse(f"model has hidden size {hidden}, configuration says {conf['hidden']!r}")

    try:
        held = np.load(os.path.join(inputs, "heldout.npy"), allow_pickle=False)
    except (OSError, ValueError) as e:
        fail(1, f"cannot load heldout.npy: {e}")
    if held.ndim != 2 or held.shape[1] != 3 or held.shape[0] == 0:
        fail(1, f"heldout.npy has shape {held.shape}, expected (N, 3)")
    x, y = held[:, :2].astype(np.float64), held[:, 2].astype(np.int64)
    if y.min() < 0 or y.max() >= CLASSES:
        fail(1, "heldout.npy labels are outside 0..2")

    z = np.tanh(x @ w1 + b1) @ w2 + b2
    z = z - z.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    metrics = {
        "accuracy": round(float((z.argmax(1) == y).mean()), 6),
        "loss": round(float(-logp[np.arange(len(y)), y].mean()), 6),
    }
    with open(os.path.join(work, "metrics.json"), "w") as f:
        json.dump(metrics, f)
        f.write("\n")
    print(f"hidden {hidden}, {len(y)} held-out rows: "
          f"accuracy {metrics['accuracy']:.4f} loss {metrics['loss']:.4f}")


if __name__ == "__main__":
    main()
