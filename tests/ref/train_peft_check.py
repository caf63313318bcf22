#!/usr/bin/env python3
"""The adapter eo-ddp trains loads in peft and means the same thing there.

    train_peft_check.py EO_DDP_BINARY SOURCE_DIR WORK_DIR [ARCH] [--layers I,J,...]

ARCH (a tools/make_tiny_model.py --arch name) runs the same on that family's tiny checkpoint,
with LoRA on its attention linears (DeepSeek's latent attention: q_a/q_b or q_proj, kv_a, kv_b, o;
Gemma 4: and its dense MLP, which peft adapts as plain linears). gemma4_mm and mistral4_mm are Gemma 4's
and Mistral Small 4's multimodal checkpoints: eo-ddp trains the text model and says the vision tower is
not trained; peft loads the adapter onto Gemma4ForConditionalGeneration / Mistral3ForConditionalGeneration
(its exclude_modules keep the vision tower out); llama4_mm likewise Llama 4's
(Llama4ForConditionalGeneration, language_model.model.*; LoRA on its attention and shared experts);
qwen3_next and qwen3_5_moe_mm (Qwen3_5MoeForConditionalGeneration) with LoRA on the delta-rule layers'
projections and the shared expert's gate too.
--layers trains with peft_layers_to_transform: [I, J, ...]; the modules the adapter holds must then
be those peft's own matching (check_target_module_exists with layers_to_transform) selects.

1. eo-ddp trains a short LoRA run of the bundled tiny Qwen3-MoE (configs/tiny-qwen3-moe.yaml) on
   the attention projections. (peft 0.21 with transformers 5.24 cannot target per-expert linears:
   at run time the experts are fused 3-D parameters, so an adapter with expert LoRA has keys
   peft cannot place.)
2. transformers loads fixtures/tiny-qwen3-moe in fp32 and PeftModel.from_pretrained loads the
   adapter: no warning, every LoRA parameter of the peft model comes from the file, every tensor
   of the file lands in a parameter, bitwise.
3. The mean next-token loss over the labelled tokens of a JSONL file (summed over every line, divided
   by the count of counted tokens, as `eo-ddp score` defines it), computed here with the peft
   model, equals `eo-ddp score --adapter` within 1e-4 relative; likewise for the base model; and
   the adapter changes the loss by much more than that tolerance.
"""
import json
import os
import shutil
import subprocess
import sys
import warnings

import torch
import torch.nn.functional as F
import transformers
from peft import PeftModel
from safetensors.torch import load_file

BINARY, SRC, WORK = sys.argv[1:4]
rest = sys.argv[4:]
LAYERS = None
if "--layers" in rest:
    at = rest.index("--layers")
    LAYERS = [int(x) for x in rest[at + 1].split(",")]
    del rest[at:at + 2]
ARCH = rest[0] if rest else None
MODEL = os.path.join(SRC, "fixtures", "tiny-qwen3-moe")
RTOL = 1e-4
torch.set_num_threads(1)
os.makedirs(WORK, exist_ok=True)
env = dict(os.environ, OMP_NUM_THREADS="1")
failures = []


def check(ok, msg):
    print(("ok   " if ok else "FAIL ") + msg)
    if not ok:
        failures.append(msg)


