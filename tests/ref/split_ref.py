"""datasets[].split (issue #31): Hugging Face's slice syntax on a local file, as axolotl passes it to
datasets.load_dataset(..., split=...). The rows kept for each split of a 37-row file are written
out by hand from datasets' documented rule (ReadInstruction, rounding "closest": a percentage
boundary is round(p * n / 100) with Python's round, so 50% of 37 is 18; negatives count from the
end; either side's % makes both percentages), and eo-ddp preprocess must keep exactly those rows,
each tokenized as the completion format does (the text's ids + eos).
usage: split_ref.py EO_DDP SOURCE_DIR WORK_DIR
"""
import json
import os
import shutil
import subprocess
import sys

from transformers import AutoTokenizer

EO, SRC, WORK = sys.argv[1], sys.argv[2], sys.argv[3]
shutil.rmtree(WORK, ignore_errors=True)
os.makedirs(WORK)
MODEL = os.path.join(SRC, "fixtures/tiny-qwen3-moe")
failures = []


def check(ok, what):
    print(("ok: " if ok else "FAILED: ") + what, flush=True)
    if not ok:
        failures.append(what)


N = 37
texts = [f"row number {i} says hello" for i in range(N)]
data = os.path.join(WORK, "rows.jsonl")
with open(data, "w") as f:
    for t in texts:
        f.write(json.dumps({"text": t}) + "\n")
tok = AutoTokenizer.from_pretrained(MODEL)

expected = {  # split -> the rows kept (first, past-the-end) of 37
    "train": (0, 37),
    "train[:20%]": (0, 7),      # round(7.4)
    "train[10:50]": (10, 37),   # clamped at the end
    "train[-10%:]": (33, 37),   # round(-3.7) = -4
    "train[15%:45%]": (6, 17),  # round(5.55), round(16.65)
    "train[:50%]": (0, 18),     # round(18.5) = 18, half to even
    "train[5:-30]": (5, 7),
    "train[10:50%]": (4, 18),   # one % makes both percentages: round(3.7), round(18.5)
}
# One preprocess, one dataset entry per split (their caches come out in order).
cfg = {"base_model": MODEL, "adapter": "lora", "sequence_len": 64, "output_dir": os.path.join(WORK, "out"),
       "dataset_prepared_path": os.path.join(WORK, "prepared"),
       "datasets": [{"path": data, "type": "completion", "split": split} for split in expected]}
path = os.path.join(WORK, "c.yaml")
with open(path, "w") as f:
    json.dump(cfg, f)
p = subprocess.run([EO, "preprocess", "--config", path], capture_output=True, text=True, timeout=300)
files = [line.split(" -> ")[1] for line in p.stdout.splitlines() if " -> " in line]
check(p.returncode == 0 and len(files) == len(expected), f"eo-ddp preprocess ({p.stderr[-500:]})")
for (split, (lo, hi)), out in zip(expected.items(), files):
    with open(out) as f:
        got = [json.loads(line)["input_ids"] for line in f]
    want = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts[lo:hi]]
    check(got == want, f"{split}: rows {lo}..{hi - 1} of {N} ({len(got)} kept)")

bad = {"datasets": [{"path": data, "type": "completion", "split": "test"}]}
bad_config = os.path.join(WORK, "bad_split.yaml")
with open(bad_config, "w") as f:
    json.dump(dict(base_model=MODEL, adapter="lora", output_dir=os.path.join(WORK, "out"), **bad), f)
p = subprocess.run([EO, "--check", "--config", bad_config], capture_output=True, text=True)
check(p.returncode == 2 and "datasets.0.split: 'test': a local JSON lines file is the split train" in p.stderr + p.stdout,
      "another split name is refused")

if failures:
    print(f"split_ref: {len(failures)} FAILED")
    sys.exit(1)
print("split_ref: all checks passed")
