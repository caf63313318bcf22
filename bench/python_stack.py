#!/usr/bin/env python3
"""Benchmark of the Python stack users run today for MoE LoRA/QLoRA fine-tuning.

transformers + peft (+ bitsandbytes for QLoRA), random weights built from a
config.json (no download, no checkpoint), synthetic tokens. One JSON line per
(seq x micro-batch) point on stdout; failures (e.g. CUDA OOM) become a JSON line
with "error" and exit status 0 so a sweep keeps going.

Examples:
  # GPU, real shapes
  python bench/python_stack.py configs/models/qwen3-30b-a3b --mode bf16-lora --points 2048x1,2048x4
  # CPU smoke test on the tiny fixture
  python bench/python_stack.py fixtures/tiny-qwen3-moe --device cpu --mode qlora-bnb --seq 32 --mb 2
  # CPU, real architecture shrunk
  python bench/python_stack.py configs/models/mixtral-8x7b --device cpu --layers 2 \
      --override hidden_size=64,intermediate_size=128,num_attention_heads=4,num_key_value_heads=2,vocab_size=256

Notes on what this measures (the honest version of "the stack users run"):
  * qlora-bnb replaces every plain nn.Linear except lm_head with bnb.nn.Linear4bit
    (NF4, bf16 compute), the same rule transformers' BitsAndBytesConfig applies
    (transformers.integrations.bitsandbytes.replace_with_bnb_linear: `type(m) is nn.Linear`,
    output embedding excluded). transformers 5.x stores MoE experts as fused 3-D
    nn.Parameters (gate_up_proj / down_proj), not nn.Linear, so bitsandbytes leaves
    them in bf16. The output says so: "experts_quantized": false and the byte counts.
  * The router aux loss is in the loss only when config.output_router_logits is true
    (false in all three real configs); --router-aux on|off overrides that.
  * Qwen3-Next / Qwen3.5-MoE: transformers runs the gated delta rule on flash-linear-attention's
    chunk_gated_delta_rule when `fla` imports (its torch_chunk_gated_delta_rule otherwise, which is
    correct but far slower), and the short conv1d on causal-conv1d's kernel when that imports (F.conv1d
    otherwise). Each record says which ran ("delta_rule_impl", "conv1d_impl") and why fla did not
    ("fla"). The attn LoRA targets include the delta-rule layers' linears (linear_attn.in_proj_*,
    out_proj), as eo-bench's attention_linears() does.
"""

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
import traceback


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="folder holding config.json (e.g. configs/models/qwen3-30b-a3b)")
    p.add_argument("--mode", choices=["bf16-lora", "qlora-bnb"], default="bf16-lora")
    p.add_argument("--seq", type=int, default=2048, help="sequence length T (ignored when --points is given)")
    p.add_argument("--mb", type=int, default=1, help="micro-batch B (ignored when --points is given)")
    p.add_argument("--points", default=None, help='sweep, e.g. "2048x1,2048x4,4096x2" (seq x mb)')
    p.add_argument("--steps", type=int, default=5, help="timed steps per point")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per point")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="weight/compute dtype")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    p.add_argument("--override", default="", help="comma list key=value applied to the config (JSON values)")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lora-alpha", type=int, default=32)
    p.add_argument("--lora-targets", default="attn",
                   help="comma-separated module names, or attn: every linear of the attention blocks as the "
                        "architecture names them (eo-bench's default; DeepSeek: q_proj/q_a_proj, q_b_proj, "
                        "kv_a_proj_with_mqa, kv_b_proj, o_proj; Qwen3-Next / Qwen3.5: also the delta-rule "
                        "layers' in_proj_* and out_proj)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--router-aux", choices=["config", "on", "off"], default="config",
                   help="include the router load-balancing loss (default: as config.output_router_logits says)")
    p.add_argument("--experts-impl", default=None,
                   help="transformers experts_implementation (default: transformers' own choice, "
                        "grouped_mm where it can dispatch, else eager)")
    p.add_argument("--attn-impl", default=None, help="attn_implementation (default: transformers' choice, sdpa)")
    p.add_argument("--double-quant", action="store_true", help="bnb_4bit_use_double_quant (qlora-bnb)")
    p.add_argument("--no-grad-ckpt", action="store_true", help="disable gradient checkpointing")
    return p.parse_args(argv)


def parse_points(args):
    if not args.points:
        return [(args.seq, args.mb)]
    pts = []
    for item in args.points.split(","):
        item = item.strip().lower()
        if not item:
            continue
        try:
            t, b = item.split("x")
            pts.append((int(t), int(b)))
        except ValueError:
            sys.exit(f"--points: '{item}' is not SEQxMB (e.g. 2048x4)")
    if not pts:
        sys.exit("--points: no points given")
    return pts


