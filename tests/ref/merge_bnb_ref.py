#!/usr/bin/env python3
"""`eo-ddp merge` of a bitsandbytes pre-quantised base: the NF4 modules written dequantised.

    merge_bnb_ref.py EO_DDP_BINARY SOURCE_DIR WORK_DIR

tests/ref/bnb_checkpoint_ref.py writes a tiny Qwen3-MoE whose every decoder-block linear is bitsandbytes NF4
(nf4: perturbed absmax; nf4_dq: double quantisation), with transformers' fp32 logits of the float model holding
bitsandbytes' own dequantisation of those weights. For each, eo-ddp trains an adapter (attention and fused
experts) on it, and:
1. the merge of that adapter with every lora_B zeroed gives those logits (rel 1e-5): the dequantisation is
   bitsandbytes', and the folder has no quantization_config nor any quant-state tensor;
2. the merge of the adapter gives PeftModel(that folder, adapter)'s logits (rel 1e-5);
3. --base as-trained (the stored NF4 bytes are what trained) has eo-ddp score's loss (rel 1e-5).
"""
import json
import os
import shutil
import subprocess
import sys

import torch
import torch.nn.functional as F
import transformers
from peft import PeftModel
from safetensors import safe_open
from safetensors.torch import load_file, save_file

BINARY, SRC, WORK = sys.argv[1:4]
RTOL = 1e-5
torch.set_num_threads(1)
shutil.rmtree(WORK, ignore_errors=True)
os.makedirs(WORK)
env = dict(os.environ, OMP_NUM_THREADS="1")
failures = []


def check(ok, msg):
    print(("ok   " if ok else "FAIL ") + msg)
    if not ok:
        failures.append(msg)


subprocess.run([sys.executable, os.path.join(SRC, "tests", "ref", "bnb_checkpoint_ref.py"), "qwen3_moe",
                os.path.join(WORK, "fx")], check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
root = os.path.join(WORK, "fx", "qwen3_moe")
ref = load_file(os.path.join(root, "ref.safetensors"))
ids = ref["input_ids"]


def load(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()


def rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def merge(model, adapter, out, *more):
    r = subprocess.run([BINARY, "merge", "--model", model, "--adapter", adapter, "--output", out, "--dtype", "fp32"] + list(more),
                       env=env, timeout=300, capture_output=True, text=True)
    if r.returncode:
        print(r.stderr[-2000:])
    return r.returncode


for variant in ("nf4", "nf4_dq"):
    model = os.path.join(root, variant)
    adapter = os.path.join(WORK, variant + "-adapter")
    subprocess.run([BINARY, "--config", "configs/tiny-qwen3-moe.yaml", "--set", "output_dir=" + adapter,
                    "--set", "base_model=" + model, "--set", "sequence_len=64", "--set", "max_steps=8",
                    "--set", "save_steps=0", "--set", "lora_dropout=0", "--set", "learning_rate=0.01",
                    "--set", "lora_target_linear=false", "--set", "lora_target_modules=[q_proj, k_proj, v_proj, o_proj]",
                    "--set", "lora_target_parameters=[mlp.experts.gate_up_proj, mlp.experts.down_proj]"],
                   cwd=SRC, env=env, check=True, timeout=300, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # ---- 1. the dequantised base
    zero = os.path.join(WORK, variant + "-zero-adapter")
    shutil.copytree(adapter, zero)
    lora = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    save_file({k: torch.zeros_like(v) if "lora_B" in k else v for k, v in lora.items()},
              os.path.join(zero, "adapter_model.safetensors"))
    base = os.path.join(WORK, variant + "-dequantised")
    check(merge(model, zero, base) == 0, f"{variant}: merge exits 0")
    with torch.no_grad():
        got = load(base)(input_ids=ids).logits
    check(rel(got, ref["logits_" + variant]) < RTOL,
          f"{variant}: a zero adapter's merge has bitsandbytes' dequantised logits (rel {rel(got, ref['logits_' + variant]):.2e})")
    with safe_open(os.path.join(base, "model.safetensors"), "pt") as h:
        names = set(h.keys())
    check(not any(".absmax" in n or "quant_state" in n or "quant_map" in n for n in names)
          and "quantization_config" not in json.load(open(os.path.join(base, "config.json"))),
          f"{variant}: no quant-state tensor and no quantization_config in the merged folder")
    # ---- 2. the adapter
    merged = os.path.join(WORK, variant + "-merged")
    check(merge(model, adapter, merged) == 0, f"{variant}: merge of the trained adapter exits 0")
    with torch.no_grad():
        got = load(merged)(input_ids=ids).logits
        want = PeftModel.from_pretrained(load(base), adapter).eval()(input_ids=ids).logits
    check(rel(got, want) < RTOL, f"{variant}: merged logits equal PeftModel(dequantised base, adapter)'s (rel {rel(got, want):.2e})")
    # ---- 3. as trained
    trained = os.path.join(WORK, variant + "-as-trained")
    check(merge(model, adapter, trained, "--base", "as-trained") == 0, f"{variant}: --base as-trained exits 0")
    rows = os.path.join(WORK, "rows.jsonl")
    with open(rows, "w") as f:
        for row in ids.tolist():
            f.write(json.dumps({"input_ids": row}) + "\n")
    score = subprocess.run([BINARY, "score", "--model", model, "--adapter", adapter, "--data", rows, "--json"],
                           env=env, check=True, timeout=300, capture_output=True, text=True)
    eo_loss = json.loads(score.stdout.strip().splitlines()[-1])["loss"]
    with torch.no_grad():
        logits = load(trained)(input_ids=ids).logits.double()
    loss = float(F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)))
    check(abs(loss - eo_loss) / abs(eo_loss) < RTOL, f"{variant}: as-trained loss {loss:.8f} equals eo-ddp score's {eo_loss:.8f}")

print(f"{len(failures)} failed")
sys.exit(1 if failures else 0)
