#!/usr/bin/env python3
"""The short table of scripts/device-timing: every eo-bench row (JSON) and the Python stack's, with
the steady s/step, the per-step device times, the transfer floor and how far the slowest and
fastest step are from the steady rate.  bench/timing_table.py OUT_DIR"""
import glob
import json
import os
import sys


def gib(b):
    return f"{b / 2**30:.2f} GiB" if b else "-"


def main(out):
    print("| row | mode | s/step (window) | step min / median / max | max step dev. | floor s | vs floor | tokens/s | peak |")
    print("|---|---|---|---|---|---|---|---|---|")
    for path in sorted(glob.glob(os.path.join(out, "*.json"))):
        name = os.path.basename(path)[:-5]
        for r in json.load(open(path)):
            if r.get("error"):
                print(f"| {name} {r['seq']}x{r['mb']} g{r['accum']} | {r['mode']} | error: {r['error'][:160]} |")
                continue
            s = r["s_per_step"]
            dev = max(abs(r["step_max_s"] - s), abs(s - r["step_min_s"])) / s if s else 0
            fl = r.get("floor_s", 0)
            print(f"| {name} {r['seq']}x{r['mb']} g{r['accum']} | {r['mode']} | {s:.4f} | {r['step_min_s']:.4f} / "
                  f"{r['step_median_s']:.4f} / {r['step_max_s']:.4f} | {100 * dev:.1f}% | {fl:.4f} | "
                  f"{(s / fl if fl else 0):.3f}x | {r['tokens_per_s']:.0f} | {gib(r['peak_vram'])} |")
    for path in sorted(glob.glob(os.path.join(out, "python-*.jsonl"))):
        for line in open(path):
            r = json.loads(line)
            if r.get("error"):
                print(f"| {os.path.basename(path)} | python {r.get('mode')} | error: {str(r['error'])[:160]} |")
                continue
            s = r["s_per_step"]
            dev = max(abs(r["s_per_step_max"] - s), abs(s - r["s_per_step_min"])) / s
            print(f"| python {r['model']} {r['seq']}x{r['mb']} | {r['mode']} | {s:.4f} | {r['s_per_step_min']:.4f} / "
                  f"{r['s_per_step_median']:.4f} / {r['s_per_step_max']:.4f} | {100 * dev:.1f}% | - | - | "
                  f"{r['tokens_per_s']:.0f} | {gib(r.get('peak_alloc_bytes'))} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "device-out")
