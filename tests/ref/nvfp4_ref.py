#!/usr/bin/env python3
"""Reference for NVFP4 (NVIDIA modelopt) checkpoints (tests/test_model.cpp, Nvfp4.*): the decode
written from the format's definition in float64, transformers' Qwen3-MoE and peft on the decoded
weights — never from eo-ddp.

    nvfp4_ref.py qwen3_moe OUT_DIR

The format (modelopt's export, as vLLM's ModelOptNvFp4LinearMethod and its emulation
dequantize_to_dtype read it): for a linear P, P.weight uint8 [out, in / 2] holds FP4 E2M1 codes,
element 2j in the low nibble of byte j; P.weight_scale float8_e4m3fn [out, in / 16] one scale per
16 consecutive values of a row; P.weight_scale_2 a float32 global scale; the value is
e2m1(code) * e4m3(scale) * weight_scale_2. In float64 that product is exact (2 + 4 + 24
significant bits); the fp32 weight is that exact value rounded once to fp32, bf16 / fp16 that fp32
rounded to nearest even. (vLLM's emulation computes scale / (1 / weight_scale_2) and modelopt's
NVFP4QTensor.dequantize (scale * weight_scale_2) * e2m1 in fp32: each can differ from the exact
product by an fp32 ulp; the once-rounded exact product is the definition all three approximate.)
transformers 5.24 cannot load a pre-quantised NVFP4 checkpoint (its NVFP4 quantizer refuses
pre_quantized and needs a Blackwell GPU), so its model runs on the decoded weights, saved as a float
checkpoint.

Writes OUT_DIR/qwen3_moe/:
  model_plain/     tools/make_tiny_model.py --arch qwen3_moe (float)
  model_nvfp4/     tools/make_nvfp4_model.py of it: every decoder-block linear NVFP4 (modelopt layout)
  model_decoded/   model_nvfp4 decoded here (float32, the same names as model_plain)
  adapter_params/  peft LoRA on q/k/v/o_proj and (target_parameters) the fused experts, non-zero B
  ref.safetensors  grid.codes uint8 [256, 64], grid.scales uint8 [256, 8] (row r: scale byte r, so
                   every code with every scale byte: E4M3 subnormals, -0, the NaN bytes 0x7F / 0xFF),
                   grid.globals fp32 [G] (1, an ordinary scale, fp32 subnormals, the largest float,
                   0, a negative), grid.expected_f32 / _bf16 / _f16 [G, 256, 128];
                   tensor.<name>.expected_f32 for a few checkpoint linears; input_ids, labels,
                   logits, loss (transformers on model_decoded, fp32); logits_params, loss_params,
                   grad_params.<peft name> (peft on it, the adapter above)
"""
import json
import math
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fixture_dir  # noqa: E402

ARCH, OUT = sys.argv[1], sys.argv[2]
assert ARCH == "qwen3_moe"
HERE = os.path.dirname(os.path.abspath(__file__))
TINY = os.path.join(HERE, "tiny_model.py")  # tools/make_tiny_model.py through the test cache
TOOLS = os.path.join(HERE, "..", "..", "tools")
MAKE, QUANT = os.path.join(TOOLS, "make_tiny_model.py"), os.path.join(TOOLS, "make_nvfp4_model.py")
out = fixture_dir.begin(OUT, ARCH, __file__, MAKE, QUANT)
# The reference stack only when the fixture is to be made: an up-to-date or cached one exits above
# without paying its imports (~3 CPU seconds).
import param_wrapper_run  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
plain, nv, decoded, params_dir = (os.path.join(out, d) for d in ("model_plain", "model_nvfp4", "model_decoded", "adapter_params"))
subprocess.run([sys.executable, TINY, "--arch", ARCH, "--out", plain, "--seed", "5"], check=True, stdout=subprocess.DEVNULL)
subprocess.run([sys.executable, QUANT, plain, nv], check=True, stdout=subprocess.DEVNULL)


# ---- the decode, from the bit patterns, in float64
def e2m1(code):
    """E2M1 (bit 3 sign, bits 2-1 exponent with bias 1, bit 0 mantissa; exponent 0: subnormal)."""
    s, e, m = (code >> 3) & 1, (code >> 1) & 3, code & 1
    mag = (m / 2.0) if e == 0 else (1.0 + m / 2.0) * 2.0 ** (e - 1)
    return -mag if s else mag


def e4m3(byte):
    """float8_e4m3fn (bit 7 sign, 4 exponent bits with bias 7, 3 mantissa bits; exponent 0:
    subnormal; S.1111.111 NaN; no infinities)."""
    s, e, m = (byte >> 7) & 1, (byte >> 3) & 15, byte & 7
    if e == 15 and m == 7:
        return math.nan
    mag = (m / 8.0) * 2.0 ** -6 if e == 0 else (1.0 + m / 8.0) * 2.0 ** (e - 7)
    return -mag if s else mag


E2M1 = torch.tensor([e2m1(c) for c in range(16)], dtype=torch.float64)
E4M3 = torch.tensor([e4m3(b) for b in range(256)], dtype=torch.float64)
# the tables agree with torch's own float8_e4m3fn (NaN aside)
torch_e4m3 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float64)
assert torch.equal(torch_e4m3.isnan(), E4M3.isnan())
assert torch.equal(torch_e4m3[~E4M3.isnan()], E4M3[~E4M3.isnan()])
assert E2M1.tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]


