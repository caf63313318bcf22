#!/usr/bin/env python3
"""The gated delta rule alone on eo-delta-rule's shapes (bench/delta_rule.cpp), from Python:
flash-linear-attention's chunk_gated_delta_rule and transformers' torch_chunk_gated_delta_rule,
forward and forward + backward, timed on the device's clock the same way.

    python3 bench/delta_rule_fla.py [--model configs/models/qwen3-next-80b-a3b] [--seq 2048] [--batches 1,4]
        [--packed 4] [--shape HK,HV,DK,DV] [--iters 20] [--impls fla,fla-expanded,torch] [--check DIR] [--json FILE]

Implementations (each takes q / k with the model's key heads and v with its value heads, as eo's op does):
  fla           fla's kernel with its own grouping of value heads over key heads (GVA, HV > HK)
  fla-expanded  q / k repeat_interleave'd to the value heads first, then fla's kernel: how transformers'
                Qwen3-Next / Qwen3.5 layer calls it (the repeat and its backward are in the time)
  torch         transformers' torch_chunk_gated_delta_rule, q / k expanded as the layer does (the path
                transformers takes without fla); no packed rows (it has no cu_seqlens)
Inputs as eo-delta-rule makes them: q, k, v, beta in the compute dtype (bf16 on a GPU, fp32 on the
CPU), g (log decay) in fp32, L2 norm of q / k inside the kernel, chunks of 64; --packed N adds a row
of B 1 with N documents (fla: cu_seqlens). fla needs a GPU (Triton): elsewhere its rows are skipped
and the output says so.
--check DIR: each implementation on eo-delta-rule --dump DIR's inputs; its output and the five input
gradients against eo's, as max |x - eo| / max |eo| per tensor.
One JSON line per row on stdout after the table; --json FILE writes them as a list.
"""

import argparse
import json
import math
import os
import sys


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="configs/models/qwen3-next-80b-a3b")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batches", default="1,4")
    p.add_argument("--packed", type=int, default=4)
    p.add_argument("--shape", default="", help="HK,HV,DK,DV instead of the model's")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--impls", default="fla,fla-expanded,torch")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--check", default="", help="eo-delta-rule --dump folder")
    p.add_argument("--json", default="")
    return p.parse_args(argv)


def delta_shape(args):
    if args.shape:
        v = [int(x) for x in args.shape.split(",")]
        if len(v) != 4:
            sys.exit(f"--shape: expected HK,HV,DK,DV, got '{args.shape}'")
        return v
    c = json.load(open(os.path.join(args.model, "config.json")))
    t = c.get("text_config") if isinstance(c.get("text_config"), dict) else c
    try:
        return [t["linear_num_key_heads"], t["linear_num_value_heads"], t["linear_key_head_dim"], t["linear_value_head_dim"]]
    except KeyError as e:
        sys.exit(f"{args.model}: no gated delta-rule fields ({e}); pass --shape HK,HV,DK,DV")


def load_fla():
    """fla's chunk_gated_delta_rule, or (None, why not)."""
    try:
        import fla
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        from fla_triton import lift_triton_check
        return chunk_gated_delta_rule, lift_triton_check(getattr(fla, "__version__", "unknown"))
    except Exception as e:  # not installed, no Triton, no GPU backend
        return None, f"unavailable: {type(e).__name__}: {e}".strip()[:200]


def torch_path():
    """transformers' own torch_chunk_gated_delta_rule (the function under the hub-kernel wrapper)."""
    from transformers.models.qwen3_next import modeling_qwen3_next as m
    fn = m.torch_chunk_gated_delta_rule
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def make_impls(names, fla_fn, group):
    """name -> f(q, k, v, g, beta, cu_seqlens) -> o, or the reason it cannot run."""
    impls, skipped = {}, {}
    for name in names:
        if name in ("fla", "fla-expanded") and fla_fn is None:
            skipped[name] = "fla not importable here"
            continue
        if name == "fla":
            impls[name] = lambda q, k, v, g, beta, cu: fla_fn(q, k, v, g, beta, use_qk_l2norm_in_kernel=True,
                                                                cu_seqlens=cu)[0]
        elif name == "fla-expanded":
            impls[name] = lambda q, k, v, g, beta, cu: fla_fn(
                q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2), v, g, beta,
                use_qk_l2norm_in_kernel=True, cu_seqlens=cu)[0]
        elif name == "torch":
            fn = torch_path()

            def run_torch(q, k, v, g, beta, cu, fn=fn):
                if cu is not None:
                    raise NotImplementedError("no packed rows")
                return fn(q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2), v, g, beta,
                          chunk_size=64, use_qk_l2norm_in_kernel=True)[0]
            impls[name] = run_torch
        else:
            sys.exit(f"--impls: unknown '{name}' (fla, fla-expanded, torch)")
    return impls, skipped


