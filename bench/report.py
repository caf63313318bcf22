#!/usr/bin/env python3
"""Markdown tables from one bench/run folder: eo-ddp's modes and the Python stack per model and
point, with the ratios the targets are stated in. Plots with --plot FILE.png (needs matplotlib).

    python3 bench/report.py OUT_DIR [--plot bench.png]
"""
import glob
import json
import os
import sys


def gb(x):
    return f"{x / 2**30:.2f} GiB" if x else "-"


def load(out):
    eo, py = [], []
    for f in sorted(glob.glob(os.path.join(out, "eo-*.json"))):
        eo += json.load(open(f))
    for f in sorted(glob.glob(os.path.join(out, "py-*.jsonl"))):
        for line in open(f):
            line = line.strip()
            if line.startswith("{"):
                py.append(json.loads(line))
    return eo, py


def main():
    out = sys.argv[1]
    eo, py = load(out)
    bw = next((r["pinned_bw_gbps"] for r in eo if r.get("pinned_bw_gbps")), 0)
    print(f"\npinned host->device bandwidth measured in the same run: {bw:.1f} GB/s\n")
    print("| model | seq x mb | run | s/step | tokens/s | peak VRAM (allocator) | plan | plan error | pinned host | "
          "staged/step | H2D GB/s | stall s/step | transfer floor s | vs eo resident | vs floor |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model in dict.fromkeys(r["model"] for r in eo):
        for point in dict.fromkeys((r["seq"], r["mb"]) for r in eo if r["model"] == model):
            rows = [r for r in eo if r["model"] == model and (r["seq"], r["mb"]) == point]
            res = next((r for r in rows if r["mode"] == "resident" and not r["error"]), None)
            for r in rows:
                name = f"eo-ddp {r['mode']}"
                if r["error"]:
                    print(f"| {model} | {point[0]}x{point[1]} | {name} | error: {r['error'][:120]} |")
                    continue
                err = (r["plan_vram"] - r["peak_vram"]) / r["peak_vram"] * 100 if r["peak_vram"] else 0
                vs_res = f"{r['s_per_step'] / res['s_per_step']:.2f}x" if res else "-"
                vs_floor = f"{r['s_per_step'] / r['floor_s']:.2f}x" if r["floor_s"] else "-"
                print(f"| {model} | {point[0]}x{point[1]} | {name} | {r['s_per_step']:.3f} | {r['tokens_per_s']:.0f} | "
                      f"{gb(r['peak_vram'])} | {gb(r['plan_vram'])} | {err:+.1f}% | {gb(r['pinned'])} | "
                      f"{r['staged_per_step'] / 1e9:.2f} GB | {r['h2d_gbps']:.1f} | {r['stall_s']:.3f} | "
                      f"{r['floor_s']:.3f} | {vs_res} | {vs_floor} |")
            for p in py:
                if os.path.basename(str(p.get("model", "")).rstrip("/")) != model or (p.get("seq"), p.get("mb")) != point:
                    continue
                name = f"python {p.get('mode')}"
                if p.get("error"):
                    print(f"| {model} | {point[0]}x{point[1]} | {name} | error: {str(p['error'])[:120]} |")
                    continue
                vs_res = f"{p['s_per_step'] / res['s_per_step']:.2f}x" if res else "-"
                note = "" if p.get("experts_quantized", True) else " (experts bf16)"
                print(f"| {model} | {point[0]}x{point[1]} | {name}{note} | {p['s_per_step']:.3f} | {p['tokens_per_s']:.0f} | "
                      f"{gb(p.get('peak_alloc_bytes', 0))} | | | | | | | | {vs_res} | |")
    if "--plot" in sys.argv:
        plot(eo, py, sys.argv[sys.argv.index("--plot") + 1])


def plot(eo, py, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels, tps, peak, colors = [], [], [], []
    palette = {"resident": "#4c72b0", "sync": "#c44e52", "prefetch": "#55a868", "budget": "#8172b2"}
    for r in eo:
        if r["error"]:
            continue
        labels.append(f"{r['model']}\n{r['seq']}x{r['mb']} {r['mode']}")
        tps.append(r["tokens_per_s"])
        peak.append(r["peak_vram"] / 2**30)
        colors.append(palette.get(r["mode"], "#999999"))
    for p in py:
        if p.get("error"):
            continue
        labels.append(f"{os.path.basename(str(p['model']).rstrip('/'))}\n{p['seq']}x{p['mb']} py {p['mode']}")
        tps.append(p["tokens_per_s"])
        peak.append(p.get("peak_alloc_bytes", 0) / 2**30)
        colors.append("#dd8452")
    fig, ax = plt.subplots(2, 1, figsize=(max(8, len(labels) * 0.55), 8))
    ax[0].bar(range(len(labels)), tps, color=colors)
    ax[0].set_ylabel("tokens/s")
    ax[1].bar(range(len(labels)), peak, color=colors)
    ax[1].set_ylabel("peak VRAM (GiB)")
    for a in ax:
        a.set_xticks(range(len(labels)))
        a.set_xticklabels(labels, rotation=90, fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