# ---- 1. train an adapter with eo-ddp (in a fresh output_dir: it belongs to one run)
targets = "[q_proj, k_proj, v_proj, o_proj]"
extra = []
if ARCH:
    MODEL = os.path.join(WORK, "model")
    subprocess.run([sys.executable, os.path.join(SRC, "tests", "ref", "tiny_model.py"), "--arch", ARCH, "--out", MODEL,
                    "--seed", "5"], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    cfg = json.load(open(os.path.join(MODEL, "config.json")))
    cfg = cfg.get("text_config", cfg)  # a multimodal wrapper's text model
    if "kv_lora_rank" in cfg:
        targets = "[" + ("q_proj" if cfg["q_lora_rank"] is None else "q_a_proj, q_b_proj") + \
            ", kv_a_proj_with_mqa, kv_b_proj, o_proj]"
    if ARCH.startswith(("gemma4", "llama4")):
        targets = "[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]"
    if "linear_num_value_heads" in cfg:
        # Qwen3-Next / Qwen3.5: and the delta-rule layers' projections and the shared expert's gate. Not
        # the shared expert's gate/up/down_proj: for these model types peft 0.21 re-maps every target
        # ending in gate_proj, up_proj or down_proj onto the fused experts' parameters (its
        # transformers_weight_conversion), so no adapter of those modules loads in PeftModel.
        targets = "[q_proj, k_proj, v_proj, o_proj, " + ("in_proj_qkv, in_proj_z, in_proj_b, in_proj_a" if
                                                         cfg["model_type"] == "qwen3_5_moe_text" else
                                                         "in_proj_qkvz, in_proj_ba") + ", out_proj, shared_expert_gate]"
    extra = ["--set", "base_model=" + MODEL, "--set", "sequence_len=64"]
if LAYERS:
    extra += ["--set", "peft_layers_to_transform=[" + ", ".join(map(str, LAYERS)) + "]"]
out = os.path.join(WORK, "run")
shutil.rmtree(out, ignore_errors=True)
train = subprocess.run([BINARY, "--config", "configs/tiny-qwen3-moe.yaml", "--set", "output_dir=" + out,
                        "--set", "max_steps=12", "--set", "save_steps=0", "--set", "lora_target_linear=false",
                        "--set", "lora_target_modules=" + targets] + extra,
                       cwd=SRC, env=env, check=True, timeout=300, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
WRAPPERS = {"gemma4_mm": transformers.Gemma4ForConditionalGeneration,
            "mistral4_mm": transformers.Mistral3ForConditionalGeneration}
if ARCH in WRAPPERS:
    # The towers its config.json has (issue #49 item 10: Mistral 3 has no audio tower; the tiny
    # Gemma 4 is made with audio_config None).
    check("vision tower is not loaded and not trained" in train.stderr and "audio" not in train.stderr,
          "the log names the multimodal checkpoint's towers as its config.json does: a vision tower")
if ARCH in ("llama4_mm", "qwen3_5_moe_mm"):
    check("vision tower is not loaded and not trained" in train.stderr,
          "the log says the multimodal checkpoint's vision tower is not trained")

# ---- scoring data: prompt-masked labels, a right-padded line, plain lines
lines = [json.loads(l) for l in open(os.path.join(SRC, "fixtures", "tiny-data", "train.jsonl")) if l.strip()][:12]
lines[0]["labels"] = [-100] * 6 + lines[0]["input_ids"][6:]
n = len(lines[1]["input_ids"])
lines[1] = {"input_ids": lines[1]["input_ids"] + [0] * 5, "attention_mask": [1] * n + [0] * 5,
            "labels": lines[1]["input_ids"] + [-100] * 5}
data = os.path.join(WORK, "score.jsonl")
with open(data, "w") as f:
    for l in lines:
        f.write(json.dumps(l) + "\n")


def eo_score(adapter=None):
    # The reference below runs on the full-precision base, so eo-ddp must too (by default it would
    # score a QLoRA adapter on the NF4 base it was trained on).
    cmd = [BINARY, "score", "--model", MODEL, "--data", data, "--json", "--no-load-in-4bit"] + (["--adapter", adapter] if adapter else [])
    r = subprocess.run(cmd, env=env, check=True, timeout=300, capture_output=True, text=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def text_model(model):
    # transformers 5.24's Llama4ForConditionalGeneration.forward fails on every call (it reads
    # image_outputs from its language model's output, which has none): the loss runs through its
    # language_model, the same modules with peft's LoRA layers in place.
    if ARCH == "llama4_mm":
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        return inner.language_model
    return model


@torch.no_grad()
def reference_score(model):
    loss_sum, count = 0.0, 0
    for l in lines:
        ids = torch.tensor([l["input_ids"]])
        labels = torch.tensor([l.get("labels", l["input_ids"])])
        mask = torch.tensor([l["attention_mask"]]) if "attention_mask" in l else None
        logits = text_model(model)(input_ids=ids, attention_mask=mask).logits.double()
        target = labels[:, 1:]
        loss_sum += F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), target.reshape(-1),
                                    ignore_index=-100, reduction="sum").item()
        count += int((target != -100).sum())
    return loss_sum / count, count


# ---- 2. transformers + peft
# transformers 5.24 maps mistral4 to no causal-LM auto class (only inside Mistral 3's multimodal model).
causal_lm = WRAPPERS.get(ARCH) or (transformers.Llama4ForConditionalGeneration if ARCH == "llama4_mm" else
                                   transformers.Qwen3_5MoeForConditionalGeneration if ARCH == "qwen3_5_moe_mm" else
                                   transformers.Mistral4ForCausalLM if ARCH and ARCH.startswith("mistral4")
                                   else transformers.AutoModelForCausalLM)
model = causal_lm.from_pretrained(MODEL, dtype=torch.float32, attn_implementation="eager").eval()
linear_names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]  # before peft wraps them
base_loss, base_tokens = reference_score(model)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    peft_model = PeftModel.from_pretrained(model, out).eval()
load_warnings = [str(w.message) for w in caught if "key" in str(w.message).lower()]
check(not load_warnings, f"PeftModel.from_pretrained warns of no missing/unexpected keys {load_warnings}")

