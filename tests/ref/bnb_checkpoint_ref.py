#!/usr/bin/env python3
"""Pre-quantised bitsandbytes checkpoints and their reference logits (tests/test_bnb_checkpoint.cpp),
from bitsandbytes and transformers — never from eo-ddp.

    bnb_checkpoint_ref.py ARCH OUT_DIR

Writes OUT_DIR/ARCH/, each model folder a model.safetensors + config.json as transformers'
save_pretrained writes them for a bitsandbytes 4-bit model (Linear4bit `P` -> `P.weight` U8 packed
+ QuantState.as_dict(packed=True) under `P.weight.*`; config.json gains `quantization_config`):
  plain/      the float model (tools/make_tiny_model.py, seed 7); plain_fused/ in the fused layout
  nf4/        every decoder-block linear nf4, blocksize 64, no double quant. Each absmax block is
              then scaled by a random factor in [0.8, 1.25] (a valid quant state, just not the one
              quantize_4bit would compute from the dequantised weights), so a loader that ignores
              or recomputes the stored absmax gets other logits.
  nf4_dq/     the same with compress_statistics=True (nested absmax), bitsandbytes' own numbers
  mixed/      some decoder linears (and one router) nf4, the others float
  fp4/        every decoder-block linear fp4 (must be refused)
  fused_bnb/  experts in the fused layout with a bnb-quantised gate_up_proj (must be refused)
  ref.safetensors  input_ids, logits_<variant>: transformers on a copy of the float model whose
              weights are bitsandbytes' dequantisation of the stored ones (logits_mixed_4bit: the
              float decoder linears bnb-quantised too, as load_in_4bit does; logits_mixed_dense:
              they stay float).
"""
import json
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fixture_dir  # noqa: E402

ARCH, OUT = sys.argv[1], sys.argv[2]
HERE = os.path.dirname(os.path.abspath(__file__))
TINY = os.path.join(HERE, "tiny_model.py")  # tools/make_tiny_model.py through the test cache
TOOL = os.path.join(HERE, "..", "..", "tools", "make_tiny_model.py")
BLOCKSIZE = 64

out = fixture_dir.begin(OUT, ARCH, __file__, TOOL)
# The reference stack only when the fixture is to be made: an up-to-date or cached one exits above
# without paying its imports (~3 CPU seconds).
import torch  # noqa: E402
import transformers  # noqa: E402
import bitsandbytes.functional as bnbf  # noqa: E402
from bitsandbytes.backends.default.ops import _dequantize_4bit_compute  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
plain_dir = os.path.join(out, "plain")
for d, extra in ((plain_dir, []), (os.path.join(out, "plain_fused"), ["--fused-experts"])):
    subprocess.run([sys.executable, TINY, "--arch", ARCH, "--out", d, "--seed", "7"] + extra, check=True,
                   stdout=subprocess.DEVNULL)
plain = load_file(os.path.join(plain_dir, "model.safetensors"))
config = json.load(open(os.path.join(plain_dir, "config.json")))


def is_decoder_linear(key):
    """Attention projections, dense / shared-expert MLPs and per-expert matrices (not routers,
    the shared-expert gate, norms, biases, embeddings or lm_head)."""
    if ".layers." not in key or not key.endswith(".weight") or "norm" in key:
        return False
    module = key[: -len(".weight")].rsplit(".", 1)[1]
    return module in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


def quantize(w, quant_type="nf4", compress_statistics=False, absmax_scale_gen=None):
    """What transformers' save_pretrained writes for Linear4bit P, as {suffix: tensor} under P.weight,
    plus bitsandbytes' dequantisation of exactly that state (its generic kernel: bnb 0.50.2's
    native CPU dequantize_4bit is wrong for rows that are not a multiple of the blocksize, see
    tests/ref/model_ref.py)."""
    q, state = bnbf.quantize_4bit(w.contiguous(), blocksize=BLOCKSIZE, quant_type=quant_type,
                                  compress_statistics=compress_statistics)
    if absmax_scale_gen is not None:
        assert not state.nested
        state.absmax = state.absmax * (0.8 + 0.45 * torch.rand(state.absmax.shape, generator=absmax_scale_gen))
    packed = state.as_dict(packed=True)
    # Read the state back as transformers does on load, then dequantise.
    back = bnbf.QuantState.from_dict({"weight." + k: v for k, v in packed.items()}, device=torch.device("cpu"))
    absmax = back.absmax
    if back.nested:
        absmax = bnbf.dequantize_blockwise(back.absmax, back.state2) + back.offset
    deq = _dequantize_4bit_compute(q.reshape(-1), absmax.float(), back.code, back.blocksize, list(back.shape),
                                   torch.float32)
    files = {"": q}
    files.update({"." + k: v for k, v in packed.items()})
    return files, deq


