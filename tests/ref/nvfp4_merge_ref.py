#!/usr/bin/env python3
"""Reference for nvfp4_merge_aware (tests/test_model.cpp, Nvfp4MergeAware.*): axolotl 0.19.0's
merge-aware NVFP4 LoRA written here from its definition, never from eo-ddp.

    nvfp4_merge_ref.py qwen3_moe OUT_DIR

The quantiser Q is axolotl's fake_quant_nvfp4 (integrations/kernels/libs/sonicmoe/nvfp4_quant.py),
which is torchao 0.18's nvfp4_quantize with a per-tensor scale g (prototype/mx_formats/
nvfp4_tensor.py) followed by NVFP4Tensor.dequantize. Its steps, each one IEEE fp32 operation, are
emulated here with numpy float32 arithmetic (correctly rounded, as the fp32 ops are), per 16
consecutive values of the last dim:
    bs = amax / 6;  s = e4m3(clamp(bs / g, 2^-6, 448))     (2^-6 = finfo(float8_e4m3fn).tiny)
    v  = clamp(x * ((1 / g) / s), -6, 6);  code = nearest E2M1 value, ties to the even code
    Q  = code * (g * s)
e4m3 rounding (to nearest even, 3 mantissa bits) and the E2M1 choice (smallest distance over the
eight magnitudes, a tie to the even index) are computed in float64 from those float32 values, which
is exact; the e4m3 rounding is also checked against torch's float8_e4m3fn cast. (Checked once by hand
against torchao 0.18.0 itself, nvfp4_quantize + NVFP4Tensor.dequantize on CPU: the same bits on
every fq case; torchao is not a test dependency.)

The model part: transformers' Qwen3-MoE on the NVFP4 checkpoint's weights decoded in float64 (as
tests/ref/nvfp4_ref.py), LoRA on q/k/v/o_proj and (peft target_parameters) the fused experts, the
adapter saved by peft with non-zero B. The merge-aware forward replaces each adapted weight by
Q(W + scaling * B A) with the straight-through gradient (autograd: Q's backward is the identity),
as axolotl's merge_aware_linear.py (linears: W + (B @ A) * scaling) and nvfp4_lora.py's
_merge_aware_wfq (experts: W + bmm(B_e, A_e * scaling), g per expert; gate_up_proj on the larger of
gate's and up's global scales) do. Without Q the same code must give peft's own loss (the layouts).

Writes OUT_DIR/qwen3_moe/: model_nvfp4/, adapter_params/, ref.safetensors with
  fq.<case>.x, fq.<case>.g, fq.<case>.expected   the quantiser cases (x fp32 or bf16)
  input_ids, labels; plain.loss (peft); ma.loss and ma.grad.<peft name> (merge-aware, fp32)
"""
import json
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
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
plain, nv, decoded, params_dir = (os.path.join(out, d) for d in ("model_plain", "model_nvfp4", "model_decoded", "adapter_params"))
subprocess.run([sys.executable, TINY, "--arch", ARCH, "--out", plain, "--seed", "7"], check=True, stdout=subprocess.DEVNULL)
subprocess.run([sys.executable, QUANT, plain, nv], check=True, stdout=subprocess.DEVNULL)

F32 = np.float32
E2M1_MAG = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def e4m3_round(v):
    """float64 values in [2^-6, 448] (normal E4M3 range) to the nearest E4M3 value, ties to even."""
    e = np.floor(np.log2(v))
    step = 2.0 ** (e - 3)
    q = np.rint(v / step) * step  # np.rint: half to even; v / step exact (a power of two)
    return q


def e2m1_round(v):
    """float64 values in [-6, 6] to the nearest E2M1 value: the smallest distance, a tie to the even
    index (the code's mantissa bit 0); the sign kept (so a negative value rounding to 0 is -0)."""
    d = np.abs(np.abs(v)[..., None] - E2M1_MAG)
    best = d.min(-1, keepdims=True)
    cand = d == best
    idx = np.where(cand[..., ::2].any(-1), np.argmax(cand & (np.arange(8) % 2 == 0), -1), np.argmax(cand, -1))
    return np.copysign(E2M1_MAG[idx], v)


