#!/usr/bin/env python3
"""`eo-ddp merge` gives a checkpoint transformers loads as the base, meaning what the adapter means.

    merge_ref.py EO_DDP_BINARY SOURCE_DIR WORK_DIR FORM [ARCH]

FORM is the LoRA trained (QLoRA, NF4 base, a short eo-ddp run of configs/tiny-qwen3-moe.yaml):
  attn     the attention linears (and Gemma 4's / Llama 4's dense MLPs and shared experts), rsLoRA
  experts  every linear, the routed experts per expert (lora_target_linear), rsLoRA
  fused    the attention linears and the fused expert parameters (lora_target_parameters)
ARCH (a tools/make_tiny_model.py --arch name) runs on that family's tiny checkpoint written by
transformers; without it the bundled tiny Qwen3-MoE; gpt_oss_mxfp4 is gpt-oss with MXFP4 experts as the Hub
ships it (the reference loads it with Mxfp4Config(dequantize=True); the merge writes them dequantised).

1. `eo-ddp merge --dtype fp32` writes a folder that the family's transformers class loads with no
   missing, unexpected or mismatched key, holding the base's tensor names; the log says which base.
2. Its fp32 logits on held-out rows equal the reference's within 1e-5 relative (max |diff| / max |ref|):
   PeftModel(base, adapter) for attn and fused; for experts (peft 0.21 cannot load per-expert LoRA onto
   transformers 5's fused experts) the base with each delta scaling * B @ A added in float64 to the
   module or fused expert slice transformers holds it in, written here from transformers' layout.
3. `--base as-trained`: the merged model's loss equals `eo-ddp score --adapter` (the NF4 base the
   adapter was trained on) within 1e-5 relative, and differs from the original-base merge's.
4. A tensor the base does not have is an error naming it (exit 2), and no folder is left half written.
"""
import json
import os
import re
import shutil
import subprocess
import sys

import torch
import torch.nn.functional as F
import transformers
from peft import PeftModel
from safetensors import safe_open
from safetensors.torch import load_file, save_file

BINARY, SRC, WORK, FORM = sys.argv[1:5]
ARCH = sys.argv[5] if len(sys.argv) > 5 else None
MODEL = os.path.join(SRC, "fixtures", "tiny-qwen3-moe")
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