def parse_overrides(text):
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        if "=" not in item:
            sys.exit(f"--override: '{item}' is not key=value")
        k, v = item.split("=", 1)
        try:
            out[k.strip()] = json.loads(v)
        except json.JSONDecodeError:
            out[k.strip()] = v  # plain string
    return out


def versions():
    import peft
    import torch
    import transformers
    try:
        import bitsandbytes as bnb
        bnb_v = bnb.__version__
    except Exception as e:  # not installed, or no backend for this machine
        bnb_v = f"unavailable: {type(e).__name__}: {e}".strip()[:200]
    return {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
            "bitsandbytes": bnb_v, "fla": fla_status(), "cuda": torch.version.cuda}


def fla_status():
    """flash-linear-attention's version, or why its gated delta rule does not import here. transformers
    resolves the kernel the same way (importlib, fla.ops.gated_delta_rule) when it first imports a
    delta-rule model's module, and takes its torch path on any error."""
    try:
        import fla
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: F401
        from fla_triton import lift_triton_check
        return lift_triton_check(getattr(fla, "__version__", "unknown"))
    except Exception as e:  # not installed, no Triton, no GPU backend
        return f"unavailable: {type(e).__name__}: {e}".strip()[:200]


def kernel_paths(model):
    """The functions transformers' delta-rule layers call, as resolved when their module was imported
    (transformers.integrations.hub_kernels.use_kernel_func_from_hub_with_fallback keeps the choice in
    the wrapper's closure): {"delta_rule_impl": ..., "conv1d_impl": ...}, or {} without such layers."""
    import inspect
    out = {}
    for m in model.modules():
        if not type(m).__name__.endswith("GatedDeltaNet"):
            continue
        mod = sys.modules[type(m).__module__]
        for key, name in (("delta_rule_impl", "torch_chunk_gated_delta_rule"), ("conv1d_impl", "causal_conv1d_fn")):
            fn = getattr(mod, name, None)
            impl = None
            for _ in range(4):  # through the hub-kernel wrappers down to the closure that holds the choice
                if fn is None:
                    break
                try:
                    nonlocals = inspect.getclosurevars(fn).nonlocals
                except TypeError:
                    break
                if "implementation" in nonlocals:
                    impl = nonlocals["implementation"]
                    break
                fn = getattr(fn, "__wrapped__", None)
            if impl is None:
                out[key] = f"unknown ({name} has no recorded implementation)"
            else:
                where = f"{impl.__module__}.{impl.__qualname__}"
                out[key] = where + (" (transformers' torch path)" if impl.__module__ == mod.__name__ else "")
        break
    return out


def load_config(args):
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(args.model)
    # A multimodal checkpoint (Gemma 4, Llama 4, Mistral 3): eo-ddp trains its text model, so the
    # Python side builds the same, with the wrapper's own embedding tie.
    text = cfg.get_text_config()
    if text is not cfg:
        text.tie_word_embeddings = getattr(cfg, "tie_word_embeddings", text.tie_word_embeddings)
        cfg = text
    ov = parse_overrides(args.override)
    if args.layers is not None:
        ov["num_hidden_layers"] = args.layers
    for k, v in ov.items():
        if not hasattr(cfg, k):
            sys.exit(f"--override: config of {args.model} has no field '{k}'")
        setattr(cfg, k, v)
    if "num_hidden_layers" in ov and hasattr(cfg, "layer_types") and cfg.layer_types is not None:
        cfg.layer_types = cfg.layer_types[: cfg.num_hidden_layers]
    if args.router_aux != "config":
        cfg.output_router_logits = args.router_aux == "on"
    cfg.use_cache = False
    return cfg, ov


def build_model(cfg, args, device, dtype):
    """Random-init model built directly on `device` (no CPU copy, no download), seeded."""
    import torch
    from transformers import AutoModelForCausalLM
    torch.manual_seed(args.seed)
    kw = {"dtype": dtype}
    if args.experts_impl:
        kw["experts_implementation"] = args.experts_impl
    if args.attn_impl:
        kw["attn_implementation"] = args.attn_impl
    # Under a device context every parameter is allocated on `device` and transformers'
    # own _init_weights (normal_(std=initializer_range), ones for norms) runs there.
    with torch.device(device):
        try:
            model = AutoModelForCausalLM.from_config(cfg, **kw)
        except ValueError:
            # A text model the auto mapping leaves out (transformers 5.24 maps no Mistral4Config to a
            # causal LM, though modeling_mistral4 defines Mistral4ForCausalLM): its class by name.
            import transformers
            cls = getattr(transformers, type(cfg).__name__.replace("Config", "ForCausalLM"), None)
            if cls is None:
                raise
            model = cls._from_config(cfg, **kw)
    return model


