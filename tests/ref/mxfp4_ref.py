#!/usr/bin/env python3
"""Reference for gpt-oss MXFP4 experts (tests/test_model.cpp, Mxfp4.*), from transformers' own
dequantiser (integrations/mxfp4.py convert_moe_packed_tensors, what Mxfp4Config(dequantize=True)
runs), transformers' model loaded with Mxfp4Config(dequantize=True), peft and bitsandbytes — never
from eo-ddp.

    mxfp4_ref.py gpt_oss OUT_DIR

Writes OUT_DIR/gpt_oss/:
  model_mxfp4/     tools/make_tiny_model.py --arch gpt_oss --mxfp4-experts: every expert tensor in
                   MXFP4 in the Hub layout (`experts.gate_up_proj_blocks` [E, 2I, H/32, 16], `_scales`
                   [E, 2I, H/32], same for down_proj) and the Hub's quantization_config
  model_plain/     the same model with float experts (no quantization_config)
  adapter/         peft LoRA on q/k/v/o_proj with non-zero B (gpt-oss's experts have no per-expert
                   modules for peft), trained on top of the QLoRA base below
  ref.safetensors  random.blocks / random.scales / random.expected: expert 0 holds every code byte in
                   every group of every scale byte 0..255 (inf and subnormals included), expert 1
                   random bytes and scales; layer0.<gate_up_proj|down_proj>.<blocks|scales|expected>:
                   the checkpoint's own tensors, expected [E, rows, cols] before transformers'
                   transpose; input_ids, labels, logits, loss: transformers' GptOss from model_mxfp4
                   with Mxfp4Config(dequantize=True) (fp32); logits_qlora, loss_qlora, grad.<peft
                   name>: that model with every decoder-block linear outside the experts quantised
                   by bitsandbytes (NF4, blocksize 64) and the experts kept as MXFP4 dequantises
                   them, plus the adapter
"""
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fixture_dir  # noqa: E402

ARCH, OUT = sys.argv[1], sys.argv[2]
assert ARCH == "gpt_oss"
HERE = os.path.dirname(os.path.abspath(__file__))
TINY = os.path.join(HERE, "tiny_model.py")  # tools/make_tiny_model.py through the test cache
TOOL = os.path.join(HERE, "..", "..", "tools", "make_tiny_model.py")
out = fixture_dir.begin(OUT, ARCH, __file__, TOOL)
# The reference stack only when the fixture is to be made: an up-to-date or cached one exits above
# without paying its imports (~3 CPU seconds).
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import Mxfp4Config  # noqa: E402
from transformers.integrations.mxfp4 import convert_moe_packed_tensors  # noqa: E402
plain, mx, adapter_dir = (os.path.join(out, d) for d in ("model_plain", "model_mxfp4", "adapter"))
for d, extra in ((plain, []), (mx, ["--mxfp4-experts"])):
    subprocess.run([sys.executable, TINY, "--arch", ARCH, "--out", d, "--seed", "5"] + extra, check=True,
                   stdout=subprocess.DEVNULL)
g = torch.Generator().manual_seed(21)
ref = {}

# Every code byte in every group of every scale byte (expert 0), random bytes and scales (expert 1).
blocks = torch.empty(2, 256, 16, 16, dtype=torch.uint8)
blocks[0] = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(1, 16, 16)
blocks[1] = torch.randint(0, 256, (256, 16, 16), generator=g, dtype=torch.uint8)
scales = torch.empty(2, 256, 16, dtype=torch.uint8)
scales[0] = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(256, 1)
scales[1] = torch.randint(0, 256, (256, 16), generator=g, dtype=torch.uint8)
ref["random.blocks"], ref["random.scales"] = blocks, scales
# convert_moe_packed_tensors returns [E, cols, rows] (transposed); the raw dequantisation is [E, rows, cols].
ref["random.expected"] = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16).transpose(1, 2).contiguous()

cfg = json.load(open(os.path.join(mx, "config.json")))
sd = load_file(os.path.join(mx, "model.safetensors"))
deq = {}
for layer in range(cfg["num_hidden_layers"]):
    p = f"model.layers.{layer}.mlp.experts."
    for name in ("gate_up_proj", "down_proj"):
        b, s = sd[p + name + "_blocks"], sd[p + name + "_scales"]
        deq[p + name] = convert_moe_packed_tensors(b, s, dtype=torch.bfloat16)  # [E, cols, rows], gpt-oss's layout
        if layer == 0:
            ref[f"layer0.{name}.blocks"], ref[f"layer0.{name}.scales"] = b, s
            ref[f"layer0.{name}.expected"] = deq[p + name].transpose(1, 2).contiguous()  # [E, rows, cols]


def load():
    m = transformers.AutoModelForCausalLM.from_pretrained(mx, quantization_config=Mxfp4Config(dequantize=True),
                                                          dtype=torch.float32, attn_implementation="eager")
    named = dict(m.named_parameters())
    for n, t in deq.items():  # transformers' loader dequantises as convert_moe_packed_tensors does
        assert torch.equal(named[n], t.float()), n
    return m.eval()


V = cfg["vocab_size"]
ids = torch.randint(0, V, (2, 13), generator=g)
labels = ids.clone()
labels[0, 3] = -100
labels[1, 7:9] = -100
ref["input_ids"], ref["labels"] = ids, labels
model = load()
with torch.no_grad():
    o = model(input_ids=ids, labels=labels)
    ref["logits"], ref["loss"] = o.logits, o.loss.reshape(1)
del model

# ---- QLoRA base with MXFP4 experts: bitsandbytes NF4 on every decoder-block linear but the experts
# (q/k/v/o_proj weights; biases, sinks, norms and the router stay), the experts as transformers
# dequantises them; peft LoRA on the attention with non-zero B.
import bitsandbytes.functional as bnbf  # noqa: E402
from bitsandbytes.backends.default.ops import _dequantize_4bit_compute  # noqa: E402
from bitsandbytes.backends.utils import _get_4bit_code  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402


def nf4(w):
    q, state = bnbf.quantize_4bit(w.contiguous(), blocksize=64, quant_type="nf4")
    # bnb's generic kernel (tests/ref/model_ref.py says why not its native CPU dequantise)
    return _dequantize_4bit_compute(q.reshape(-1), state.absmax, _get_4bit_code("nf4", w.device), 64,
                                    list(w.shape), torch.float32)


base = load()
with torch.no_grad():
    for n, p in base.named_parameters():
        if ".layers." in n and ".self_attn." in n and n.endswith("_proj.weight"):
            p.copy_(nf4(p))
torch.manual_seed(3)
pm = get_peft_model(base, LoraConfig(r=4, lora_alpha=8.0, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
gl = torch.Generator().manual_seed(5)
with torch.no_grad():
    for n, p in pm.named_parameters():
        if "lora_B" in n:
            p.copy_(0.3 * torch.randn(p.shape, generator=gl))  # non-zero B so the adapter matters
o = pm(input_ids=ids, labels=labels)
o.loss.backward()
ref["logits_qlora"], ref["loss_qlora"] = o.logits.detach(), o.loss.detach().reshape(1)
for n, p in pm.named_parameters():
    if "lora_" in n:
        ref["grad." + n.replace(".default", "")] = p.grad.detach().clone()
pm.save_pretrained(adapter_dir)
fixture_dir.finish(out, ref)
