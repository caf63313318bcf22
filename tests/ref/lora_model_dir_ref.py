"""lora_model_dir (issue #31): training continues from a peft adapter, as axolotl's
PeftModel.from_pretrained(model, lora_model_dir, is_trainable=True) does. A first run trains an
adapter; a second starts from it with a learning rate of 1e-12, so its adapter must equal the
first one's tensors (read with safetensors, not eo-ddp) to within the update, while a fresh run's
B matrices are zero. An adapter whose r or targets differ from the config is refused (exit 2,
naming each key) before anything loads; so is a folder that is not an adapter.
usage: lora_model_dir_ref.py EO_DDP SOURCE_DIR WORK_DIR
"""
import json
import os
import shutil
import subprocess
import sys

import torch
from safetensors.torch import load_file

EO, SRC, WORK = sys.argv[1], sys.argv[2], sys.argv[3]
shutil.rmtree(WORK, ignore_errors=True)
os.makedirs(WORK)
failures = []


def check(ok, what):
    print(("ok: " if ok else "FAILED: ") + what, flush=True)
    if not ok:
        failures.append(what)


def run(name, ok=True, **keys):
    cfg = {"base_model": os.path.join(SRC, "fixtures/tiny-qwen3-moe"), "adapter": "lora", "lora_r": 4, "lora_alpha": 8,
           "lora_target_modules": ["q_proj", "v_proj", "gate_proj"], "sequence_len": 64, "micro_batch_size": 2,
           "max_steps": 3, "learning_rate": 1e-2, "lr_scheduler": "constant", "save_steps": 0, "overwrite_output_dir": True,
           "output_dir": os.path.join(WORK, name),
           "datasets": [{"path": os.path.join(SRC, "fixtures/tiny-data/train.jsonl"), "type": "tokenized"}]}
    cfg.update(keys)
    path = os.path.join(WORK, name + ".yaml")
    with open(path, "w") as f:
        json.dump(cfg, f)
    p = subprocess.run([EO, "--config", path], capture_output=True, text=True, timeout=600)
    if (p.returncode == 0) != ok:
        print(p.stdout[-3000:], p.stderr[-3000:])
    return p


first = run("first")
check(first.returncode == 0, "the first run trains an adapter")
a = load_file(os.path.join(WORK, "first", "adapter_model.safetensors"))
check(any("lora_B" in k and v.abs().max() > 0 for k, v in a.items()), "its B matrices moved from zero")
cont = run("continued", lora_model_dir=os.path.join(WORK, "first"), learning_rate=1e-12, max_steps=1)
check(cont.returncode == 0 and "lora_model_dir" in cont.stderr + cont.stdout, "a run continues from it, and says so")
b = load_file(os.path.join(WORK, "continued", "adapter_model.safetensors"))
check(set(a) == set(b), "the same tensors")
worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
check(worst < 1e-8, f"each equals the first adapter's to within the 1e-12 update (max diff {worst:.2e})")
fresh = run("fresh", learning_rate=1e-12, max_steps=1)
f = load_file(os.path.join(WORK, "fresh", "adapter_model.safetensors"))
check(all(v.abs().max() < 1e-8 for k, v in f.items() if "lora_B" in k), "without lora_model_dir B starts at zero")

bad = run("bad", ok=False, lora_model_dir=os.path.join(WORK, "first"), lora_r=8, lora_target_modules=["q_proj"])
msg = bad.stderr + bad.stdout
check(bad.returncode == 2 and "lora_r: 8, but lora_model_dir's adapter has r 4" in msg and
      "lora_target_modules: [q_proj], but lora_model_dir's adapter targets [gate_proj, q_proj, v_proj]" in msg,
      "a different r and targets are refused, each named")
notdir = run("notdir", ok=False, lora_model_dir=os.path.join(SRC, "fixtures"))
check(notdir.returncode == 2 and "is not a peft adapter folder" in notdir.stderr + notdir.stdout, "a folder that is not an adapter is refused")

if failures:
    print(f"lora_model_dir_ref: {len(failures)} FAILED")
    sys.exit(1)
print("lora_model_dir_ref: all checks passed")
