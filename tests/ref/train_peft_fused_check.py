#!/usr/bin/env python3
"""An adapter trained with lora_target_parameters loads in peft 0.21 + transformers 5 unchanged
and means the same thing there.

    train_peft_fused_check.py EO_DDP_BINARY SOURCE_DIR WORK_DIR [ARCH]

ARCH (a tools/make_tiny_model.py --arch name) runs the same on that family's tiny checkpoint:
gemma4 / gemma4_mm (Gemma 4's experts are layers.{i}.experts: target_parameters experts.gate_up_proj /
experts.down_proj, as the adapter writes them), mistral4_mm (Mistral Small 4 as the Hub ships it),
gpt_oss (gate_up_proj [E, H, 2I], gate and up interleaved), llama4 (feed_forward.experts, whose
[E, H, 2I] peft takes as [E, out, in]); a multimodal one loads in peft onto its
*ForConditionalGeneration class.

1. eo-ddp trains a short LoRA run of the bundled tiny Qwen3-MoE (configs/tiny-qwen3-moe.yaml) on
   the attention projections and the fused expert parameters
   (lora_target_parameters: both, gate_up_proj alone, down_proj alone), NF4 base.
2. The adapter's keys, shapes and adapter_config.json are peft's own: the same as
   get_peft_model(...).save_pretrained(...) writes for the same LoraConfig (nested ParamWrappers,
   A [r*E, in], B [out, r*E]).
3. transformers loads fixtures/tiny-qwen3-moe in fp32 and PeftModel.from_pretrained loads the
   adapter: no warning, every LoRA parameter of the peft model comes from the file, bitwise.
4. The mean next-token loss over the labelled tokens of a JSONL file, computed with the peft model,
   equals `eo-ddp score --adapter` (fp32 base) within 1e-5 relative, and the expert LoRA matters:
   zeroing its lora_B in peft moves the loss by much more than that tolerance.
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
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file

BINARY, SRC, WORK = sys.argv[1:4]
ARCH = sys.argv[4] if len(sys.argv) > 4 else None
MODEL = os.path.join(SRC, "fixtures", "tiny-qwen3-moe")
PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
RTOL = 1e-5
torch.set_num_threads(1)
os.makedirs(WORK, exist_ok=True)
env = dict(os.environ, OMP_NUM_THREADS="1")
failures = []
WRAPPERS = {"gemma4_mm": transformers.Gemma4ForConditionalGeneration,
            "mistral4_mm": transformers.Mistral3ForConditionalGeneration}
CLS = WRAPPERS.get(ARCH, transformers.AutoModelForCausalLM)
EXCLUDE = {"exclude_modules": r"(?!model\.language_model\.).*"} if ARCH in WRAPPERS else {}
EXTRA = []
if ARCH:
    MODEL = os.path.join(WORK, "model")
    subprocess.run([sys.executable, os.path.join(SRC, "tests", "ref", "tiny_model.py"), "--arch", ARCH, "--out", MODEL,
                    "--seed", "5"], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    cfg = json.load(open(os.path.join(MODEL, "config.json")))
    cfg = cfg.get("text_config", cfg)
    if "kv_lora_rank" in cfg:
        ATTN = (["q_proj"] if cfg["q_lora_rank"] is None else ["q_a_proj", "q_b_proj"]) + \
            ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
    if ARCH.startswith("gemma4"):
        PARAMS = ["experts.gate_up_proj", "experts.down_proj"]
    if ARCH.startswith("llama4"):  # its shared expert and dense MLPs beside the experts, as peft keeps them
        PARAMS = ["feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"]
        ATTN = ATTN + ["gate_proj", "up_proj", "down_proj"]
    EXTRA = ["--set", "base_model=" + MODEL, "--set", "sequence_len=64"]


def check(ok, msg):
    print(("ok   " if ok else "FAIL ") + msg)
    if not ok:
        failures.append(msg)


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


def eo_score(adapter):
    cmd = [BINARY, "score", "--model", MODEL, "--data", data, "--json", "--no-load-in-4bit", "--adapter", adapter]
    r = subprocess.run(cmd, env=env, check=True, timeout=300, capture_output=True, text=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


@torch.no_grad()
def reference_score(model):
    loss_sum, count = 0.0, 0
    for l in lines:
        ids = torch.tensor([l["input_ids"]])
        labels = torch.tensor([l.get("labels", l["input_ids"])])
        mask = torch.tensor([l["attention_mask"]]) if "attention_mask" in l else None
        logits = model(input_ids=ids, attention_mask=mask).logits.double()
        target = labels[:, 1:]
        loss_sum += F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), target.reshape(-1),
                                    ignore_index=-100, reduction="sum").item()
        count += int((target != -100).sum())
    return loss_sum / count, count



def run_case(name, given, params):
    print(f"== {name}: lora_target_parameters {given}")
    model = CLS.from_pretrained(MODEL, dtype=torch.float32, attn_implementation="eager").eval()
    # ---- 1. train (bare and full names both accepted; written canonical)
    out = os.path.join(WORK, name)
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run([BINARY, "--config", "configs/tiny-qwen3-moe.yaml", "--set", "output_dir=" + out,
                    "--set", "max_steps=12", "--set", "save_steps=0", "--set", "lora_dropout=0",
                    "--set", "lora_target_modules=[" + ", ".join(ATTN) + "]",
                    "--set", "lora_target_parameters=[" + ", ".join(given) + "]"] + EXTRA,
                   cwd=SRC, env=env, check=True, timeout=300, stdout=subprocess.DEVNULL)

    # ---- 2. peft's own save of the same LoraConfig: same keys, shapes, config fields
    acfg = json.load(open(os.path.join(out, "adapter_config.json")))
    check(acfg.get("target_parameters") == params, f"adapter_config.json target_parameters {acfg.get('target_parameters')}")
    check(acfg.get("lora_dropout") == 0, "adapter_config.json lora_dropout 0")
    ref_dir = os.path.join(WORK, name + "_peft_own")
    check(acfg.get("exclude_modules") == EXCLUDE.get("exclude_modules"), f"adapter_config.json exclude_modules "
          f"{acfg.get('exclude_modules')}")
    get_peft_model(CLS.from_pretrained(MODEL, dtype=torch.float32),
                   LoraConfig(r=acfg["r"], lora_alpha=acfg["lora_alpha"], target_modules=ATTN,
                              target_parameters=params, **EXCLUDE)).save_pretrained(ref_dir)
    own = load_file(os.path.join(ref_dir, "adapter_model.safetensors"))
    saved = load_file(os.path.join(out, "adapter_model.safetensors"))
    check(set(own) == set(saved), f"the same {len(own)} keys as peft's save: only peft's {sorted(set(own) - set(saved))[:3]}, "
          f"only eo-ddp's {sorted(set(saved) - set(own))[:3]}")
    check(all(own[k].shape == saved[k].shape for k in set(own) & set(saved)), "every tensor has peft's shape")
    check(any(".experts.base_layer.lora_A" in k for k in saved) == (len(params) == 2),
          "nested wrappers (gate_up_proj under experts.base_layer) exactly when both parameters are adapted")

    # ---- 3. transformers + peft load it unchanged
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        peft_model = PeftModel.from_pretrained(model, out).eval()
    load_warnings = [str(w.message) for w in caught if "key" in str(w.message).lower()]
    check(not load_warnings, f"PeftModel.from_pretrained warns of no missing/unexpected keys {load_warnings}")
    placed = {n.replace(".default.", "."): p for n, p in peft_model.named_parameters() if "lora_" in n}
    check(set(placed) == set(saved), f"peft's LoRA parameters ({len(placed)}) are the file's tensors ({len(saved)})")
    check(all(torch.equal(placed[k], saved[k]) for k in set(placed) & set(saved)), "every loaded LoRA tensor equals the file's")
    check(all(saved[k].abs().max() > 0 for k in saved if ".experts." in k and "lora_B" in k),
          "training moved every expert lora_B off zero")

    # ---- 4. losses
    adapter_loss, adapter_tokens = reference_score(peft_model)
    eo = eo_score(out)
    check(eo["tokens"] == adapter_tokens, f"eo-ddp score counts {eo['tokens']} tokens, reference {adapter_tokens}")
    rel = abs(eo["loss"] - adapter_loss) / abs(adapter_loss)
    check(rel < RTOL, f"eo-ddp score {eo['loss']:.8f} vs transformers/peft {adapter_loss:.8f} (rel {rel:.2e})")
    with torch.no_grad():
        for k, p in peft_model.named_parameters():
            if ".experts." in k and "lora_B" in k:
                p.zero_()
    no_expert_loss, _ = reference_score(peft_model)
    change = abs(adapter_loss - no_expert_loss) / adapter_loss
    check(change > 100 * RTOL, f"the expert LoRA changes the loss: {no_expert_loss:.6f} -> {adapter_loss:.6f} (rel {change:.2e})")

run_case("both", ["gate_up_proj", PARAMS[1]], PARAMS)
run_case("gate_up_only", ["gate_up_proj"], PARAMS[:1])  # one wrapper each: no nesting
run_case("down_only", ["down_proj"], PARAMS[1:])

print(f"{len(failures)} failed")
sys.exit(1 if failures else 0)
