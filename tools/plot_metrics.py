#!/usr/bin/env python3
"""Plot an eo-ddp metrics.jsonl to a PNG: training loss (raw and smoothed) and eval loss, learning rate,
gradient norm, throughput, peak memory, and the host-to-device expert copy rate of an offloaded run.

usage: tools/plot_metrics.py OUTPUT_DIR/metrics.jsonl [-o metrics.png]
"""
import argparse
import json
import sys


def smoothed(values, weight=0.9):
    """TensorBoard's smoothing: an exponential moving average, debiased at the start."""
    out, ema = [], 0.0
    for i, v in enumerate(values, 1):
        ema = weight * ema + (1 - weight) * v
        out.append(ema / (1 - weight ** i))
    return out


def panel(ax, steps, rows, field, label, color, scale=1.0):
    points = [(s, r[field] * scale) for s, r in zip(steps, rows) if isinstance(r.get(field), (int, float))]
    if points:
        ax.plot([s for s, _ in points], [v for _, v in points], color=color)
    else:  # e.g. h2d_gbps without expert offload
        ax.text(0.5, 0.5, f"no {field} in this run", ha="center", va="center", transform=ax.transAxes, color="gray")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)


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
    fig, axes = plt.subplots(3, 2, figsize=(11, 9), sharex=True)
    (ax_loss, ax_lr), (ax_grad, ax_tok), (ax_mem, ax_h2d) = axes
    losses = [r["loss"] for r in rows]
    ax_loss.plot(steps, losses, color="tab:blue", alpha=0.35, label="train loss")
    ax_loss.plot(steps, smoothed(losses), color="tab:blue", label="train loss, smoothed")
    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    if evals:  # val_set_size / test_datasets
        ax_loss.plot([s for s, _ in evals], [v for _, v in evals], "o-", color="tab:orange", label="eval loss")
    ax_loss.legend()
    ax_loss.set_ylabel("loss")
    panel(ax_lr, steps, rows, "lr", "learning rate", "tab:purple")
    panel(ax_grad, steps, rows, "grad_norm", "gradient norm", "tab:red")
    panel(ax_tok, steps, rows, "tokens_per_sec", "tokens / s", "tab:green")
    panel(ax_mem, steps, rows, "peak_mem_bytes", "peak memory (GiB)", "tab:brown", scale=1 / 2**30)
    panel(ax_h2d, steps, rows, "h2d_gbps", "expert copies host to device (GB/s)", "tab:cyan")
    for ax in axes[-1]:
        ax.set_xlabel("step")
    fig.suptitle(args.metrics)
    fig.tight_layout()
    out = args.output or args.metrics.rsplit(".", 1)[0] + ".png"
    fig.savefig(out, dpi=100)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
