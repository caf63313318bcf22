#!/usr/bin/env python3
"""scripts/device-qwen35's tables, from the files it leaves in OUT_DIR:

    python3 bench/qwen35_report.py OUT_DIR

1. Per model and point: eo-ddp resident and offloaded (eo-bench's eo-*.json) beside transformers +
   peft (python_stack.py's py-*.jsonl), with issue 46's targets: eo-ddp at >= 1.5x the Python stack's
   speed (its s/step over eo's) and <= 0.35x its peak memory (allocator peaks both); offloaded at
   <= 1.15x its transfer floor; each plan within -5 % / +15 % of its measured peak. The Python row
   says which delta-rule and conv1d kernels transformers ran (a row on transformers' torch path is no
   fair anchor, and the table says so).
2. The gated delta rule alone (kernel-eo.json from eo-delta-rule, kernel-py.json from
   delta_rule_fla.py): forward and forward + backward per shape, eo beside fla, and fla's numbers
   against eo's on the same inputs.
"""
import glob
import json
import os
import sys

SPEED, MEMORY, FLOOR, PLAN_LOW, PLAN_HIGH = 1.5, 0.35, 1.15, -5.0, 15.0


def gib(x):
    return f"{x / 2**30:.2f} GiB" if x else "-"


def mark(ok):
    return "✓" if ok else "✗"


def load(out):
    eo, py = [], []
    for f in sorted(glob.glob(os.path.join(out, "eo-*.json"))):
        eo += json.load(open(f))
    for f in sorted(glob.glob(os.path.join(out, "py-*.jsonl"))):
        py += [json.loads(line) for line in open(f) if line.startswith("{")]
    kernel = []
    for f in ("kernel-eo.json", "kernel-py.json"):
        p = os.path.join(out, f)
        if os.path.exists(p):
            kernel += json.load(open(p))
    return eo, py, kernel


def model_tables(eo, py):
    lines = []
    models = list(dict.fromkeys([r["model"] for r in eo] +
                                [os.path.basename(str(p.get("model_dir", p.get("model", ""))).rstrip("/")) for p in py]))
    for model in models:
        mine = [r for r in eo if r["model"] == model]
        theirs = [p for p in py if os.path.basename(str(p.get("model_dir", "")).rstrip("/")) == model]
        points = list(dict.fromkeys([(r["seq"], r["mb"]) for r in mine] + [(p["seq"], p["mb"]) for p in theirs]))
        for seq, mb in points:
            rows = [r for r in mine if (r["seq"], r["mb"]) == (seq, mb)]
            p = next((p for p in theirs if (p["seq"], p["mb"]) == (seq, mb)), None)
            lines.append(f"\n### {model}, {seq} x {mb}\n")
            if p is None:
                lines.append("transformers + peft: no row (not run, or out of time)\n")
            elif p.get("error"):
                lines.append(f"transformers + peft: failed: {str(p['error'])[:300]}\n")
            else:
                torch_path = "torch path" in str(p.get("delta_rule_impl", ""))
                lines.append(f"transformers {p.get('transformers')} + peft {p.get('peft')}, fla {p.get('fla')}; "
                             f"delta rule: {p.get('delta_rule_impl')}; conv1d: {p.get('conv1d_impl')}; "
                             f"experts: {p.get('experts_impl')}; LoRA r {p.get('lora_r')} on {p.get('lora_modules')}"
                             + ("\n**The Python row ran transformers' torch delta rule, not fla's kernel: no fair "
                                "anchor.**" if torch_path else "") + "\n")
            py_ok = p is not None and not p.get("error") and p.get("s_per_step")
            lines.append("| run | s/step | tokens/s | peak VRAM | plan (error) | floor s (vs floor) | Python's s/step over eo's | "
                         "eo's peak over Python's |")
            lines.append("|---|---|---|---|---|---|---|---|")
            for r in rows:
                resident = r["mode"].split(":")[0] == "resident"
                name = f"eo-ddp {r['mode']}" if resident else f"eo-ddp offloaded ({r['mode']})"
                if r.get("error"):
                    lines.append(f"| {name} | failed: {r['error'][:200]} | | | | | | |")
                    continue
                err = 100 * (r["plan_vram"] / r["peak_vram"] - 1) if r["peak_vram"] else float("nan")
                plan = f"{gib(r['plan_vram'])} ({err:+.1f}% {mark(PLAN_LOW <= err <= PLAN_HIGH)})"
                floor = "-"
                if not resident and r.get("floor_s"):
                    v = r["s_per_step"] / r["floor_s"]
                    floor = f"{r['floor_s']:.3f} ({v:.2f}x {mark(v <= FLOOR)})"
                speed = memory = "-"
                if py_ok:
                    s = p["s_per_step"] / r["s_per_step"]
                    speed = f"{s:.2f}x {mark(s >= SPEED)}"
                    if p.get("peak_alloc_bytes"):
                        m = r["peak_vram"] / p["peak_alloc_bytes"]
                        memory = f"{m:.2f}x {mark(m <= MEMORY)}"
                lines.append(f"| {name} | {r['s_per_step']:.3f} | {r['tokens_per_s']:.0f} | {gib(r['peak_vram'])} | {plan} | "
                             f"{floor} | {speed} | {memory} |")
            if py_ok:
                lines.append(f"| transformers + peft (bf16 LoRA) | {p['s_per_step']:.3f} | {p['tokens_per_s']:.0f} | "
                             f"{gib(p.get('peak_alloc_bytes'))} | | | 1.00x | 1.00x |")
            bw = next((r.get("pinned_bw_gbps") for r in rows if r.get("pinned_bw_gbps")), 0)
            if bw:
                lines.append(f"\npinned host-to-device rate measured in the same run: {bw:.1f} GB/s")
    lines.append(f"\ntargets: Python's s/step over eo's >= {SPEED}x, eo's peak over Python's <= {MEMORY}x, offloaded "
                 f"<= {FLOOR}x its transfer floor, plan within {PLAN_LOW:+.0f}% / {PLAN_HIGH:+.0f}% of the measured peak")
    return lines