def fake_quant(x, g):
    """x float32 ndarray [lead, ..., K], g float32 [lead] (or [1]) → Q(x) float32, torchao's steps."""
    shape = x.shape
    lead = g.size
    blocks = x.astype(F32).reshape(lead, -1, 16)
    g2 = g.astype(F32).reshape(lead, 1)
    amax = np.abs(blocks).max(-1)
    bs = amax / F32(6.0)
    scaled = np.clip(bs / g2, F32(2.0 ** -6), F32(448.0))
    s = e4m3_round(scaled.astype(np.float64)).astype(F32)  # exact in fp32 (4 significant bits)
    chk = torch.from_numpy(scaled.copy()).to(torch.float8_e4m3fn).to(torch.float32).numpy()
    assert np.array_equal(chk, s), "e4m3 rounding disagrees with torch's float8_e4m3fn cast"
    recip = (F32(1.0) / g2) / s
    v = np.clip(blocks * recip[..., None], F32(-6.0), F32(6.0))
    code = e2m1_round(v.astype(np.float64)).astype(F32)
    return (code * (g2 * s)[..., None]).reshape(shape).astype(F32)


ref = {}
rng = np.random.default_rng(3)

# ---- the quantiser cases
cases = {}
# per-expert global scales as modelopt sets them (amax / (6 * 448)), on normal weights
x = rng.standard_normal((3, 8, 64)).astype(F32) * F32(0.02)
cases["experts"] = (x, (np.abs(x).reshape(3, -1).max(-1) / F32(6 * 448)).astype(F32))
# ties: g = 2^-10 and block amax 6 * 2^-10, so s = 1 and v = x * 2^10 exactly: every E2M1 midpoint,
# both signs, beside the grid values themselves
mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 3.0, 4.0, 0.0, 0.1, 5.9, 0.2499, 0.2501])
tie = np.stack([np.concatenate([[6.0], mids[:15]]), np.concatenate([[-6.0], -mids[:15]]),
                np.concatenate([[6.0], mids[1:]]), np.concatenate([[6.0], -mids[1:]])]) * 2.0 ** -10
cases["ties"] = (tie.astype(F32).reshape(1, 4, 16), np.array([2.0 ** -10], F32))
# zero blocks, -0, tiny blocks whose scale takes the 2^-6 floor, blocks whose scale saturates at 448
z = rng.standard_normal((2, 4, 32)).astype(F32)
z[0, 0, :16] = 0.0
z[0, 1, :16] = -0.0
z[0, 2, :16] *= F32(1e-9)
z[1, 3, 16:] *= F32(1e4)
z[1, 0, :16] = F32(-1e-3) * np.abs(z[1, 0, :16])  # small negatives that round to -0
cases["edges"] = (z, np.array([1.0 / (6 * 448), 2.0 ** -20], F32))
# a linear: one global scale over a 2-D weight, and scales landing on E4M3 subnormal-adjacent values
w = rng.standard_normal((24, 48)).astype(F32) * F32(0.05)
cases["linear"] = (w, np.array([np.abs(w).max() / (6 * 448) * 5.0], F32))
for name, (xv, gv) in cases.items():
    ref[f"fq.{name}.x"] = torch.from_numpy(xv.copy())
    ref[f"fq.{name}.g"] = torch.from_numpy(gv.copy())
    ref[f"fq.{name}.expected"] = torch.from_numpy(fake_quant(xv, gv))
