"""lora_target_modules in peft's forms (issue #31): a list of names or dotted suffixes, or one
regular expression matched against whole module names. The modules eo-ddp resolves a form to are
compared with the modules peft's own matching (check_target_module_exists) selects on the same
architecture built by transformers: where peft selects every module of some short names, eo-ddp
must adapt exactly those names; where peft selects part of a name's modules (some layers) or
none, eo-ddp must refuse the form, since it adapts a name in every layer or in none.

The model is a tiny Qwen2-MoE (shared expert, one dense layer): its modules as transformers builds
it, plus the routed experts and routers by their checkpoint names (transformers 5 fuses them).
usage: targets_ref.py EO_DDP SOURCE_DIR WORK_DIR
"""
import json
import os
import re
import shutil
import subprocess
import sys

import torch
from peft import LoraConfig
from peft.tuners.tuners_utils import check_target_module_exists
from transformers import AutoModelForCausalLM, Qwen2MoeConfig

EO, SRC, WORK = sys.argv[1], sys.argv[2], sys.argv[3]
shutil.rmtree(WORK, ignore_errors=True)
os.makedirs(WORK)
failures = []


def check(ok, what):
    print(("ok: " if ok else "FAILED: ") + what, flush=True)
    if not ok:
        failures.append(what)


cfg = Qwen2MoeConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2, intermediate_size=48,
                     moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                     vocab_size=64, mlp_only_layers=[1], max_position_embeddings=64)
model_dir = os.path.join(WORK, "model")
cfg.save_pretrained(model_dir)
with torch.device("meta"):
    model = AutoModelForCausalLM.from_config(cfg)
linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
# transformers 5 holds the routed experts fused and the router as a parameter; the checkpoint (and
# transformers 4, where peft matched them as modules) names them per expert, as eo-ddp does.
for i in range(cfg.num_hidden_layers):
    if i not in cfg.mlp_only_layers:
        for name in [f"model.layers.{i}.mlp.gate"] + [f"model.layers.{i}.mlp.experts.{e}.{p}" for e in range(cfg.num_experts)
                                                      for p in ("gate_proj", "up_proj", "down_proj")]:
            if name not in linears:
                linears.append(name)
with open(os.path.join(WORK, "train.jsonl"), "w") as f:
    f.write(json.dumps({"input_ids": [1, 2, 3]}) + "\n")


def peft_expectation(form):
    """The short names eo-ddp must resolve to, or None where it must refuse."""
    lc = LoraConfig(target_modules=form)
    chosen = [n for n in linears if check_target_module_exists(lc, n)]
    if not chosen:
        return None
    shorts = {n.rsplit(".", 1)[-1] for n in chosen}
    for s in shorts:
        every = [n for n in linears if n.rsplit(".", 1)[-1] == s]
        if set(every) != set(chosen) & set(every):
            return None  # part of a name's modules
    if shorts & {"gate", "shared_expert_gate", "lm_head"}:
        return None  # routers and the head: not adapted by eo-ddp
    return shorts


def eo_resolution(form):
    path = os.path.join(WORK, "c.yaml")
    with open(path, "w") as f:
        json.dump({"base_model": model_dir, "adapter": "lora", "lora_target_modules": form,
                   "output_dir": os.path.join(WORK, "out"),
                   "datasets": [{"path": os.path.join(WORK, "train.jsonl"), "type": "tokenized"}]}, f)
    p = subprocess.run([EO, "--config", path, "--check"], capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        return None, p.stderr + p.stdout
    m = re.search(r"^lora_target_modules:\n((?:\s+- .*\n)+)", p.stdout, re.M)
    return ({x.strip()[2:] for x in m.group(1).splitlines()} if m else set()), p.stdout


forms = [
    r"model.layers.[\d]+.self_attn.(q|k|v|o)_proj",
    r".*\.(q|v)_proj",
    ["self_attn.q_proj", "self_attn.v_proj"],
    ["o_proj", "k_proj"],
    ["mlp.shared_expert.gate_proj"],  # some gate_proj modules (not the dense layer's)
    r"model.layers.[\d]+.(mlp|mlp.shared_expert).(gate|up|down)_proj",  # not the routed experts'
    r"model.layers.[\d]+.mlp.(experts.[\d]+.|shared_expert.|)(gate|up|down)_proj",  # every MLP linear
    r"model.layers.0.self_attn.q_proj",  # one layer of three
    r"model.language_model.layers.[\d]+.(mlp|self_attn).(up|down|gate|q|k|v|o)_proj",  # no such names
    ["self_attn.q_proj", "mlp.gate"],  # a router
]
for form in forms:
    want = peft_expectation(form)
    got, out = eo_resolution(form)
    if want is None:
        check(got is None and "lora_target_modules" in out, f"{form!r}: peft selects part of a name's modules, a router or nothing; eo-ddp refuses it")
    else:
        check(got == want, f"{form!r}: eo-ddp adapts {sorted(got) if got is not None else out.strip()}, peft {sorted(want)}")

if failures:
    print(f"targets_ref: {len(failures)} FAILED")
    sys.exit(1)
print("targets_ref: all checks passed")
