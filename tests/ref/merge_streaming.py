#!/usr/bin/env python3
"""`eo-ddp merge` streams: a many-shard base merges with peak host memory near two shards.

    merge_streaming.py EO_DDP_BINARY SOURCE_DIR WORK_DIR

1. transformers writes a Qwen3-MoE base of ~200 MB in shards of at most 16 MB (random weights, fp32), and peft
   an adapter for it (attention and dense LoRA, B drawn non-zero).
2. The process's constant: eo-ddp merge's peak RSS on the bundled tiny model (libtorch and the
   binary; the tiny model's tensors are a few MB).
3. The big merge's peak RSS (VmHWM, which counts the mapped shard's pages; eo-ddp merge logs it) stays within
   that constant + 2 shards + 24 MB, well below the constant plus the model; the output has the
   base's tensors in several shards with an index, and a spot check of merged tensors against
   W + scaling * B @ A computed here.
"""
import json
import os
import re
import shutil
import subprocess
import sys

import torch
import transformers
from peft import LoraConfig, get_peft_model
from safetensors import safe_open

BINARY, SRC, WORK = sys.argv[1:4]
TINY = os.path.join(SRC, "fixtures", "tiny-qwen3-moe")
SHARD = 16 * 1000 * 1000
torch.set_num_threads(1)
torch.manual_seed(0)
shutil.rmtree(WORK, ignore_errors=True)
os.makedirs(WORK)
env = dict(os.environ, OMP_NUM_THREADS="1")
failures = []


def check(ok, msg):
    print(("ok   " if ok else "FAIL ") + msg)
    if not ok:
        failures.append(msg)


def make_adapter(model, out):
    lc = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False)
    get_peft_model(model, lc).save_pretrained(out)


def peak_rss_mb(args):
    # eo-ddp's own VmHWM, which it logs: a child's ru_maxrss would count this Python's pages from before exec.
    r = subprocess.run([BINARY, "merge"] + args, env=env, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        print(r.stderr)
    m = re.search(r"peak host memory (\d+) bytes", r.stderr)
    return r.returncode, int(m.group(1)) / 1e6 if m else float("inf")


# ---- 1. a many-shard base and its adapter
cfg = transformers.AutoConfig.from_pretrained(TINY)
cfg.hidden_size, cfg.num_hidden_layers, cfg.num_experts, cfg.moe_intermediate_size = 256, 8, 32, 256
cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = 4, 2, 64
base = os.path.join(WORK, "base")
big = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
big.save_pretrained(base, max_shard_size=SHARD)
shards = [f for f in os.listdir(base) if f.endswith(".safetensors")]
largest = max(os.path.getsize(os.path.join(base, f)) for f in shards) / 1e6
total = sum(os.path.getsize(os.path.join(base, f)) for f in shards) / 1e6
for f in os.listdir(TINY):
    if f.startswith("tokenizer"):
        shutil.copy(os.path.join(TINY, f), base)
adapter = os.path.join(WORK, "adapter")
make_adapter(big, adapter)
del big
tiny_adapter = os.path.join(WORK, "tiny-adapter")
make_adapter(transformers.AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32), tiny_adapter)
check(len(shards) >= 10, f"the base has {len(shards)} shards (largest {largest:.1f} MB, {total:.0f} MB in all)")

# ---- 2. the constant, 3. the bound
rc, constant = peak_rss_mb(["--model", TINY, "--adapter", tiny_adapter, "--output", os.path.join(WORK, "tiny-out"),
                            "--dtype", "fp32"])
check(rc == 0, f"the tiny merge exits 0 (peak RSS {constant:.0f} MB: the constant)")
out = os.path.join(WORK, "merged")
# output shards no larger than the input's: "two shards" is one mapped input and one output being filled
rc, peak = peak_rss_mb(["--model", base, "--adapter", adapter, "--output", out, "--dtype", "fp32",
                        "--max-shard-size", str(int(largest * 1e6))])
bound = constant + 2 * largest + 24
check(rc == 0, "the many-shard merge exits 0")
check(peak <= bound, f"peak RSS {peak:.0f} MB <= constant {constant:.0f} + 2 x {largest:.1f} MB shards + 24 MB = {bound:.0f} MB "
      f"(the model is {total:.0f} MB)")
check(bound < constant + total / 2, "the bound is well below holding the model")
written = [f for f in os.listdir(out) if f.endswith(".safetensors")]
index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
check(len(written) >= 10 and set(index["weight_map"].values()) == set(written),
      f"{len(written)} output shards, each in model.safetensors.index.json")
names = {}
for f in shards:
    with safe_open(os.path.join(base, f), "pt") as h:
        names.update({k: f for k in h.keys()})
check(set(index["weight_map"]) == set(names), "the output holds exactly the base's tensors")

# a spot check: layer 5's q_proj merged as peft defines it
from safetensors.torch import load_file
lora = load_file(os.path.join(adapter, "adapter_model.safetensors"))
key = "model.layers.5.self_attn.q_proj"
A, B = lora[f"base_model.model.{key}.lora_A.weight"].double(), lora[f"base_model.model.{key}.lora_B.weight"].double()
with safe_open(os.path.join(base, names[key + ".weight"]), "pt") as h:
    w = h.get_tensor(key + ".weight").double()
with safe_open(os.path.join(out, index["weight_map"][key + ".weight"]), "pt") as h:
    got = h.get_tensor(key + ".weight").double()
want = w + 2.0 * (B @ A)
rel = float((got - want).abs().max() / want.abs().max())
check(rel < 1e-6, f"{key} = W + 2 B A (rel {rel:.2e})")

print(f"merge_streaming: peak RSS {peak:.0f} MB, constant {constant:.0f} MB, largest shard {largest:.1f} MB, "
      f"model {total:.0f} MB")
print(f"{len(failures)} failed")
sys.exit(1 if failures else 0)