# bf16 input: torchao quantises its fp32 value and dequantises to bf16
xb = torch.from_numpy(cases["experts"][0].copy()).to(torch.bfloat16)
ref["fq.bf16.x"], ref["fq.bf16.g"] = xb, ref["fq.experts.g"].clone()
ref["fq.bf16.expected"] = torch.from_numpy(fake_quant(xb.float().numpy(), cases["experts"][1])).to(torch.bfloat16)
# what the cases cover (checked here, so that a change cannot silently drop one)
t = ref["fq.ties.expected"].numpy() * 2.0 ** 10
assert t[0, 0, 1] == 0.0 and t[0, 0, 2] == 1.0 and t[0, 0, 3] == 1.0 and t[0, 0, 4] == 2.0 and t[0, 0, 5] == 2.0
assert t[0, 0, 6] == 4.0 and t[0, 0, 7] == 4.0 and t[0, 1, 1] == 0.0 and np.signbit(t[0, 1, 1])
e = ref["fq.edges.expected"].numpy()
assert (e[0, 0, :16] == 0).all() and np.signbit(e[0, 1, :16]).all() and np.signbit(e[1, 0, :16]).any()

# ---- the checkpoint decoded in float64 (nvfp4_ref.py's decode), transformers on it
E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)


def e4m3_byte(b):
    s, e, m = (b >> 7) & 1, (b >> 3) & 15, b & 7
    mag = float("nan") if (e == 15 and m == 7) else (m / 8.0) * 2.0 ** -6 if e == 0 else (1.0 + m / 8.0) * 2.0 ** (e - 7)
    return -mag if s else mag


E4M3 = torch.tensor([e4m3_byte(b) for b in range(256)], dtype=torch.float64)
sd = load_file(os.path.join(nv, "model.safetensors"))
dec, glob = {}, {}
for n, tt in sd.items():
    if n.endswith((".weight_scale", ".weight_scale_2", ".input_scale")):
        continue
    p = n[: -len(".weight")] if n.endswith(".weight") else None
    if p is not None and p + ".weight_scale_2" in sd:
        c = tt.to(torch.int64)
        vals = torch.stack([E2M1[c & 15], E2M1[c >> 4]], dim=-1).reshape(tt.shape[0], -1)
        sc = E4M3[sd[p + ".weight_scale"].view(torch.uint8).to(torch.int64)].repeat_interleave(16, dim=1)
        dec[n] = (vals * sc * float(sd[p + ".weight_scale_2"])).to(torch.float32)
        glob[p] = sd[p + ".weight_scale_2"].to(torch.float32).reshape(1)
    else:
        dec[n] = tt
os.makedirs(decoded, exist_ok=True)
save_file(dec, os.path.join(decoded, "model.safetensors"), metadata={"format": "pt"})
for f in os.listdir(plain):
    if f != "model.safetensors":
        with open(os.path.join(plain, f), "rb") as src, open(os.path.join(decoded, f), "wb") as dst:
            dst.write(src.read())
cfg = json.load(open(os.path.join(plain, "config.json")))
V, E, I, L = cfg["vocab_size"], cfg["num_local_experts"], cfg["moe_intermediate_size"], cfg["num_hidden_layers"]


def load():
    return transformers.AutoModelForCausalLM.from_pretrained(decoded, dtype=torch.float32, attn_implementation="eager").eval()


g = torch.Generator().manual_seed(23)
ids = torch.randint(0, V, (2, 11), generator=g)
labels = ids.clone()
labels[0, 2] = -100
ref["input_ids"], ref["labels"] = ids, labels

# ---- peft's adapter (the axolotl example's targets), non-zero B; its loss without Q
from peft import LoraConfig, get_peft_model  # noqa: E402