def kernel_table(rows):
    if not rows:
        return ["\n(no delta-rule kernel rows)"]
    head = next((r for r in rows if r.get("impl") not in ("eo", "eo-aten") and "device" in r), rows[0])
    lines = [f"\n### The gated delta rule alone: key heads {head.get('k_heads')} x {head.get('k_dim')}, value heads "
             f"{head.get('v_heads')} x {head.get('v_dim')}, {head.get('dtype')}, chunk 64; fla {head.get('fla', '-')}\n",
             "| B x T | documents | eo fwd ms | eo fwd + bwd ms | eo ATen-only fwd + bwd ms | fla fwd ms | fla fwd + bwd ms | fla (q/k expanded) fwd + bwd ms "
             "| transformers torch fwd + bwd ms | eo's fwd + bwd over fla's | peak MiB eo / fla |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    timed = [r for r in rows if "check" not in r]
    shapes = list(dict.fromkeys((r["B"], r["T"], r["docs"]) for r in timed))

    def get(impl, shape, key):
        r = next((r for r in timed if r["impl"] == impl and (r["B"], r["T"], r["docs"]) == shape), None)
        if r is None:
            return None, "-"
        if r.get(key) is None:
            return None, ("skipped" if str(r.get("error", "")).startswith("skipped") else "failed") if r.get("error") else "-"
        return r[key], f"{r[key]:.3f}" if key != "peak_mib" else f"{r[key]:.0f}"

    for shape in shapes:
        eo_f, eo_fs = get("eo", shape, "fwd_ms")
        eo_fb, eo_fbs = get("eo", shape, "fwd_bwd_ms")
        _, aten_fbs = get("eo-aten", shape, "fwd_bwd_ms")
        _, fla_fs = get("fla", shape, "fwd_ms")
        fla_fb, fla_fbs = get("fla", shape, "fwd_bwd_ms")
        _, flx_fbs = get("fla-expanded", shape, "fwd_bwd_ms")
        _, tor_fbs = get("torch", shape, "fwd_bwd_ms")
        _, eo_p = get("eo", shape, "peak_mib")
        _, fla_p = get("fla", shape, "peak_mib")
        ratio = f"{eo_fb / fla_fb:.2f}x" if eo_fb and fla_fb else "-"
        lines.append(f"| {shape[0]}x{shape[1]} | {shape[2]} | {eo_fs} | {eo_fbs} | {aten_fbs} | {fla_fs} | {fla_fbs} | {flx_fbs} | {tor_fbs} | "
                     f"{ratio} | {eo_p} / {fla_p} |")
    checks = [r for r in rows if "check" in r]
    if checks:
        lines.append("\nagainst eo's output and gradients on eo's inputs (the first shape): max |x - eo| / max |eo|\n")
        lines.append("| impl | out | dq | dk | dv | dg | dbeta |\n|---|---|---|---|---|---|---|")
        for r in checks:
            e = r["check"]
            if "error" in e:
                lines.append(f"| {r['impl']} | failed: {e['error'][:150]} | | | | | |")
            else:
                lines.append(f"| {r['impl']} | " + " | ".join(f"{e[k]:.1e}" for k in ("out", "dq", "dk", "dv", "dg", "dbeta")) + " |")
    return lines


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    eo, py, kernel = load(sys.argv[1])
    print("\n".join(model_tables(eo, py) + kernel_table(kernel)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
