#!/usr/bin/env python3
"""`eo-ddp generate` continues a prompt as transformers' generate does.

    generate_ref.py EO_DDP_BINARY SOURCE_DIR WORK_DIR

On the bundled tiny Qwen3-MoE (fp32, CPU), with and without an adapter eo-ddp trains (attention and
fused expert LoRA, which peft loads):
1. the prompt's ids are the tokenizer's apply_chat_template(..., add_generation_prompt=True) (--raw: the
   text's own ids);
2. greedy ids equal transformers' generate(do_sample=False) (PeftModel with the adapter, on the stored
   fp32 base: --no-load-in-4bit), stopping at the same end-of-turn ids;
3. the streamed text is the tokenizer's decoding of those ids, and the log gives both rates; with an
   adapter, generate runs on the base it trained on (its eo_ddp_base.json: NF4 here);
4. sampling with a seed repeats itself, and a bad flag is a usage error (exit 2).
"""
import json
import os
import re
import shutil
import subprocess
import sys

import torch
import transformers
from peft import PeftModel

BINARY, SRC, WORK = sys.argv[1:4]
MODEL = os.path.join(SRC, "fixtures", "tiny-qwen3-moe")
N = 24
torch.set_num_threads(1)
shutil.rmtree(WORK, ignore_errors=True)
os.makedirs(WORK)
env = dict(os.environ, OMP_NUM_THREADS="1")
failures = []


def check(ok, msg):
    print(("ok   " if ok else "FAIL ") + msg)
    if not ok:
        failures.append(msg)


adapter = os.path.join(WORK, "adapter")
subprocess.run([BINARY, "--config", "configs/tiny-qwen3-moe.yaml", "--set", "output_dir=" + adapter, "--set", "max_steps=8",
                "--set", "save_steps=0", "--set", "learning_rate=0.01", "--set", "lora_dropout=0",
                "--set", "lora_target_linear=false", "--set", "lora_target_modules=[q_proj, k_proj, v_proj, o_proj]",
                "--set", "lora_target_parameters=[mlp.experts.gate_up_proj, mlp.experts.down_proj]"],
               cwd=SRC, env=env, check=True, timeout=300, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
tok = transformers.AutoTokenizer.from_pretrained(MODEL)
prompt = "Tell me about the sea."


def generate(*args):
    r = subprocess.run([BINARY, "generate", "--model", MODEL, "--prompt", prompt, "--max-new-tokens", str(N)] + list(args),
                       env=env, timeout=300, capture_output=True, text=True)
    return r


def reference(model, prompt_ids, stop):
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=N, do_sample=False, eos_token_id=stop,
                         pad_token_id=stop[0], attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
    return out[0, len(prompt_ids):].tolist()


base = transformers.AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
chat_ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True,
                                   return_dict=False)
gc = json.load(open(os.path.join(MODEL, "generation_config.json"))).get("eos_token_id")
vocab = tok.get_vocab()
stop = sorted((set(gc if isinstance(gc, list) else [gc]) | {tok.eos_token_id}) - {None}
              | {vocab[t] for t in ("<|im_end|>", "<|endoftext|>") if t in vocab})
# The adapter trained on the NF4 base (load_in_4bit), which generate follows unless told otherwise;
# transformers' reference is the stored fp32 base, so --no-load-in-4bit.
for name, extra, model in (("base", [], base), ("adapter", ["--adapter", adapter, "--no-load-in-4bit"], None)):
    if model is None:
        model = PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32),
                                          adapter).eval()
    for raw in (False, True):
        r = generate(*(extra + ["--json"] + (["--raw"] if raw else [])))
        check(r.returncode == 0, f"{name}{' --raw' if raw else ''}: generate --json exits 0 {r.stderr[-300:] if r.returncode else ''}")
        if r.returncode:
            continue
        got = json.loads(r.stdout.strip().splitlines()[-1])
        want_prompt = tok(prompt).input_ids if raw else chat_ids
        check(got["prompt_ids"] == want_prompt, f"{name}{' --raw' if raw else ''}: the prompt's ids are the tokenizer's")
        with torch.no_grad():
            want = reference(model, want_prompt, stop)
        check(got["ids"] == want, f"{name}{' --raw' if raw else ''}: greedy ids {got['ids'][:8]}... equal transformers' "
              f"generate {want[:8]}... ({len(want)} tokens)")
        check(got["prefill_tokens_per_s"] > 0 and (len(want) < 2 or got["decode_tokens_per_s"] > 0), "both rates are given")

# ---- 3. streamed text, rates in the log; the adapter's own base by default
r = generate("--adapter", adapter)
check("generate: NF4 base" in r.stderr, "with --adapter, generate runs on the base the adapter trained on (NF4)")
ids = json.loads(generate("--adapter", adapter, "--json").stdout.strip().splitlines()[-1])["ids"]
check(r.returncode == 0 and r.stdout == tok.decode(ids, skip_special_tokens=True) + "\n",
      f"the streamed text is the tokenizer's decoding of the ids: {r.stdout!r}")
check(re.search(r"prompt tokens at [\d.]+ tok/s \(prefill\), \d+ new tokens at [\d.]+ tok/s \(decode", r.stderr) is not None,
      "the log gives the prefill and decode rates")

# ---- 4. sampling, and a bad flag
s1, s2 = (json.loads(generate("--json", "--temperature", "0.8", "--top-p", "0.9", "--seed", "3").stdout.strip().splitlines()[-1])
          for _ in range(2))
check(s1["ids"] == s2["ids"], "sampling with the same seed repeats itself")
r = generate("--temperature", "-1")
check(r.returncode == 2 and "--temperature" in r.stderr, "--temperature -1 is a usage error naming the flag")

print(f"{len(failures)} failed")
sys.exit(1 if failures else 0)
