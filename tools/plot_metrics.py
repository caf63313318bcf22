#!/usr/bin/env python3
"""Plot an eo-ddp metrics.jsonl (training and eval loss, throughput per step) to a PNG.

usage: tools/plot_metrics.py OUTPUT_DIR/metrics.jsonl [-o metrics.png]
"""
import argparse
import json
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("metrics", help="metrics.jsonl written by eo-ddp")
    ap.add_argument("-o", "--output", help="PNG to write (default: next to the metrics file)")
    args = ap.parse_args()

    rows = []
    with open(args.metrics) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                print(f"{args.metrics}:{n}: not JSON ({e}); skipped", file=sys.stderr)
    if not rows:
        print(f"{args.metrics}: no metrics", file=sys.stderr)
        return 1

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ax1.plot(steps, [r["loss"] for r in rows], color="tab:blue", label="train loss")
    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    if evals:  # val_set_size / test_datasets
        ax1.plot([s for s, _ in evals], [v for _, v in evals], "o-", color="tab:orange", label="eval loss")
        ax1.legend()
    ax1.set_ylabel("loss")
    ax1.grid(alpha=0.3)
    ax2.plot(steps, [r["tokens_per_sec"] for r in rows], color="tab:green")
    ax2.set_ylabel("tokens / s")
    ax2.set_xlabel("step")
    ax2.grid(alpha=0.3)
    fig.suptitle(args.metrics)
    fig.tight_layout()
    out = args.output or args.metrics.rsplit(".", 1)[0] + ".png"
    fig.savefig(out, dpi=100)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