R, ALPHA = 4, 8.0
SCALING = ALPHA / R
torch.manual_seed(13)
pm = get_peft_model(load(), LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                       target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
gl = torch.Generator().manual_seed(9)
with torch.no_grad():
    for n, p in pm.named_parameters():
        if "lora_B" in n:
            p.copy_(0.05 * torch.randn(p.shape, generator=gl))
peft_loss = pm(input_ids=ids, labels=labels).loss.detach()
ref["plain.loss"] = peft_loss.reshape(1)
pm.save_pretrained(params_dir)
del pm
lora = {k: v.clone().requires_grad_(True) for k, v in load_file(os.path.join(params_dir, "adapter_model.safetensors")).items()}


class STE(torch.autograd.Function):
    """Q in forward (the numpy emulation above), the identity in backward."""

    @staticmethod
    def forward(ctx, w, gs):
        return torch.from_numpy(fake_quant(w.detach().numpy(), gs.numpy()))

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def run(snap):
    """Loss of transformers' model with every adapted weight replaced by W + delta, snapped by Q
    (straight-through) when `snap`."""
    m = load()
    for prm in m.parameters():
        prm.requires_grad_(False)
    q = (lambda w, gs: STE.apply(w, gs)) if snap else (lambda w, gs: w)
    for li in range(L):
        pre = f"model.layers.{li}"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            mod = m.get_submodule(f"{pre}.self_attn.{proj}")
            a, b = lora[f"base_model.model.{pre}.self_attn.{proj}.lora_A.weight"], lora[f"base_model.model.{pre}.self_attn.{proj}.lora_B.weight"]
            w0, gs = mod.weight.detach(), glob[f"{pre}.self_attn.{proj}"]
            # merge_aware_linear.py: w + (lora_b @ lora_a).to(w.dtype) * scaling
            mod.forward = (lambda x, w0=w0, a=a, b=b, gs=gs: torch.nn.functional.linear(x, q(w0 + (b @ a) * SCALING, gs)))
        try:
            ex = m.get_submodule(f"{pre}.mlp.experts")
        except AttributeError:
            continue  # the dense layer
        # peft nests the two ParamWrappers, gate_up_proj's inner (.base_layer); the shapes agree
        gu_a, gu_b = (lora[f"base_model.model.{pre}.mlp.experts.base_layer.lora_{k}.weight"] for k in "AB")
        dn_a, dn_b = (lora[f"base_model.model.{pre}.mlp.experts.lora_{k}.weight"] for k in "AB")
        H = gu_a.shape[1]
        assert gu_a.shape == (R * E, H) and gu_b.shape == (2 * I, R * E) and dn_a.shape == (R * E, I) and dn_b.shape == (H, R * E)

        def delta(a, b, out_dim, in_dim):
            # nvfp4_lora.py _merge_aware_wfq: A [E, r, in] (E-outer rows), B [E, out, r] (r-outer cols)
            return torch.bmm(b.reshape(out_dim, R, E).permute(2, 0, 1).contiguous(), a.reshape(E, R, in_dim) * SCALING)

        g_gate = torch.cat([glob[f"{pre}.mlp.experts.{e}.gate_proj"] for e in range(E)])
        g_up = torch.cat([glob[f"{pre}.mlp.experts.{e}.up_proj"] for e in range(E)])
        g_down = torch.cat([glob[f"{pre}.mlp.experts.{e}.down_proj"] for e in range(E)])
        wgu, wdn = ex.gate_up_proj.detach().clone(), ex.down_proj.detach().clone()
        del ex._parameters["gate_up_proj"], ex._parameters["down_proj"]

        def hook(mod, args, wgu=wgu, wdn=wdn, gu_a=gu_a, gu_b=gu_b, dn_a=dn_a, dn_b=dn_b, gg=torch.maximum(g_gate, g_up), gd=g_down):
            mod.gate_up_proj = q(wgu + delta(gu_a, gu_b, 2 * I, H), gg)
            mod.down_proj = q(wdn + delta(dn_a, dn_b, H, I), gd)

        ex.register_forward_pre_hook(hook)
    return m(input_ids=ids, labels=labels).loss


unsnapped = run(False).detach()
assert abs(unsnapped.item() - peft_loss.item()) <= 1e-5 * abs(peft_loss.item()), (unsnapped.item(), peft_loss.item())
loss = run(True)
loss.backward()
ref["ma.loss"] = loss.detach().reshape(1)
for n, p in lora.items():
    ref["ma.grad." + n] = p.grad.detach().clone()
# the snapping matters at the tolerance the test uses (1e-5 relative on the loss)
assert abs(loss.item() - peft_loss.item()) > 1e-3 * abs(peft_loss.item()), (loss.item(), peft_loss.item())
fixture_dir.finish(out, ref)