saved = load_file(os.path.join(out, "adapter_model.safetensors"))
placed = {n.replace(".default.", "."): p for n, p in peft_model.named_parameters() if "lora_" in n}
check(set(placed) == set(saved), f"peft's LoRA parameters ({len(placed)}) are the file's tensors ({len(saved)}): "
      f"only in peft {sorted(set(placed) - set(saved))[:3]}, only in file {sorted(set(saved) - set(placed))[:3]}")
check(all(torch.equal(placed[k], saved[k]) for k in set(placed) & set(saved)), "every loaded LoRA tensor equals the file's")
if LAYERS:
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists
    lc = LoraConfig(target_modules=targets.strip("[]").split(", "), layers_to_transform=LAYERS, layers_pattern="layers")
    expected = {n for n in linear_names if check_target_module_exists(lc, n)}
    held = {k.split(".lora_")[0].replace("base_model.model.", "", 1) for k in saved}
    check(held == expected and 0 < len(expected), f"layers_to_transform {LAYERS}: the adapter holds the {len(held)} modules "
          f"peft's matching selects ({len(expected)}): only in the file {sorted(held - expected)[:3]}, only in peft "
          f"{sorted(expected - held)[:3]}")
    layers = {int(n.split(".")[2]) for n in held}
    check(layers == set(LAYERS), f"only layers {sorted(layers)} are adapted")
check(any(k.endswith("lora_B.weight") and saved[k].abs().max() > 0 for k in saved), "training moved lora_B off zero")

# ---- 3. losses
adapter_loss, adapter_tokens = reference_score(peft_model)
eo_base, eo_adapter = eo_score(), eo_score(out)
for name, ref, ref_tokens, eo in (("base", base_loss, base_tokens, eo_base), ("adapter", adapter_loss, adapter_tokens, eo_adapter)):
    check(eo["tokens"] == ref_tokens, f"{name}: eo-ddp score counts {eo['tokens']} tokens, reference {ref_tokens}")
    rel = abs(eo["loss"] - ref) / abs(ref)
    check(rel < RTOL, f"{name}: eo-ddp score {eo['loss']:.7f} vs transformers/peft {ref:.7f} (rel {rel:.2e})")
change = abs(adapter_loss - base_loss) / base_loss
check(change > 100 * RTOL, f"the adapter changes the loss: {base_loss:.5f} -> {adapter_loss:.5f} (rel {change:.2e})")

print(f"{len(failures)} failed")
sys.exit(1 if failures else 0)