attn = ["q_proj", "k_proj", "v_proj", "o_proj"]
params = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
extra = []
if ARCH:
    MODEL = os.path.join(WORK, "model")
    # gpt_oss_mxfp4: gpt-oss with its experts in MXFP4, as the Hub ships it
    make = ["--arch", "gpt_oss", "--mxfp4-experts"] if ARCH == "gpt_oss_mxfp4" else ["--arch", ARCH]
    subprocess.run([sys.executable, os.path.join(SRC, "tests", "ref", "tiny_model.py")] + make + ["--out", MODEL,
                    "--seed", "5"], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    cfg = json.load(open(os.path.join(MODEL, "config.json")))
    cfg = cfg.get("text_config", cfg)
    if "kv_lora_rank" in cfg:
        attn = (["q_proj"] if cfg["q_lora_rank"] is None else ["q_a_proj", "q_b_proj"]) + \
            ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
    if ARCH.startswith("gemma4"):
        params = ["experts.gate_up_proj", "experts.down_proj"]
    if ARCH.startswith("llama4"):
        params = ["feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"]
    if ARCH.startswith(("gemma4", "llama4")):
        attn = attn + ["gate_proj", "up_proj", "down_proj"]
    extra = ["--set", "base_model=" + MODEL, "--set", "sequence_len=64"]
WRAPPERS = {"gemma4_mm": transformers.Gemma4ForConditionalGeneration,
            "mistral4_mm": transformers.Mistral3ForConditionalGeneration,
            "llama4_mm": transformers.Llama4ForConditionalGeneration}
CLS = WRAPPERS.get(ARCH) or (transformers.Mistral4ForCausalLM if ARCH and ARCH.startswith("mistral4")
                             else transformers.AutoModelForCausalLM)

# ---- 1. an adapter trained by eo-ddp
targets = {"attn": ["--set", "lora_target_linear=false", "--set", "lora_target_modules=[" + ", ".join(attn) + "]",
                    "--set", "peft_use_rslora=true"],
           "experts": ["--set", "lora_target_linear=true", "--set", "peft_use_rslora=true"],
           "fused": ["--set", "lora_target_linear=false", "--set", "lora_target_modules=[" + ", ".join(attn) + "]",
                     "--set", "lora_target_parameters=[" + ", ".join(params) + "]"]}[FORM]
adapter = os.path.join(WORK, "adapter")
subprocess.run([BINARY, "--config", "configs/tiny-qwen3-moe.yaml", "--set", "output_dir=" + adapter,
                "--set", "max_steps=8", "--set", "save_steps=0", "--set", "lora_dropout=0",
                "--set", "learning_rate=0.01"] + targets + extra,
               cwd=SRC, env=env, check=True, timeout=300, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
saved = load_file(os.path.join(adapter, "adapter_model.safetensors"))
if FORM == "experts":
    check(any(re.search(r"\.experts\.\d+\.", k) for k in saved), "the adapter holds per-expert LoRA")


def merge(out, *more):
    r = subprocess.run([BINARY, "merge", "--model", MODEL, "--adapter", adapter, "--output", out, "--dtype", "fp32"] + list(more),
                       env=env, timeout=300, capture_output=True, text=True)
    if r.returncode != 0:
        print(r.stderr)
    return r


lines = [json.loads(l) for l in open(os.path.join(SRC, "fixtures", "tiny-data", "train.jsonl")) if l.strip()]
held_out = lines[-4:]
data = os.path.join(WORK, "rows.jsonl")
with open(data, "w") as f:
    for l in held_out:
        f.write(json.dumps(l) + "\n")


def text_model(model):
    # transformers 5.24's Llama4ForConditionalGeneration.forward fails on every call: run its language model.
    if ARCH == "llama4_mm":
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        return inner.language_model
    return model


@torch.no_grad()
def logits(model):
    return [text_model(model)(input_ids=torch.tensor([l["input_ids"]])).logits[0].double() for l in held_out]


@torch.no_grad()
def loss(model):
    total, count = 0.0, 0
    for out, l in zip(logits(model), held_out):
        target = torch.tensor(l["input_ids"][1:])
        total += F.cross_entropy(out[:-1], target, reduction="sum").item()
        count += len(target)
    return total / count


def load(folder):
    # an MXFP4 base as transformers dequantises it (the merged folder is plain floats)
    quant = {"quantization_config": transformers.Mxfp4Config(dequantize=True)} if folder == MODEL and ARCH == "gpt_oss_mxfp4" else {}
    model, info = CLS.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager", output_loading_info=True,
                                      **quant)
    return model.eval(), info


def tensor_names(folder):
    names = set()
    for f in os.listdir(folder):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(folder, f), "pt") as h:
                names |= set(h.keys())
    return names


# ---- 2. the merged folder
merged = os.path.join(WORK, "merged")
r = merge(merged)
check(r.returncode == 0, "eo-ddp merge exits 0")
check("into the original weights" in r.stderr, "the log says the original weights were merged into")
model, info = load(merged)
bad = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
check(not bad, f"{CLS.__name__}.from_pretrained(merged) reports no missing / unexpected / mismatched key {bad}")
base_names = {n[:-len("_blocks")] if n.endswith("_blocks") else n for n in tensor_names(MODEL) if not n.endswith("_scales")}
check(tensor_names(merged) == base_names, "the merged folder holds exactly the base's tensor names (MXFP4 ones dequantised)")
for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
    if os.path.exists(os.path.join(MODEL, f)):
        check(os.path.exists(os.path.join(merged, f)), f"{f} is written")
check("quantization_config" not in json.load(open(os.path.join(merged, "config.json"))), "config.json has no quantization_config")
got = logits(model)

base, _ = load(MODEL)
base_logits = logits(base)
if FORM == "experts":
    # The reference merge, from transformers' own layout (not eo-ddp's): each module's W += s B A.
    acfg = json.load(open(os.path.join(adapter, "adapter_config.json")))
    s = acfg["lora_alpha"] / (acfg["r"] ** 0.5 if acfg.get("use_rslora") else acfg["r"])
    ref = base
    modules = dict(ref.named_modules())
    with torch.no_grad():
        for k in saved:
            if not k.endswith(".lora_A.weight"):
                continue
            name = k[len("base_model.model."):-len(".lora_A.weight")]
            delta = s * (saved[k.replace("lora_A", "lora_B")].double() @ saved[k].double())
            if name in modules and isinstance(modules[name], torch.nn.Linear):
                w = modules[name].weight
                w.copy_((w.double() + delta).float())
                continue
            m = re.fullmatch(r"(.*)\.experts\.(\d+)\.(\w+)", name)
            assert m, f"{k}: no module {name}"
            experts_path = m.group(1).replace("block_sparse_moe", "mlp") + ".experts"
            experts, e, linear = modules[experts_path], int(m.group(2)), m.group(3)
            width = experts.down_proj.shape[-1]  # [E, H, I]
            if linear in ("gate_proj", "w1", "up_proj", "w3"):
                half = 0 if linear in ("gate_proj", "w1") else 1
                w = experts.gate_up_proj[e, half * width:(half + 1) * width]  # [E, 2I, H], gate rows first
            else:
                w = experts.down_proj[e]
            assert w.shape == delta.shape, f"{k}: {tuple(w.shape)} vs {tuple(delta.shape)}"
            w.copy_((w.double() + delta).float())
    want = logits(ref)
    reference = "the base with every delta added in float64"
