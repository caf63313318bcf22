"""A parquet dataset gives the same token ids and labels as the same rows in JSON lines, and trains.

The same rows (tiny-chat's chat_template conversations: nested lists of structs; its alpaca rows:
flat columns) are written as .jsonl and as .parquet (pyarrow); `eo-ddp preprocess` tokenises both
with the tiny model's tokenizer, and the two prepared files must agree row for row. The ids are
also checked against transformers itself, not eo-ddp's tokeniser: a conversation's ids are
tokenizer.apply_chat_template's, and its trained tokens decode to exactly the assistant turns, each
with its <|im_end|>; an alpaca row's ids and labels are axolotl's rule computed here (the prompt
with the tokenizer's special tokens, -100; the response alone, then eos, trained). Then a run on the
parquet files trains 2 steps.
usage: parquet_jsonl.py EO_DDP SOURCE_DIR WORK_DIR
"""
import json
import os
import shutil
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
from transformers import AutoTokenizer

EO, SRC, WORK = sys.argv[1:4]
shutil.rmtree(WORK, ignore_errors=True)
os.makedirs(WORK)
MODEL = os.path.join(SRC, "fixtures/tiny-qwen3-moe")
DATA = os.path.join(SRC, "fixtures/tiny-chat")
ROWS = 16
IGNORE = -100
failures = []


def check(ok, what):
    print(("ok: " if ok else "FAILED: ") + what, flush=True)
    if not ok:
        failures.append(what)


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def write_both(name, rows):
    """The rows as NAME.jsonl and NAME.parquet; returns the two paths."""
    jsonl, parquet = os.path.join(WORK, name + ".jsonl"), os.path.join(WORK, name + ".parquet")
    with open(jsonl, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    check(pq.read_table(parquet).to_pylist() == rows, f"{name}.parquet holds the same rows (pyarrow reads them back)")
    return jsonl, parquet


def config(name, chat, alpaca, **keys):
    cfg = {"base_model": MODEL, "load_in_4bit": True, "adapter": "qlora", "lora_r": 4, "lora_alpha": 8,
           "lora_target_modules": ["q_proj", "v_proj"], "sequence_len": 256, "micro_batch_size": 2,
           "learning_rate": 1e-3, "seed": 7, "save_steps": 0, "output_dir": os.path.join(WORK, "out-" + name),
           "dataset_prepared_path": os.path.join(WORK, "prepared"),
           "datasets": [{"path": chat, "type": "chat_template"}, {"path": alpaca, "type": "alpaca"}], **keys}
    path = os.path.join(WORK, name + ".yaml")
    with open(path, "w") as f:
        json.dump(cfg, f)  # JSON is YAML
    return path


def preprocess(path):
    p = subprocess.run([EO, "preprocess", "--config", path], capture_output=True, text=True, timeout=600)
    check(p.returncode == 0, f"eo-ddp preprocess --config {os.path.basename(path)} (exit {p.returncode})")
    if p.returncode != 0:
        print(p.stdout, p.stderr)
        return []
    return [read_jsonl(line.split(" -> ")[1]) for line in p.stdout.splitlines() if " -> " in line]


chat_rows = read_jsonl(os.path.join(DATA, "chat.jsonl"))[:ROWS]
alpaca_rows = read_jsonl(os.path.join(DATA, "alpaca.jsonl"))[:ROWS]
chat_jsonl, chat_parquet = write_both("chat", chat_rows)
alpaca_jsonl, alpaca_parquet = write_both("alpaca", alpaca_rows)
from_jsonl = preprocess(config("jsonl", chat_jsonl, alpaca_jsonl))
from_parquet = preprocess(config("parquet", chat_parquet, alpaca_parquet, max_steps=2))
check(len(from_jsonl) == 2 and len(from_parquet) == 2, "both configs prepared their two datasets")
if len(from_jsonl) == 2 and len(from_parquet) == 2:
    for name, a, b in (("chat_template", from_jsonl[0], from_parquet[0]), ("alpaca", from_jsonl[1], from_parquet[1])):
        check(len(a) == ROWS and len(b) == ROWS, f"{name}: {ROWS} rows from each file (got {len(a)}, {len(b)})")
        check([r["input_ids"] for r in a] == [r["input_ids"] for r in b], f"{name}: parquet's token ids == JSONL's")
        check([r["labels"] for r in a] == [r["labels"] for r in b], f"{name}: parquet's labels == JSONL's")

    # transformers' own tokenisation of the rows, independent of eo-ddp's.
    tok = AutoTokenizer.from_pretrained(MODEL)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    for i, (row, got) in enumerate(zip(chat_rows, from_parquet[0])):
        ids = list(tok.apply_chat_template(row["messages"], tokenize=True, return_dict=True)["input_ids"])
        trained = [t for t, lab in zip(got["input_ids"], got["labels"]) if lab != IGNORE]
        expected = "".join(m["content"] + "<|im_end|>" for m in row["messages"] if m["role"] == "assistant")
        if got["input_ids"] != ids or tok.decode(trained) != expected or end not in trained:
            check(False, f"chat row {i}: ids == apply_chat_template, trained tokens == the assistant turns")
            break
    else:
        check(True, f"chat_template: every row's ids are apply_chat_template's, its trained tokens the assistant turns")
    for i, (row, got) in enumerate(zip(alpaca_rows, from_parquet[1])):
        head = ("Below is an instruction that describes a task, paired with an input that provides further context. "
                "Write a response that appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n"
                "### Input:\n{input}\n\n### Response:\n") if row["input"] else (
                "Below is an instruction that describes a task. Write a response that appropriately completes the "
                "request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")
        prompt = tok(head.format(**row))["input_ids"]
        answer = tok(row["output"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        if got["input_ids"] != prompt + answer or got["labels"] != [IGNORE] * len(prompt) + answer:
            check(False, f"alpaca row {i}: ids and labels == axolotl's rule through transformers")
            break
    else:
        check(True, "alpaca: every row's ids and labels are axolotl's rule through transformers' tokenizer")

p = subprocess.run([EO, "train", "--config", os.path.join(WORK, "parquet.yaml")], capture_output=True, text=True,
                   timeout=600)
check(p.returncode == 0, f"a run on the parquet files trains (exit {p.returncode})")
metrics = os.path.join(WORK, "out-parquet", "metrics.jsonl")
steps = [r.get("step") for r in read_jsonl(metrics) if "loss" in r] if os.path.isfile(metrics) else []
check(steps[-2:] == [1, 2], f"it trained 2 steps (metrics.jsonl steps {steps})")
if p.returncode != 0:
    print(p.stdout[-3000:], p.stderr[-3000:])

print("parquet_jsonl: all checks passed" if not failures else f"parquet_jsonl: {len(failures)} FAILED")
sys.exit(1 if failures else 0)
