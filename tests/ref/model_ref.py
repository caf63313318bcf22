#!/usr/bin/env python3
"""Reference outputs for the decoder parity tests (tests/test_model.cpp), from transformers,
peft and bitsandbytes — never from eo-ddp.

    model_ref.py ARCH OUT_DIR

ARCH: a tools/make_tiny_model.py --arch name (a family, or one of its variants).

Writes OUT_DIR/ARCH/:
  model/, model_fused/ (tools/make_tiny_model.py; fused = transformers v5 [E,2I,H] layout; Llama 4,
                       saved fused: model_fused/ holds its experts per expert instead)
  adapter/             peft adapter with non-zero B on attention + MLP + every expert
  adapter_params/      peft's own adapter with target_parameters (fused expert ParamWrappers)
  data.jsonl           tokenized lines for `eo-ddp score`
  ref.safetensors      input_ids, labels, logits, loss, aux_loss (has_aux_loss 0: transformers
                       computes none for the family), logits_lora, loss_lora,
                       grad.<peft name> for every LoRA tensor, logits_params, loss_params,
                       grad_params.<peft name> (adapter_params/), logits_nf4, score_loss,
                       score_tokens, score_loss_adapter
peft 0.21 with transformers 5.24 cannot target per-expert linears (experts are fused 3-D
parameters at run time; peft wraps them as one parametrized module with other names), nor did
it wrap the dense MLPs next to them. So peft's own LoraLayer covers q/k/v/o_proj and the MLP /
expert LoRA reference is a direct transcription of peft's formula
y = base(x) + B(A(x)) * alpha / r in float64 torch; both are saved into one adapter under
peft's names (base_model.model.<module>.lora_{A,B}.weight).
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
R, ALPHA = 4, 8.0
SCALING = ALPHA / R
MIX = ARCH in ("mixtral", "minimax_m2")  # block_sparse_moe, w1 / w3 / w2
# gpt-oss's experts only exist fused (peft reaches them through target_parameters, another adapter
# format): its LoRA reference covers attention only.
GPT_OSS = ARCH == "gpt_oss"
MLP_NAMES = ["w1", "w3", "w2"] if MIX else ["gate_proj", "up_proj", "down_proj"]  # gate, up, down

# Up to date (newer than this script and the model builder): nothing to do. Otherwise build in a
# temporary folder and swap it in at the end, so tests reading the old fixtures never see a
# half-written one.
out = fixture_dir.begin(OUT, ARCH, __file__, TOOL)
# The reference stack only when the fixture is to be made: an up-to-date or cached one exits above
# without paying its imports (~3 CPU seconds).
import param_wrapper_run  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
model_dir, fused_dir, adapter_dir = (os.path.join(out, d) for d in ("model", "model_fused", "adapter"))
LLAMA4 = ARCH.startswith("llama4")
for d, extra in ((model_dir, []), (fused_dir, ["--per-expert-experts" if LLAMA4 else "--fused-experts"])):
    subprocess.run([sys.executable, TINY, "--arch", ARCH, "--out", d, "--seed", "7"] + extra, check=True,
                   stdout=subprocess.DEVNULL)


# transformers 5.24 maps mistral4 to no causal-LM auto class (only inside Mistral 3's multimodal model).
# The *_mm fixtures are multimodal wrappers: their text model is model.language_model (peft's names),
# and a vision tower with linears of the same short names, which exclude_modules keeps out of the adapter.
WRAPPERS = {"mistral4_mm": transformers.Mistral3ForConditionalGeneration,
            "gemma4_mm": transformers.Gemma4ForConditionalGeneration,
            "qwen3_5_moe_mm": transformers.Qwen3_5MoeForConditionalGeneration}
CAUSAL_LM = WRAPPERS.get(ARCH) or (transformers.Mistral4ForCausalLM if ARCH.startswith("mistral4")
                                   else transformers.AutoModelForCausalLM)
DEC = "model.language_model." if ARCH in WRAPPERS else "model."
EXCLUDE = {"exclude_modules": r"(?!model\.language_model\.).*"} if ARCH in WRAPPERS else {}


def load(dtype=torch.float32):
    m = CAUSAL_LM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager")
    return m.eval()


ref = {}
cfg = json.load(open(os.path.join(model_dir, "config.json")))
cfg = cfg.get("text_config", cfg)  # a wrapper's text model
if "kv_lora_rank" in cfg:  # DeepSeek latent attention (peft's names for its linears)
    ATTN = (["q_proj"] if cfg["q_lora_rank"] is None else ["q_a_proj", "q_b_proj"]) + \
        ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
else:
    ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
# Gated delta-rule layers (Qwen3-Next): peft's names of their linears, as axolotl's config targets them.
LINEAR_ATTN = "linear_num_value_heads" in cfg
if LINEAR_ATTN:  # Qwen3.5 has four input projections where Qwen3-Next has two
    ATTN += (["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"] if cfg["model_type"] == "qwen3_5_moe_text"
             else ["in_proj_qkvz", "in_proj_ba"]) + ["out_proj", "shared_expert_gate"]  # the gate: peft's own layer
TARGETS = ATTN + ([] if GPT_OSS else MLP_NAMES)
V = cfg["vocab_size"]
g = torch.Generator().manual_seed(11)
ids = torch.randint(0, V, (2, 13), generator=g)
labels = ids.clone()
labels[0, 3] = -100
labels[1, 7:9] = -100
ref["input_ids"], ref["labels"] = ids, labels

# ---- fp32 logits, loss, aux loss
model = load()
with torch.no_grad():
    o = model(input_ids=ids, labels=labels)
    ref["logits"], ref["loss"] = o.logits, o.loss.reshape(1)
    oa = model(input_ids=ids, labels=labels, output_router_logits=True)
    ref["loss_with_aux"] = oa.loss.reshape(1)
    aux = getattr(oa, "aux_loss", None)  # Gemma 4's output has no such field: transformers computes none
    ref["has_aux_loss"] = torch.tensor([int(aux is not None)])
    if aux is not None:
        ref["aux_loss"] = aux.reshape(1).float()

# ---- packed rows (delta-rule families, and the plain-attention families added since): row 0 as two
# documents of 7 and 6 tokens, each run alone by transformers (its torch fallback has no per-document
# conv or state reset); the packed row's label at the second document's first token is -100, so both
# count the same targets.
DOCS = (7, 6)
packed_labels = labels[0].clone()
packed_labels[DOCS[0]] = -100
ref["packed_labels"] = packed_labels.reshape(1, -1)
PACKED = LINEAR_ATTN or ARCH in ("ernie4_5_moe", "hunyuan_v1_moe")


def packed_run(m):
    outs, total, starts = [], 0.0, (0, DOCS[0])
    for s0, n in zip(starts, DOCS):
        x, lab = ids[0:1, s0:s0 + n], packed_labels[None, s0:s0 + n]
        o = m(input_ids=x, labels=lab)
        total = total + o.loss * int((lab[:, 1:] != -100).sum())
        outs.append(o.logits)
    return torch.cat(outs, 1), total


if PACKED:
    with torch.no_grad():
        lp, lsum = packed_run(model)
        ref["logits_packed"], ref["loss_sum_packed"] = lp, lsum.reshape(1)

# ---- score: mean over every counted token of the file
lines = []
for n in (5, 9, 17, 12):
    x = torch.randint(0, V, (n,), generator=g).tolist()
    lab = list(x)
    if n == 9:
        lab[:4] = [-100] * 4
    lines.append({"input_ids": x, "labels": lab})
with open(os.path.join(out, "data.jsonl"), "w") as f:
    for i, l in enumerate(lines):
        f.write(json.dumps(l if i != 3 else {"input_ids": l["input_ids"]}) + "\n")


def score(m):
    total, count = 0.0, 0
    with torch.no_grad():
        for l in lines:
            x, lab = torch.tensor([l["input_ids"]]), torch.tensor([l["labels"]])
            c = int((lab[:, 1:] != -100).sum())
            total += float(m(input_ids=x, labels=lab).loss) * c
            count += c
    return total / count, count


ref["score_loss"] = torch.tensor([score(model)[0]], dtype=torch.float64)
ref["score_tokens"] = torch.tensor([score(model)[1]], dtype=torch.int64)

# ---- LoRA: peft on attention, float64 transcription on MLPs and experts
from peft import LoraConfig, get_peft_model  # noqa: E402

torch.manual_seed(3)
peft_model = get_peft_model(load(), LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0,
                                               target_modules=ATTN, **EXCLUDE))
gl = torch.Generator().manual_seed(5)
with torch.no_grad():
    for n, p in peft_model.named_parameters():
        if "lora_B" in n:
            p.copy_(0.3 * torch.randn(p.shape, generator=gl))  # non-zero B so the adapter matters
manual = {}  # peft name -> fp32 leaf tensor


def lora_pair(module, n_in, n_out):
    a = (torch.rand(R, n_in, generator=gl) * 2 - 1) / n_in ** 0.5
    b = 0.3 * torch.randn(n_out, R, generator=gl)
    pa = manual.setdefault(f"base_model.model.{module}.lora_A.weight", a.requires_grad_())
    pb = manual.setdefault(f"base_model.model.{module}.lora_B.weight", b.requires_grad_())
    return pa, pb


def delta(x, ab):
    a, b = ab
    return ((x.double() @ a.double().T) @ b.double().T * SCALING).to(x.dtype)


class LoraLinear(torch.nn.Module):
    def __init__(self, base, ab):
        super().__init__()
        self.base, self.ab = base, ab

    def forward(self, x):
        return self.base(x) + delta(x, self.ab)


def experts_forward(self, hidden_states, top_k_index, top_k_weights):
    # transformers' expert loop (modeling_*: *Experts.forward) plus a LoRA delta per expert matrix.
    acc = torch.zeros_like(hidden_states)
    I = self.down_proj.shape[-1]
    for e in range(self.gate_up_proj.shape[0]):
        tok, top_pos = torch.where(top_k_index == e)
        if tok.numel() == 0:
            continue
        x = hidden_states[tok]
        gu = self.gate_up_proj[e]
        gate = F.linear(x, gu[:I]) + delta(x, self.lora[e][0])
        up = F.linear(x, gu[I:]) + delta(x, self.lora[e][1])
        h = self.act_fn(gate) * up
        y = F.linear(h, self.down_proj[e]) + delta(h, self.lora[e][2])
        acc.index_add_(0, tok, (y * top_k_weights[tok, top_pos, None]).to(acc.dtype))
    return acc


base = peft_model.base_model.model
moe_attr = "block_sparse_moe" if MIX else "mlp"
decoder = base.model.language_model if ARCH in WRAPPERS else base.model
for i, layer in enumerate([] if GPT_OSS else decoder.layers):
    mlp = layer.feed_forward if LLAMA4 else layer.mlp
    if LLAMA4:
        # Llama 4's experts exist only fused (peft reaches them through target_parameters alone):
        # LoRA on the shared expert of its MoE layers and on its dense layers' MLP.
        mods = [(mlp.shared_expert, f"feed_forward.shared_expert")] if hasattr(mlp, "experts") else [(mlp, "feed_forward")]
        for mod, path in mods:
            for nm in ("gate_proj", "up_proj", "down_proj"):
                lin = getattr(mod, nm)
                setattr(mod, nm, LoraLinear(lin, lora_pair(f"model.layers.{i}.{path}.{nm}", lin.in_features, lin.out_features)))
        continue
    if hasattr(mlp, "experts") and LINEAR_ATTN:
        # Qwen3-Next / Qwen3.5: no per-expert modules in peft or eo-ddp (fused only): the shared expert's.
        for nm in ("gate_proj", "up_proj", "down_proj"):
            lin = getattr(mlp.shared_expert, nm)
            setattr(mlp.shared_expert, nm, LoraLinear(lin, lora_pair(f"{DEC}layers.{i}.mlp.shared_expert.{nm}",
                                                                     lin.in_features, lin.out_features)))
    elif hasattr(mlp, "experts"):
        ex = mlp.experts
        E, I, H = ex.down_proj.shape[0], ex.down_proj.shape[2], ex.down_proj.shape[1]
        ex.lora = [[lora_pair(f"{DEC}layers.{i}.{moe_attr}.experts.{e}.{MLP_NAMES[m]}", (H, H, I)[m], (I, I, H)[m])
                    for m in range(3)] for e in range(E)]
        ex.forward = experts_forward.__get__(ex)
        for shared in ("shared_expert", "shared_experts", "shared_mlp"):  # qwen2_moe / glm4_moe, DeepSeek / Hunyuan
            if getattr(mlp, shared, None) is None:
                continue
            for nm in ("gate_proj", "up_proj", "down_proj"):
                lin = getattr(getattr(mlp, shared), nm)
                setattr(getattr(mlp, shared), nm, LoraLinear(lin, lora_pair(f"{DEC}layers.{i}.mlp.{shared}.{nm}",
                                                                            lin.in_features, lin.out_features)))
    else:
        for nm in ("gate_proj", "up_proj", "down_proj"):
            lin = getattr(mlp, nm)
            setattr(mlp, nm, LoraLinear(lin, lora_pair(f"{DEC}layers.{i}.mlp.{nm}", lin.in_features, lin.out_features)))

o = peft_model(input_ids=ids, labels=labels)
o.loss.backward()
ref["logits_lora"], ref["loss_lora"] = o.logits.detach(), o.loss.detach().reshape(1)
adapter = {}
for n, p in peft_model.named_parameters():
    if "lora_" in n:
        name = n.replace(".default", "")
        ref["grad." + name] = p.grad.detach().clone()
        adapter[name] = p.detach().clone()
for n, p in manual.items():  # an expert that got no token has no gradient: zero
    ref["grad." + n] = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
    adapter[n] = p.detach().clone()
if PACKED:  # the LoRA model on the packed row: logits, summed loss and every gradient
    lora_leaves = {n.replace(".default", ""): p for n, p in peft_model.named_parameters() if "lora_" in n}
    lora_leaves.update(manual)
    for p in lora_leaves.values():
        p.grad = None
    lp, lsum = packed_run(peft_model)
    lsum.backward()
    ref["logits_packed_lora"], ref["loss_sum_packed_lora"] = lp.detach(), lsum.detach().reshape(1)
    for n, p in lora_leaves.items():
        ref["grad_packed." + n] = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
peft_model.save_pretrained(adapter_dir)  # peft's adapter_config.json and file ...
assert set(load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))) <= set(adapter)
save_file(adapter, os.path.join(adapter_dir, "adapter_model.safetensors"), metadata={"format": "pt"})  # ... + MLP/experts
acfg = json.load(open(os.path.join(adapter_dir, "adapter_config.json")))
acfg["target_modules"] = TARGETS
json.dump(acfg, open(os.path.join(adapter_dir, "adapter_config.json"), "w"), indent=2)
with torch.no_grad():
    ref["score_loss_adapter"] = torch.tensor([score(peft_model)[0]], dtype=torch.float64)
del peft_model

# ---- fused expert LoRA (lora_target_parameters): peft's own ParamWrapper on transformers 5's
# gate_up_proj / down_proj (nested wrappers), non-zero B; logits, loss, every gradient, and the
# adapter exactly as peft saves it. Every family: [E, 2I, H] gate_up_proj, gpt-oss's [E, H, 2I]
# (is_transposed, gate / up interleaved, biases), Llama 4's [E, H, 2I] (taken as [E, out, in]).
# Gemma 4's experts are layers.{i}.experts (beside its dense mlp), Llama 4's feed_forward.experts.
params_dir = os.path.join(out, "adapter_params")
torch.manual_seed(11)
fused = "experts" if ARCH.startswith("gemma4") else "feed_forward.experts" if LLAMA4 else "mlp.experts"
pm = get_peft_model(load(), LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0,
                                       target_modules=ATTN, **EXCLUDE,
                                       target_parameters=[fused + ".gate_up_proj", fused + ".down_proj"]))
param_wrapper_run.record(pm, ids, labels, gl, ref, params_dir)
del pm

# ---- NF4: bitsandbytes quantise → dequantise every decoder-block linear, then transformers
import bitsandbytes.functional as bnbf  # noqa: E402
from bitsandbytes.backends.default.ops import _dequantize_4bit_compute  # noqa: E402
from bitsandbytes.backends.utils import _get_4bit_code  # noqa: E402


def nf4(w):
    q, state = bnbf.quantize_4bit(w.contiguous(), blocksize=64, quant_type="nf4")
    # bnb 0.50.2's native CPU dequantize_4bit indexes absmax per row, which is wrong when a row is
    # not a multiple of the blocksize (e.g. o_proj [64, 96], down_proj [64, 32]: errors ~2 where
    # the quantisation error is ~0.4); bnb's generic kernel (what every other backend falls back
    # to) implements the format: code[nibble] * absmax[flat_index // blocksize].
    return _dequantize_4bit_compute(q.reshape(-1), state.absmax, _get_4bit_code("nf4", w.device), 64,
                                    list(w.shape), torch.float32)


# bitsandbytes' own bytes for two checkpoint weights: the C++ load_in_4bit path must equal them.
disk = load_file(os.path.join(model_dir, "model.safetensors"))
disk_dec = next(k for k in disk if k.endswith("embed_tokens.weight"))[: -len("embed_tokens.weight")]  # as saved
attn_key = f"{disk_dec}layers.1.self_attn.{ATTN[0]}.weight"
if LINEAR_ATTN:  # layer 1 is a delta-rule layer: its first projection (ATTN: q/k/v/o, then it)
    attn_key = f"{disk_dec}layers.1.linear_attn.{ATTN[4]}.weight"
# A per-expert weight; mistral4's checkpoint holds its experts only fused (transformers 5.24 saves
# them so): a shared expert's instead.
# Gemma 4's experts are fused only too, and it has no shared expert: its dense MLP's.
second = sorted(k for k in disk if ".experts.0." in k) or \
    sorted(k for k in disk if ".shared_experts." in k or ".shared_expert." in k) or \
    sorted(k for k in disk if ".mlp.gate_proj." in k)
for key in (attn_key, "model.layers.1.self_attn.o_proj.weight") if GPT_OSS else (attn_key, second[0]):
    q, state = bnbf.quantize_4bit(disk[key].contiguous(), blocksize=64, quant_type="nf4")
    ref["nf4_packed." + key], ref["nf4_absmax." + key] = q, state.absmax

model = load()
with torch.no_grad():
    for n, p in model.named_parameters():
        if ".layers." not in n or "norm" in n or n.endswith((".gate.weight", ".gate.wg.weight")) or "shared_expert_gate" in n \
                or n.endswith("bias") or ".router." in n or n.endswith(".sinks") or "conv1d" in n or n.endswith("A_log"):
            continue  # norms, routers, shared-expert gate, biases, sinks and the delta-rule conv and decay stay unquantised
        if GPT_OSS and n.endswith("experts.gate_up_proj"):  # [E, H, 2I], gate / up interleaved columns
            for e in range(p.shape[0]):
                p[e, :, 0::2] = nf4(p[e, :, 0::2].T.contiguous()).T
                p[e, :, 1::2] = nf4(p[e, :, 1::2].T.contiguous()).T
        elif GPT_OSS and n.endswith("experts.down_proj"):  # [E, I, H]
            for e in range(p.shape[0]):
                p[e] = nf4(p[e].T.contiguous()).T
        elif LLAMA4 and n.endswith("experts.gate_up_proj"):  # [E, H, 2I]: gate = columns [0, I), up = [I, 2I)
            I = p.shape[2] // 2
            for e in range(p.shape[0]):
                p[e, :, :I] = nf4(p[e, :, :I].T.contiguous()).T
                p[e, :, I:] = nf4(p[e, :, I:].T.contiguous()).T
        elif LLAMA4 and n.endswith("experts.down_proj"):  # [E, I, H]
            for e in range(p.shape[0]):
                p[e] = nf4(p[e].T.contiguous()).T
        elif n.endswith("experts.gate_up_proj"):
            I = p.shape[1] // 2
            for e in range(p.shape[0]):
                p[e, :I] = nf4(p[e, :I])
                p[e, I:] = nf4(p[e, I:])
        elif n.endswith("experts.down_proj"):
            for e in range(p.shape[0]):
                p[e] = nf4(p[e])
        else:
            assert p.dim() == 2, n
            p.copy_(nf4(p))
    ref["logits_nf4"] = model(input_ids=ids).logits

fixture_dir.finish(out, ref)
