#!/usr/bin/env python3
"""`eo-ddp generate` with its kv cache continues a prompt as transformers' generate does, in every
attention form the families use, and streaming the experts from host homes changes no token.

    generate_kv_ref.py EO_DDP_BINARY SOURCE_DIR WORK_DIR [ARCH ...]

For each family's tiny checkpoint (tools/make_tiny_model.py, fp32, CPU), a prompt of token ids longer
than the sliding windows and Llama 4's chunks:
1. greedy ids (prefill once, then one token per forward) equal transformers' generate(do_sample=False),
   with and without a peft adapter on the attention projections (random, non-zero B);
2. --no-kv-cache (the whole sequence every token) gives the same ids;
3. on the NF4 base, --expert-offload (experts in host homes, staged into a slot per block) gives the
   same ids as the experts held in place, with and without the adapter.
"""
import json
import os
import shutil
import subprocess
import sys

import torch
import transformers
from peft import LoraConfig, get_peft_model

BINARY, SRC, WORK = sys.argv[1:4]
# GQA with full RoPE (qwen3_moe), partial RoPE (glm4_moe), latent attention (deepseek_v3, glm4_moe_lite),
# sinks and a sliding window (gpt_oss), sliding and full layers of their own geometry (gemma4), chunked
# and NoPE layers (llama4), gated delta-rule layers beside a gated attention layer (qwen3_next); inside their
# multimodal wrappers as the Hub ships them, latent attention with Llama 4's query scale (mistral4_mm) and
# Qwen3.5's delta-rule layers (qwen3_5_moe_mm); q/k norms after RoPE (hunyuan_v1_moe).
ARCHS = sys.argv[4:] or ["qwen3_moe", "glm4_moe", "deepseek_v3", "glm4_moe_lite", "gpt_oss", "gemma4", "llama4", "qwen3_next",
                         "mistral4_mm", "qwen3_5_moe_mm", "hunyuan_v1_moe"]
# The multimodal wrappers' classes (tests/ref/model_ref.py); peft's adapter stays out of their vision towers.
WRAPPERS = {"mistral4_mm": transformers.Mistral3ForConditionalGeneration,
            "qwen3_5_moe_mm": transformers.Qwen3_5MoeForConditionalGeneration}
OFFLOAD = {"qwen3_moe", "qwen3_next"}  # the offload engine is the same for every family: two of them
N = 20
# Every projection of the attention and delta-rule layers, so the adapter changes the cached keys and values
# and the carried conv and recurrent state.
ATTENTION = {"q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
             "in_proj_qkvz", "in_proj_ba", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"}
torch.set_num_threads(1)
shutil.rmtree(WORK, ignore_errors=True)
os.makedirs(WORK)
env = dict(os.environ, OMP_NUM_THREADS="1")
failures = []


def check(ok, msg):
    print(("ok   " if ok else "FAIL ") + msg, flush=True)
    if not ok:
        failures.append(msg)


def eo_generate(model_dir, prompt, *extra):
    r = subprocess.run([BINARY, "generate", "--model", model_dir, "--prompt-ids", ",".join(map(str, prompt)),
                        "--max-new-tokens", str(N), "--json"] + list(extra), env=env, timeout=300, capture_output=True, text=True)
    if r.returncode != 0:
        return None, r.stderr[-600:]
    return json.loads(r.stdout.strip().splitlines()[-1])["ids"], r.stderr


def reference(model, prompt, eos):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=N, do_sample=False, eos_token_id=eos or None,
                         pad_token_id=(eos or [0])[0], attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


for arch in ARCHS:
    model_dir = os.path.join(WORK, arch)
    subprocess.run([sys.executable, os.path.join(SRC, "tools", "make_tiny_model.py"), "--arch", arch, "--out", model_dir,
                    "--seed", "7"], check=True, stdout=subprocess.DEVNULL)
    # No end-of-sequence id: every run generates all N tokens (random weights stop early otherwise;
    # stopping is tests/ref/generate_ref.py's).
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(model_dir, name)
        if os.path.exists(path):
            cfg = json.load(open(path))
            cfg.pop("eos_token_id", None)
            if isinstance(cfg.get("text_config"), dict):
                cfg["text_config"].pop("eos_token_id", None)
            json.dump(cfg, open(path, "w"), indent=2)
    cls = WRAPPERS.get(arch, transformers.AutoModelForCausalLM)
    base = cls.from_pretrained(model_dir, dtype=torch.float32).eval()
    gc = base.generation_config.eos_token_id
    eos = sorted(set(gc if isinstance(gc, list) else [gc]) - {None})
    check(not eos, f"{arch}: the checkpoint has no end-of-sequence id left")
    vocab = base.config.get_text_config().vocab_size
    prompt = torch.randint(3, vocab, (11,), generator=torch.Generator().manual_seed(5)).tolist()

    # A peft adapter on the attention projections, B random so the adapter changes the keys and values.
    names = sorted({n.rsplit(".", 1)[-1] for n, mod in base.named_modules()
                    if isinstance(mod, torch.nn.Linear) and (arch not in WRAPPERS or "language_model." in n)} & ATTENTION)
    adapter_dir = os.path.join(WORK, arch + "-adapter")
    torch.manual_seed(11)
    exclude = {"exclude_modules": r"(?!model\.language_model\.).*"} if arch in WRAPPERS else {}
    peft_model = get_peft_model(cls.from_pretrained(model_dir, dtype=torch.float32),
                                LoraConfig(r=4, lora_alpha=32, target_modules=names, init_lora_weights=False,
                                           lora_dropout=0.0, **exclude))
    peft_model.save_pretrained(adapter_dir)
    peft_model.eval()

    wanted = {}
    for name, extra, model in (("base", [], base), ("adapter", ["--adapter", adapter_dir], peft_model)):
        with torch.no_grad():
            want = wanted[name] = reference(model, prompt, eos)
        if name == "adapter":
            check(want != wanted["base"], f"{arch}: the adapter changes transformers' tokens (the check below can fail)")
        got, log = eo_generate(model_dir, prompt, *extra)
        check(got == want and len(want) == N, f"{arch} {name}: kv-cache greedy ids {got and got[:6]}... equal transformers' generate "
              f"{want[:6]}... ({len(want)} tokens){'' if got is not None else ' ' + log}")
        check(got is None or "kv cache" in log, f"{arch} {name}: the log says the kv cache decodes")
        again, log = eo_generate(model_dir, prompt, "--no-kv-cache", *extra)
        check(again == want, f"{arch} {name}: --no-kv-cache gives the same ids{'' if again is not None else ' ' + log}")
        if arch in OFFLOAD:
            held, log1 = eo_generate(model_dir, prompt, "--load-in-4bit", *extra)
            streamed, log2 = eo_generate(model_dir, prompt, "--load-in-4bit", "--expert-offload", *extra)
            check(held is not None and streamed == held,
                  f"{arch} {name}: NF4 experts streamed from homes give the ids of the experts held in place "
                  f"({held and held[:6]}... / {streamed and streamed[:6]}...){'' if held and streamed else log1 + log2}")
            check("experts streamed:" in log2 and "block copies" in log2, f"{arch} {name}: the log counts the experts' copies")

print(f"{len(failures)} failed")
sys.exit(1 if failures else 0)
