#!/usr/bin/env python3
"""Reference for loading gpt-oss MXFP4 experts (tests/test_model.cpp, Mxfp4.*), from transformers'
own dequantiser (integrations/mxfp4.py convert_moe_packed_tensors, what Mxfp4Config(dequantize=True)
runs) — never from eo-ddp.

    mxfp4_ref.py gpt_oss OUT_DIR

Writes OUT_DIR/gpt_oss/:
  model_mxfp4/     tools/make_tiny_model.py's gpt_oss with every expert tensor replaced by random MXFP4
                   blocks / scales in the Hub layout (`experts.gate_up_proj_blocks` [E, 2I, H/32, 16],
                   `_scales` [E, 2I, H/32], same for down_proj) and the Hub's quantization_config
  ref.safetensors  random.blocks / random.scales (every scale byte 0..255, every code) and
                   random.expected; layer0.* the same for layer 0's experts; input_ids and logits of
                   transformers' GptOss on the dequantised weights (fp32)
"""
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fixture_dir  # noqa: E402

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

ARCH, OUT = sys.argv[1], sys.argv[2]
assert ARCH == "gpt_oss"
HERE = os.path.dirname(os.path.abspath(__file__))
TOOL = os.path.join(HERE, "..", "..", "tools", "make_tiny_model.py")
out = fixture_dir.begin(OUT, ARCH, __file__, TOOL)
plain, mx = os.path.join(out, "model_plain"), os.path.join(out, "model_mxfp4")
subprocess.run([sys.executable, TOOL, "--arch", ARCH, "--out", plain, "--seed", "5"], check=True, stdout=subprocess.DEVNULL)
g = torch.Generator().manual_seed(21)
ref = {}

# Every code and every scale byte, extremes included (255: inf / nan where transformers gives them).
blocks = torch.randint(0, 256, (3, 7, 5, 16), generator=g, dtype=torch.uint8)
scales = torch.arange(3 * 7 * 5, dtype=torch.int32).remainder(256).to(torch.uint8).reshape(3, 7, 5)
scales[0, 0, :] = torch.tensor([0, 1, 127, 254, 255], dtype=torch.uint8)
ref["random.blocks"], ref["random.scales"] = blocks, scales
# convert_moe_packed_tensors returns [E, cols, rows] (transposed); the raw dequantisation is [E, rows, cols].
ref["random.expected"] = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16).transpose(1, 2).contiguous()

cfg = json.load(open(os.path.join(plain, "config.json")))
E, H, I = cfg["num_local_experts"], cfg["hidden_size"], cfg["intermediate_size"]
sd = load_file(os.path.join(plain, "model.safetensors"))
deq = {}
for layer in range(cfg["num_hidden_layers"]):
    p = f"model.layers.{layer}.mlp.experts."
    for name, rows, cols in (("gate_up_proj", 2 * I, H), ("down_proj", H, I)):
        b = torch.randint(0, 256, (E, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
        s = torch.randint(119, 124, (E, rows, cols // 32), generator=g, dtype=torch.uint8)
        del sd[p + name]
        sd[p + name + "_blocks"], sd[p + name + "_scales"] = b, s
        deq[p + name] = convert_moe_packed_tensors(b, s, dtype=torch.bfloat16)  # [E, cols, rows], gpt-oss's layout
        if layer == 0:
            ref[f"layer0.{name}.blocks"], ref[f"layer0.{name}.scales"] = b, s
            ref[f"layer0.{name}.expected"] = deq[p + name].transpose(1, 2).contiguous()  # [E, rows, cols]
os.makedirs(mx)
for f in os.listdir(plain):
    if f != "model.safetensors":
        with open(os.path.join(plain, f), "rb") as src, open(os.path.join(mx, f), "wb") as dst:
            dst.write(src.read())
save_file(sd, os.path.join(mx, "model.safetensors"), metadata={"format": "pt"})
cfg["quantization_config"] = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                         "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"}
json.dump(cfg, open(os.path.join(mx, "config.json"), "w"), indent=2)

# transformers on the dequantised experts (the plain checkpoint with them swapped in).
model = transformers.AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32, attn_implementation="eager").eval()
with torch.no_grad():
    for n, t in model.named_parameters():
        if n in deq:
            t.copy_(deq[n].float())
    ids = torch.randint(0, cfg["vocab_size"], (2, 11), generator=g)
    ref["input_ids"], ref["logits"] = ids, model(input_ids=ids).logits
fixture_dir.finish(out, ref)
