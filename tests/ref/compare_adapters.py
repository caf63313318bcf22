#!/usr/bin/env python3
"""Compare two eo-ddp runs: adapters (max abs/rel difference) and per-step losses.

usage: compare_adapters.py RUN_A RUN_B [--rtol R] [--loss-rtol L] [--exact]
Exit 0 when every LoRA tensor agrees in relative Frobenius norm (||a - b|| <= rtol * ||b||) and
every logged loss within loss-rtol. Element-wise tolerances do not suit Adam: an element whose
gradient is at rounding level can take a step of either sign, so a different (but equally right)
summation order moves it by up to 2 x lr; the norm of the whole tensor is what must agree.
"""
import argparse
import json
import sys

import torch
from safetensors.torch import load_file


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
    for k in sorted(ta):
        x, y = ta[k].double(), tb[k].double()
        rel = ((x - y).norm() / y.norm().clamp_min(1e-12)).item()
        ok = torch.equal(ta[k], tb[k]) if args.exact else rel <= args.rtol
        worst = max(worst, rel)
        if not ok:
            bad.append(k)
    la, lb = losses(args.a), losses(args.b)
    loss_ok = len(la) == len(lb) and all(
        (a == b) if args.exact else abs(a - b) <= args.loss_rtol * abs(b) for a, b in zip(la, lb))
    nonzero = sum(int(ta[k].abs().sum() > 0) for k in ta if "lora_B" in k)
    print(f"{len(ta)} tensors, max relative difference {worst:.3g}, {len(bad)} outside tolerance; losses {la} vs {lb}; "
          f"{nonzero} lora_B tensors trained (non-zero)")
    if nonzero == 0:
        print("no lora_B moved: the comparison would be vacuous")
        return 1
    return 0 if not bad and loss_ok else 1


if __name__ == "__main__":
    sys.exit(main())