def quantize_bnb_nf4(model, device, dtype, double_quant):
    """Swap nn.Linear (not lm_head) for bnb Linear4bit NF4, like BitsAndBytesConfig(load_in_4bit=True,
    bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=bf16) does at load time."""
    import bitsandbytes as bnb
    import torch
    from torch import nn
    out_emb = model.get_output_embeddings()
    names = [n for n, m in model.named_modules() if type(m) is nn.Linear and m is not out_emb]
    for name in names:
        old = model.get_submodule(name)
        new = bnb.nn.Linear4bit(old.in_features, old.out_features, bias=old.bias is not None,
                                compute_dtype=dtype, compress_statistics=double_quant, quant_type="nf4",
                                device="meta")
        new.weight = bnb.nn.Params4bit(old.weight.data, requires_grad=False, compress_statistics=double_quant,
                                       quant_type="nf4", module=new)
        if old.bias is not None:
            new.bias = nn.Parameter(old.bias.data, requires_grad=False)
        new.weight = new.weight.to(device)  # quantizes (Params4bit._quantize)
        new.requires_grad_(False)
        model.set_submodule(name, new)
        del old
    return len(names)


def weight_census(model):
    """Bytes of quantized vs unquantized weights, and whether the MoE experts were quantized."""
    import bitsandbytes as bnb_mod  # noqa: F401  (only called in qlora mode)
    from bitsandbytes.nn import Params4bit
    c = {"quantized_bytes": 0, "unquantized_bytes": 0, "expert_params": 0, "expert_params_quantized": 0,
         "expert_bytes": 0}
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        q = isinstance(p, Params4bit)
        c["quantized_bytes" if q else "unquantized_bytes"] += nbytes
        if ".experts." in name:  # fused 3-D expert tensors, e.g. mlp.experts.gate_up_proj
            c["expert_params"] += 1
            c["expert_params_quantized"] += int(q)
            c["expert_bytes"] += nbytes
    return c


def apply_lora(model, args):
    from peft import LoraConfig, get_peft_model
    import torch
    if args.lora_targets == "attn":
        # The delta-rule layers' linears too (Qwen3-Next / Qwen3.5 linear_attn.*), as eo's attention_linears().
        targets = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                          if (".self_attn." in n or ".linear_attn." in n) and isinstance(m, torch.nn.Linear)})
    else:
        targets = [t.strip() for t in args.lora_targets.split(",") if t.strip()]
    lcfg = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=0.0, bias="none",
                      target_modules=targets,
                      task_type="CAUSAL_LM")
    return get_peft_model(model, lcfg), targets