def inputs(B, T, docs, hk, hv, dk, dv, dt, device, seed):
    import torch
    g = torch.Generator(device="cpu").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(device)  # noqa: E731
    x = {"q": r(B, T, hk, dk).to(dt), "k": r(B, T, hk, dk).to(dt), "v": r(B, T, hv, dv).to(dt),
         "g": torch.nn.functional.logsigmoid(r(B, T, hv) + 4), "beta": torch.sigmoid(r(B, T, hv)).to(dt),
         "dout": r(B, T, hv, dv).to(dt)}
    cu = None
    if docs > 1:
        cu = torch.arange(0, T + 1, T // docs, dtype=torch.long, device=device)
    return x, cu


def timed(device, iters, call):
    """Seconds per call over `iters` calls after 3 warm-up calls (CUDA events; wall clock on the CPU)."""
    import time
    import torch
    for _ in range(3):
        call()
    if device.type == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            call()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    return (time.perf_counter() - t0) / iters


def forward_backward(fn, x, cu):
    import torch
    leaves = [x[n].detach().requires_grad_() for n in ("q", "k", "v", "g", "beta")]
    o = fn(*leaves, cu)
    return o, torch.autograd.grad(o, leaves, x["dout"])


def bench_row(name, fn, x, cu, device, iters):
    import torch
    with torch.no_grad():
        fwd = timed(device, iters, lambda: fn(x["q"], x["k"], x["v"], x["g"], x["beta"], cu))
    fb = timed(device, iters, lambda: forward_backward(fn, x, cu))
    peak = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        forward_backward(fn, x, cu)
        torch.cuda.synchronize(device)
        peak = (torch.cuda.max_memory_allocated(device) - before) / 2**20
    return fwd, fb, peak


def check(impls, folder, device):
    """Each implementation on eo's dumped inputs: max |x - eo| / max |eo| for o and the gradients."""
    import torch
    index = json.load(open(os.path.join(folder, "index.json")))
    dt = torch.bfloat16 if index["dtype"] == "bf16" else torch.float32
    t = {}
    for name, shape in index["tensors"].items():
        data = torch.from_file(os.path.join(folder, name + ".f32"), size=math.prod(shape), dtype=torch.float32)
        t[name] = data.view(shape).to(device)
    x = {n: t[n].to(dt) for n in ("q", "k", "v", "beta", "dout")}
    x["g"] = t["g"]  # fp32, as eo's op got it
    cu = None
    if index["docs"] > 1:
        T = index["T"]
        cu = torch.arange(0, T + 1, T // index["docs"], dtype=torch.long, device=device)
    out = {}
    for name, fn in impls.items():
        try:
            o, grads = forward_backward(fn, x, cu)
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
            continue
        errs = {}
        for label, got in zip(("out", "dq", "dk", "dv", "dg", "dbeta"), (o, *grads)):
            want = t[label]
            errs[label] = float((got.detach().float() - want).abs().max() / want.abs().max().clamp_min(1e-30))
        out[name] = errs
    return out


def main(argv=None):
    args = parse_args(argv)
    import torch
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    hk, hv, dk, dv = delta_shape(args)
    if hv % hk:
        sys.exit(f"value heads {hv} are not a multiple of key heads {hk}")
    fla_fn, fla_version = load_fla() if device.type == "cuda" else (None, "skipped: fla needs a GPU (Triton)")
    names = [n.strip() for n in args.impls.split(",") if n.strip()]
    impls, skipped = make_impls(names, fla_fn, hv // hk)
    import transformers
    head = {"k_heads": hk, "v_heads": hv, "k_dim": dk, "v_dim": dv, "dtype": "bf16" if dt == torch.bfloat16 else "fp32",
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "fla": fla_version,
            "transformers": transformers.__version__, "torch": torch.__version__}
    print(f"# gated delta rule from Python: key heads {hk} x {dk}, value heads {hv} x {dv}, {head['dtype']}, chunk 64, "
          f"L2-normalised q/k; {head['device']}; fla {fla_version}; transformers {transformers.__version__}; "
          f"{args.iters} calls per row")
    for name, why in skipped.items():
        print(f"# {name}: skipped ({why})")
    shapes = [(int(b), args.seq, 1) for b in args.batches.split(",") if b.strip()]
    if args.packed > 1:
        if args.seq % args.packed:
            sys.exit("--packed N must divide --seq")
        shapes.append((1, args.seq, args.packed))
    print("\n| impl | B x T | documents | forward ms | forward + backward ms | peak MiB (fwd + bwd) |\n|---|---|---|---|---|---|")
    rows = []
    for B, T, docs in shapes:
        x, cu = inputs(B, T, docs, hk, hv, dk, dv, dt, device, seed=1234 + 7 * B + docs)
        for name, fn in impls.items():
            row = dict(head, impl=name, B=B, T=T, docs=docs)
            try:
                fwd, fb, peak = bench_row(name, fn, x, cu, device, args.iters)
                row.update(fwd_ms=fwd * 1e3, fwd_bwd_ms=fb * 1e3, peak_mib=peak, error=None)
                print(f"| {name} | {B}x{T} | {docs} | {fwd * 1e3:.3f} | {fb * 1e3:.3f} | "
                      f"{'-' if peak is None else f'{peak:.0f}'} |", flush=True)
            except NotImplementedError as e:
                row.update(fwd_ms=None, fwd_bwd_ms=None, peak_mib=None, error=f"skipped: {e}")
                print(f"| {name} | {B}x{T} | {docs} | skipped: {e} | | |", flush=True)
            except Exception as e:  # OOM, a kernel that does not build for this card
                row.update(fwd_ms=None, fwd_bwd_ms=None, peak_mib=None, error=f"{type(e).__name__}: {e}"[:300])
                print(f"| {name} | {B}x{T} | {docs} | error: {row['error'][:120]} | | |", flush=True)
            rows.append(row)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if args.check:
        errs = check(impls, args.check, device)
        print(f"\nagainst eo's output and gradients on the same inputs ({args.check}): max |x - eo| / max |eo|\n")
        print("| impl | out | dq | dk | dv | dg | dbeta |\n|---|---|---|---|---|---|---|")
        for name, e in errs.items():
            if "error" in e:
                print(f"| {name} | error: {e['error'][:120]} |")
            else:
                print(f"| {name} | " + " | ".join(f"{e[k]:.1e}" for k in ("out", "dq", "dk", "dv", "dg", "dbeta")) + " |")
            rows.append(dict(head, impl=name, check=e))
    for r in rows:
        print(json.dumps(r))
    if args.json:
        json.dump(rows, open(args.json, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