def bnb_config(double_quant, quant_type="nf4", skip=None):
    c = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                                        bnb_4bit_use_double_quant=double_quant, bnb_4bit_compute_dtype=torch.float32,
                                        llm_int8_skip_modules=skip)
    return json.loads(json.dumps(c.to_dict(), default=str))  # save_pretrained writes the full to_dict()


def save_model(name, sd, qcfg):
    d = os.path.join(out, name)
    os.makedirs(d, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    cfg = dict(config)
    if qcfg is not None:
        cfg["quantization_config"] = qcfg
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"), indent=2)


g = torch.Generator().manual_seed(11)
ids = torch.randint(0, config["vocab_size"], (2, 13), generator=g)
ref = {"input_ids": ids}


def logits_of(float_sd):
    """transformers' fp32 logits of the plain model with `float_sd`'s weights."""
    d = os.path.join(out, "_reference")
    save_model("_reference", float_sd, None)
    m = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = m(input_ids=ids).logits
    shutil.rmtree(d)
    return logits


ref["logits_plain"] = logits_of(plain)

# ---- every decoder-block linear quantised: perturbed absmax / bnb's double quantisation
for variant, dq in (("nf4", False), ("nf4_dq", True)):
    gen = None if dq else torch.Generator().manual_seed(13)
    sd, deq_sd = {}, dict(plain)
    for k, w in plain.items():
        if not is_decoder_linear(k):
            sd[k] = w
            continue
        files, deq = quantize(w, compress_statistics=dq, absmax_scale_gen=gen)
        sd.update({k + s: t for s, t in files.items()})
        deq_sd[k] = deq
    save_model(variant, sd, bnb_config(dq))
    ref["logits_" + variant] = logits_of(deq_sd)

# ---- mixed: q_proj, o_proj, dense/shared down_proj, even experts and the layer-1 router quantised
ROUTER_1 = next(k for k in sorted(plain) if k.startswith("model.layers.1.") and k.endswith(".gate.weight"))


def mixed_pick(k):
    if k == ROUTER_1:
        return True  # a router stored 4-bit (routers may be quantised or not)
    if not is_decoder_linear(k):
        return False
    if ".experts." in k:
        return int(k.split(".experts.")[1].split(".")[0]) % 2 == 0
    return any(s in k for s in ("q_proj", "o_proj", "mlp.down_proj", "shared_expert.down_proj"))


sd, deq_4bit, deq_dense, skipped = {}, dict(plain), dict(plain), []
for k, w in plain.items():
    if mixed_pick(k):
        files, deq = quantize(w)
        sd.update({k + s: t for s, t in files.items()})
        deq_4bit[k] = deq_dense[k] = deq
    else:
        sd[k] = w
        if is_decoder_linear(k):  # load_in_4bit quantises it at load time, as bnb would
            deq_4bit[k] = quantize(w)[1]
            skipped.append(k[: -len(".weight")])
save_model("mixed", sd, bnb_config(False, skip=["lm_head"] + skipped))
ref["logits_mixed_4bit"] = logits_of(deq_4bit)
ref["logits_mixed_dense"] = logits_of(deq_dense)

# ---- fp4: refused by the loader
sd = {}
for k, w in plain.items():
    if is_decoder_linear(k):
        sd.update({k + s: t for s, t in quantize(w, quant_type="fp4")[0].items()})
    else:
        sd[k] = w
save_model("fp4", sd, bnb_config(False, quant_type="fp4"))

# ---- fused experts with a bnb-quantised gate_up_proj: refused by the loader
sd = {}
names = ("w1", "w3", "w2") if ARCH == "mixtral" else ("gate_proj", "up_proj", "down_proj")
for k, w in plain.items():
    if ".experts." not in k:
        sd[k] = w
        continue
    prefix, rest = k.split(".experts.")
    e, mat = int(rest.split(".")[0]), rest.split(".")[1]
    if e != 0 or mat != names[0]:
        continue
    n_exp = sum(1 for x in plain if x.startswith(prefix + ".experts.") and x.endswith("." + names[0] + ".weight"))
    ex = lambda i, m: plain[f"{prefix}.experts.{i}.{m}.weight"]
    gate_up = torch.stack([torch.cat([ex(i, names[0]), ex(i, names[1])], 0) for i in range(n_exp)])
    files, _ = quantize(gate_up.reshape(-1, gate_up.shape[-1]))
    sd.update({f"{prefix}.experts.gate_up_proj" + s: t for s, t in files.items()})
    sd[f"{prefix}.experts.down_proj"] = torch.stack([ex(i, names[2]) for i in range(n_exp)])
save_model("fused_bnb", sd, bnb_config(False))

fixture_dir.finish(out, ref)