else:
    want = logits(PeftModel.from_pretrained(base, adapter).eval())
    reference = "PeftModel(base, adapter)"
rel = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, want))
check(rel < RTOL, f"merged fp32 logits equal {reference}'s (rel {rel:.2e})")
moved = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(want, base_logits))
check(moved > 100 * RTOL, f"and the adapter changes the logits (rel {moved:.2e})")

# ---- 3. the base as trained
trained = os.path.join(WORK, "merged-as-trained")
r = merge(trained, "--base", "as-trained")
check(r.returncode == 0 and "the base as trained" in r.stderr, "--base as-trained exits 0 and says it merged into the base as trained")
score = subprocess.run([BINARY, "score", "--model", MODEL, "--adapter", adapter, "--data", data, "--json"],
                       env=env, check=True, timeout=300, capture_output=True, text=True)
check("NF4, as the adapter was trained" in score.stderr, "eo-ddp score runs the NF4 base the adapter was trained on")
eo_loss = json.loads(score.stdout.strip().splitlines()[-1])["loss"]
trained_loss = loss(load(trained)[0])
rel = abs(trained_loss - eo_loss) / abs(eo_loss)
check(rel < RTOL, f"as-trained merge's loss {trained_loss:.8f} equals eo-ddp score's {eo_loss:.8f} (rel {rel:.2e})")
original_loss = loss(model)
check(abs(original_loss - trained_loss) / abs(eo_loss) > 100 * RTOL,
      f"and differs from the original-base merge's {original_loss:.8f}")

# ---- 4. a delta the base cannot place
odd = os.path.join(WORK, "adapter-odd")
shutil.copytree(adapter, odd)
k = next(k for k in saved if k.endswith(".lora_A.weight") and ".experts." not in k)
prefix = k[:-len("lora_A.weight")]
wrong = {(re.sub(r"\.layers\.\d+\.", ".layers.999.", n, count=1) if n.startswith(prefix) else n): t for n, t in saved.items()}
save_file(wrong, os.path.join(odd, "adapter_model.safetensors"))
out = os.path.join(WORK, "merged-odd")
r = subprocess.run([BINARY, "merge", "--model", MODEL, "--adapter", odd, "--output", out], env=env, timeout=300,
                   capture_output=True, text=True)
check(r.returncode == 2 and "layers.999." in r.stderr and not os.path.exists(os.path.join(out, "config.json")),
      f"an adapter tensor the base lacks is an error naming it, nothing written (exit {r.returncode}): {r.stderr.strip()[-300:]}")

# ---- 5. the adapter names its base as peft expects (the absolute path of the config's relative
# base_model): AutoPeftModelForCausalLM loads it from another folder, with no Hub in reach.
if FORM == "attn" and ARCH is None:
    elsewhere = os.path.join(WORK, "elsewhere")
    os.makedirs(elsewhere)
    named = json.load(open(os.path.join(adapter, "adapter_config.json")))["base_model_name_or_path"]
    check(os.path.isabs(named) and os.path.samefile(named, MODEL), f"adapter_config.json names its base {named}")
    probe = ("import sys, torch; from peft import AutoPeftModelForCausalLM; "
             "m = AutoPeftModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval(); "
             "print(float(m(input_ids=torch.tensor([[1, 2, 3, 4]])).logits.double().abs().sum()))")
    r = subprocess.run([sys.executable, "-c", probe, os.path.abspath(adapter)], cwd=elsewhere, env=env, timeout=300,
                       capture_output=True, text=True)
    with torch.no_grad():
        peft_model = PeftModel.from_pretrained(load(MODEL)[0], adapter).eval()
        want_sum = float(peft_model(input_ids=torch.tensor([[1, 2, 3, 4]])).logits.double().abs().sum())
    ok = r.returncode == 0 and abs(float(r.stdout.split()[-1]) - want_sum) <= 1e-6 * want_sum
    check(ok, f"AutoPeftModelForCausalLM.from_pretrained(adapter) from another folder loads base + adapter "
              f"{r.stderr.strip()[-300:] if r.returncode else ''}")

print(f"{len(failures)} failed")
sys.exit(1 if failures else 0)