def sync(device):
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_point(model, opt, cfg, seq, mb, args, device):
    import torch
    g = torch.Generator(device="cpu").manual_seed(args.seed + 7919 * seq + mb)
    ids = torch.randint(0, cfg.vocab_size, (mb, seq), generator=g).to(device)
    labels = ids.clone()

    def step():
        opt.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=labels)
        out.loss.backward()
        opt.step()
        return out

    # Timed as eo-bench times eo-ddp: one window on the device's clock from the end of the last
    # warm-up step to the end of the last timed step (CUDA events; a window closed by a sync on
    # the CPU), divided by the timed steps; per-step event times give min / median / max.
    for _ in range(args.warmup):
        step()
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    cuda = device.type == "cuda"
    marks, outs = [], []
    def mark():
        if cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()
    marks.append(mark())
    for _ in range(args.steps):
        out = step()
        outs.append(out.loss.detach())
        marks.append(mark())
        if getattr(out, "aux_loss", None) is not None:
            outs[-1] = (outs[-1], out.aux_loss.detach())
    sync(device)
    if cuda:
        times = [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])]
        window = marks[0].elapsed_time(marks[-1]) / 1e3
    else:
        times = [b - a for a, b in zip(marks, marks[1:])]
        window = marks[-1] - marks[0]
    losses, aux = [], None
    for o in outs:
        if isinstance(o, tuple):
            o, a_ = o
            aux = float(a_.float().cpu())
        losses.append(float(o.float().cpu()))
    s = window / args.steps
    r = {"s_per_step": s, "s_per_step_min": min(times), "s_per_step_median": statistics.median(times),
         "s_per_step_max": max(times),
         "tokens_per_s": seq * mb / s, "loss_first": losses[0], "loss_last": losses[-1],
         "aux_loss_last": aux, "loss_finite": all(math.isfinite(x) for x in losses)}
    if device.type == "cuda":
        r["peak_alloc_bytes"] = torch.cuda.max_memory_allocated(device)
        r["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    else:
        r["peak_alloc_bytes"] = None
        r["peak_reserved_bytes"] = None
    return r


def free(device):
    import torch
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def emit(rec):
    print(json.dumps(rec), flush=True)


def err_text(e):
    return f"{type(e).__name__}: {e}".strip()[:2000]


def main(argv=None):
    args = parse_args(argv)
    points = parse_points(args)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import warnings
    # transformers 5.2x renamed gradient_checkpointing_enable (still present, FutureWarning); 5.17 has only the old name.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"transformers\.modeling_utils")
    import torch
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    base = {"model": os.path.basename(os.path.normpath(args.model)), "model_dir": args.model, "mode": args.mode,
            "device": str(device), "dtype": args.dtype, "steps": args.steps, "warmup": args.warmup,
            "seed": args.seed, "lora_r": args.lora_r, "lora_alpha": args.lora_alpha,
            "lora_targets": args.lora_targets, "grad_ckpt": not args.no_grad_ckpt}
    base.update(versions())
    if device.type == "cuda" and torch.cuda.is_available():
        base["gpu"] = torch.cuda.get_device_name(device)

    model = opt = None
    setup = {}
    setup_error = None
    try:
        cfg, ov = load_config(args)
        base["overrides"] = ov or None
        base["router_aux_in_loss"] = bool(getattr(cfg, "output_router_logits", False))
        torch.manual_seed(args.seed)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        model = build_model(cfg, args, device, dtype)
        sync(device)
        setup["build_s"] = time.perf_counter() - t0
        setup["params_total"] = sum(p.numel() for p in model.parameters())
        setup["experts_impl"] = getattr(model.config, "_experts_implementation", None)
        setup["attn_impl"] = getattr(model.config, "_attn_implementation", None)
        setup.update(kernel_paths(model))
        if args.mode == "qlora-bnb":
            t0 = time.perf_counter()
            setup["quantized_linears"] = quantize_bnb_nf4(model, device, dtype, args.double_quant)
            free(device)
            sync(device)
            setup["quantize_s"] = time.perf_counter() - t0
            census = weight_census(model)
            setup.update(census)
            # Experts count as quantized only if every expert parameter is a 4-bit Params4bit.
            setup["experts_quantized"] = census["expert_params"] > 0 and \
                census["expert_params_quantized"] == census["expert_params"]
        else:
            setup["experts_quantized"] = None  # not applicable: nothing is quantized in bf16-lora
        if not args.no_grad_ckpt:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model, setup["lora_modules"] = apply_lora(model, args)
        model.train()
        trainable = [p for p in model.parameters() if p.requires_grad]
        setup["params_trainable"] = sum(p.numel() for p in trainable)
        opt = torch.optim.AdamW(trainable, lr=args.lr)
        if device.type == "cuda":
            setup["model_alloc_bytes"] = torch.cuda.memory_allocated(device)
            setup["setup_peak_alloc_bytes"] = torch.cuda.max_memory_allocated(device)
    except Exception as e:  # OOM while building, bnb missing, bad config ...
        setup_error = err_text(e)
        if not isinstance(e, torch.OutOfMemoryError):
            traceback.print_exc(file=sys.stderr)
        model = opt = None
        free(device)

    for seq, mb in points:
        rec = dict(base)
        rec.update({"seq": seq, "mb": mb, "tokens_per_step": seq * mb})
        rec.update(setup)
        if setup_error is not None:
            rec.update({"s_per_step": None, "tokens_per_s": None, "peak_alloc_bytes": None,
                        "peak_reserved_bytes": None, "error": "setup: " + setup_error})
            emit(rec)
            continue
        try:
            rec.update(run_point(model, opt, model.config, seq, mb, args, device))
            rec["error"] = None
        except Exception as e:
            if not isinstance(e, torch.OutOfMemoryError):
                traceback.print_exc(file=sys.stderr)
            rec.update({"s_per_step": None, "tokens_per_s": None, "error": err_text(e)})
            if device.type == "cuda":
                rec["peak_alloc_bytes"] = torch.cuda.max_memory_allocated(device)
                rec["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
        finally:
            opt.zero_grad(set_to_none=True)
            free(device)
        emit(rec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
