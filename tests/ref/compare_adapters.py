#!/usr/bin/env python3
"""Compare two eo-ddp runs: adapters (max abs/rel difference) and per-step losses.

usage: compare_adapters.py RUN_A RUN_B [--rtol R] [--loss-rtol L] [--exact]
Exit 0 when every LoRA tensor agrees in relative Frobenius norm (||a - b|| <= rtol * ||b||) and
every logged loss within loss-rtol. Element-wise tolerances do not suit Adam: an element whose
gradient is at rounding level can take a step of either sign, so a different (but equally right)
summation order moves it by up to 2 x lr; the norm of the whole tensor is what must agree.
The files are read with numpy (bf16 widened exactly to float32): torch's import cost ~1.3 CPU
seconds per call, and the suite calls this dozens of times.
"""
import argparse
import json
import struct
import sys

import numpy as np

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16}


def load_file(path):
    """name -> array; BF16 becomes the float32 of the same value (its 16 bits are float32's top half)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for k, v in header.items():
        if k == "__metadata__":
            continue
        if v["dtype"] not in DTYPES:
            raise SystemExit(f"{path}: tensor {k} has dtype {v['dtype']}, not one of {sorted(DTYPES)}")
        begin, end = v["data_offsets"]
        a = np.frombuffer(data[begin:end], dtype=DTYPES[v["dtype"]]).reshape(v["shape"])
        if v["dtype"] == "BF16":
            a = (a.astype(np.uint32) << 16).view(np.float32)
        out[k] = (v["dtype"], a)
    return out


def losses(run):
    with open(f"{run}/metrics.jsonl") as f:
        return [json.loads(line)["loss"] for line in f if line.strip()]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--rtol", type=float, default=1e-3, help="per-tensor relative Frobenius difference")
    ap.add_argument("--loss-rtol", type=float, default=1e-5)
    ap.add_argument("--exact", action="store_true", help="bitwise equality")
    args = ap.parse_args()
    ta = load_file(f"{args.a}/adapter_model.safetensors")
    tb = load_file(f"{args.b}/adapter_model.safetensors")
    if ta.keys() != tb.keys():
        print(f"different tensors: {sorted(ta.keys() ^ tb.keys())[:5]}")
        return 1
    worst = 0.0
    bad = []
    rels = []
    for k in sorted(ta):
        (da, a), (db, b) = ta[k], tb[k]
        if a.shape != b.shape:
            print(f"{k}: shape {a.shape} vs {b.shape}")
            return 1
        x, y = a.astype(np.float64), b.astype(np.float64)
        rel = float(np.linalg.norm((x - y).ravel()) / max(np.linalg.norm(y.ravel()), 1e-12))
        ok = (da == db and np.array_equal(a, b)) if args.exact else rel <= args.rtol
        worst = max(worst, rel)
        rels.append((rel, k))
        if not ok:
            bad.append(k)
    la, lb = losses(args.a), losses(args.b)
    loss_ok = len(la) == len(lb) and all(
        (a == b) if args.exact else abs(a - b) <= args.loss_rtol * abs(b) for a, b in zip(la, lb))
    nonzero = sum(int(np.abs(ta[k][1]).sum() > 0) for k in ta if "lora_B" in k)
    print(f"{len(ta)} tensors, max relative difference {worst:.3g}, {len(bad)} outside tolerance; losses {la} vs {lb}; "
          f"{nonzero} lora_B tensors trained (non-zero)")
    if bad:
        print("furthest: " + ", ".join(f"{k} {r:.3g}" for r, k in sorted(rels, reverse=True)[:4]))
    if nonzero == 0:
        print("no lora_B moved: the comparison would be vacuous")
        return 1
    return 0 if not bad and loss_ok else 1


if __name__ == "__main__":
    sys.exit(main())