def decode64(codes, scales, global_scale):
    """codes uint8 [out, in/2], scales uint8 bytes [out, in/16], global float → float64 [out, in], exact."""
    c = codes.to(torch.int64)
    vals = torch.stack([E2M1[c & 15], E2M1[c >> 4]], dim=-1).reshape(codes.shape[0], -1)  # low nibble first
    s = E4M3[scales.to(torch.int64)].repeat_interleave(16, dim=1)
    return vals * s * float(global_scale)


def to_f32(x64):
    return x64.to(torch.float32)  # IEEE round to nearest even, subnormals kept


ref = {}
g = torch.Generator().manual_seed(21)

# Every code with every scale byte: row r has scale byte r in each of its 8 groups; its 64 code
# bytes run through 0..63 (+64 * (r % 4)), so each low nibble meets each scale byte.
codes = ((torch.arange(64).view(1, 64) + 64 * (torch.arange(256).view(256, 1) % 4)) % 256).to(torch.uint8)
scales = torch.arange(256, dtype=torch.int32).view(256, 1).expand(256, 8).contiguous().to(torch.uint8)
globals_ = torch.tensor([1.0, 3.7252903e-09 * 98765.4321, 2.0 ** -140, 1.4e-45, 3.4028234663852886e38, 0.0, -0.75,
                         1.0 / 3.0], dtype=torch.float32)
expected = torch.stack([to_f32(decode64(codes, scales, gs)) for gs in globals_.tolist()])
ref["grid.codes"], ref["grid.scales"], ref["grid.globals"] = codes, scales, globals_
ref["grid.expected_f32"] = expected
ref["grid.expected_bf16"] = expected.to(torch.bfloat16)
ref["grid.expected_f16"] = expected.to(torch.float16)
# what the grid covers (checked here, so a change of the grid cannot silently drop a case)
assert expected.isnan().any() and expected.isinf().any()
assert ((expected.abs() > 0) & (expected.abs() < 1.1754943508222875e-38)).any()  # fp32 subnormal results
assert (expected.eq(0) & expected.signbit()).any()  # -0
assert set(range(1, 8)) <= set(scales[:, 0].tolist())  # E4M3 subnormal scale bytes

# ---- the checkpoint decoded: every NVFP4 linear to fp32, the rest as stored
sd = load_file(os.path.join(nv, "model.safetensors"))
dec = {}
for n, t in sd.items():
    if n.endswith((".weight_scale", ".weight_scale_2", ".input_scale")):
        continue
    p = n[: -len(".weight")] if n.endswith(".weight") else None
    if p is not None and p + ".weight_scale_2" in sd:
        w = to_f32(decode64(t, sd[p + ".weight_scale"].view(torch.uint8), float(sd[p + ".weight_scale_2"])))
        dec[n] = w
    else:
        dec[n] = t
for n in ("model.layers.1.mlp.experts.0.gate_proj.weight", "model.layers.2.mlp.experts.5.down_proj.weight",
          "model.layers.1.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight"):
    ref["tensor." + n + ".expected_f32"] = dec[n]
assert (sd["model.layers.1.mlp.experts.0.gate_proj.weight_scale"].view(torch.uint8).to(torch.int32) < 8).sum() >= 3
os.makedirs(decoded, exist_ok=True)
save_file(dec, os.path.join(decoded, "model.safetensors"), metadata={"format": "pt"})
for f in os.listdir(plain):
    if f != "model.safetensors":
        with open(os.path.join(plain, f), "rb") as src, open(os.path.join(decoded, f), "wb") as dst:
            dst.write(src.read())


def load():
    m = transformers.AutoModelForCausalLM.from_pretrained(decoded, dtype=torch.float32, attn_implementation="eager")
    return m.eval()


cfg = json.load(open(os.path.join(plain, "config.json")))
V = cfg["vocab_size"]
ids = torch.randint(0, V, (2, 13), generator=g)
labels = ids.clone()
labels[0, 3] = -100
labels[1, 7:9] = -100
ref["input_ids"], ref["labels"] = ids, labels
model = load()
# transformers' model holds the decoded weights (its fused experts are gate/up of each expert)
named = dict(model.named_parameters())
e0 = named["model.layers.1.mlp.experts.gate_up_proj"][0]
I = cfg["moe_intermediate_size"]
assert torch.equal(e0[:I], dec["model.layers.1.mlp.experts.0.gate_proj.weight"])
assert torch.equal(e0[I:], dec["model.layers.1.mlp.experts.0.up_proj.weight"])
with torch.no_grad():
    o = model(input_ids=ids, labels=labels)
    ref["logits"], ref["loss"] = o.logits, o.loss.reshape(1)
del model

# ---- LoRA as the axolotl example trains it: q/k/v/o_proj and the fused experts (peft's
# target_parameters), non-zero B; logits, loss and every gradient.
from peft import LoraConfig, get_peft_model  # noqa: E402

torch.manual_seed(11)
pm = get_peft_model(load(), LoraConfig(r=4, lora_alpha=8.0, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                       target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
param_wrapper_run.record(pm, ids, labels, torch.Generator().manual_seed(5), ref, params_dir)
fixture_dir.finish(out, ref)
