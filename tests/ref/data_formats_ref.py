"""The axolotl dataset formats end to end (issue #16): eo-ddp preprocess / train against an
independent reference of transformers' apply_chat_template and axolotl's masking rules.

The reference here does not share code with tools/prepare_data.py and finds the trained spans
another way: on the rendered *text* (the template rendered with the turn's content and with a
placeholder, compared character by character), then the tokens whose character offsets fall in
a trained span; the eos rule is axolotl's documented one (the first eos within 3 tokens after a
trained turn's content: train_on_eos turn / all / last / none). The ids must equal
tokenizer.apply_chat_template(messages, tokenize=True) exactly.

Also: the datasets train (chat_template, alpaca, completion), a changed data file or tokenizer
makes a new cache while an unchanged one is reused, pre-tokenized data trains with no Python
reachable at all, and the eval loss of val_set_size equals `eo-ddp score` on output_dir/eval.jsonl.
usage: data_formats_ref.py EO_DDP SOURCE_DIR WORK_DIR
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
DATA = os.path.join(SRC, "fixtures/tiny-chat")
IGNORE = -100
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}")
failures = []


def check(ok, what):
    print(("ok: " if ok else "FAILED: ") + what, flush=True)
    if not ok:
        failures.append(what)


BASE = {
    "base_model": MODEL, "adapter": "lora", "lora_r": 4, "lora_alpha": 8, "sequence_len": 256, "sample_packing": True,
    "micro_batch_size": 2, "max_steps": 2, "learning_rate": 1e-3, "gradient_checkpointing": True,
    "gradient_checkpointing_kwargs": {"use_reentrant": False}, "overwrite_output_dir": True, "save_steps": 0,
    "dataset_prepared_path": os.path.join(WORK, "prepared"),
}


def write_config(name, **keys):
    cfg = dict(BASE, output_dir=os.path.join(WORK, "out-" + name), **keys)
    path = os.path.join(WORK, name + ".yaml")
    with open(path, "w") as f:
        json.dump(cfg, f)  # JSON is YAML
    return path


def eo(*args, env=None, ok=True):
    p = subprocess.run([EO, *args], capture_output=True, text=True, env=env, timeout=600)
    if (p.returncode == 0) != ok:
        print(p.stdout, p.stderr)
    return p


def preprocess(name, datasets, **keys):
    p = eo("preprocess", "--config", write_config(name, datasets=datasets, **keys))
    check(p.returncode == 0, f"{name}: eo-ddp preprocess")
    files = [line.split(" -> ")[1] for line in p.stdout.splitlines() if " -> " in line]
    rows = []
    for f in files:
        with open(f) as fh:
            rows.append([json.loads(line) for line in fh])
    return rows, p


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


tok = AutoTokenizer.from_pretrained(MODEL)
EOS = tok.eos_token_id


# ---- the reference -----------------------------------------------------------------------------
def ref_chat(messages, template=None, roles_to_train=("assistant",), train_on_eos="turn", train_on_inputs=False):
    def text_of(msgs):
        return tok.apply_chat_template(msgs, chat_template=template, tokenize=False)

    ids = list(tok.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True)["input_ids"])
    text = text_of(messages)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    assert list(enc["input_ids"]) == ids, "the rendered text does not tokenize back to the ids"
    offsets = enc["offset_mapping"]
    labels = [IGNORE] * len(ids)
    last_eos = None
    for i, m in enumerate(messages):
        with_content = text_of(messages[: i + 1])
        with_dummy = text_of(messages[:i] + [{"role": m["role"], "content": "\x00"}])
        start = next(k for k in range(len(with_content)) if with_content[k] != with_dummy[k])
        end = start + len(m["content"])  # the content, as written into the template
        assert with_content[start:end] == m["content"]
        toks = [t for t, (a, b) in enumerate(offsets) if a >= start and b <= end and b > a]
        train = train_on_inputs or m["role"] in roles_to_train
        if train:
            for t in toks:
                labels[t] = ids[t]
        after = toks[-1] + 1
        eos_at = next((t for t in range(after, min(after + 4, len(ids))) if ids[t] == EOS), None)
        if eos_at is not None:
            last_eos = eos_at
            if train_on_eos == "all" or (train_on_eos == "turn" and train):
                labels[eos_at] = EOS
    if train_on_eos == "last" and last_eos is not None:
        labels[last_eos] = EOS
    return ids, labels


ALPACA_IN = ("Below is an instruction that describes a task, paired with an input that provides further context. "
             "Write a response that appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n"
             "### Input:\n{input}\n\n### Response:\n")
ALPACA = ("Below is an instruction that describes a task. Write a response that appropriately completes the request."
          "\n\n### Instruction:\n{instruction}\n\n### Response:\n")


def ref_alpaca(row, train_on_inputs=False):
    prompt = (ALPACA_IN if row.get("input") else ALPACA).format(**row)
    p = tok(prompt)["input_ids"]
    r = tok(row["output"])["input_ids"] + [EOS]
    return p + r, (p if train_on_inputs else [IGNORE] * len(p)) + r


def compare(name, got, want):
    bad = [i for i, (g, w) in enumerate(zip(got, want)) if g["input_ids"] != w[0] or g["labels"] != w[1]]
    check(len(got) == len(want) and not bad, f"{name}: ids and labels equal the reference for {len(want)} rows"
          + (f" (first difference at row {bad[0]})" if bad else ""))
    if bad:
        g, w = got[bad[0]], want[bad[0]]
        print("  eo-ddp   ", list(zip(g["input_ids"], g["labels"])))
        print("  reference", list(zip(*w)))


chats = [r["messages"] for r in read_jsonl(os.path.join(DATA, "chat.jsonl"))]
alpaca = read_jsonl(os.path.join(DATA, "alpaca.jsonl"))
chat_file = os.path.join(DATA, "chat.jsonl")

# ---- chat_template: defaults, the sharegpt field names, chatml, roles and eos options ----------
(rows,), _ = preprocess("chat", [{"path": chat_file, "type": "chat_template"}])
compare("chat_template defaults (tokenizer_default, [assistant], train_on_eos turn)", rows, [ref_chat(m) for m in chats])
check(all(any(x != IGNORE for x in r["labels"]) and any(x == IGNORE for x in r["labels"]) for r in rows),
      "chat_template: every row has trained and masked tokens")
(rows,), _ = preprocess("sharegpt", [{"path": os.path.join(DATA, "sharegpt.jsonl"), "type": "chat_template",
                                      "field_messages": "conversations", "message_field_role": "from",
                                      "message_field_content": "value"}])
compare("chat_template with field_messages / message_field_role / content (human, gpt)", rows, [ref_chat(m) for m in chats])
array = os.path.join(WORK, "sharegpt-array.json")  # the same rows as one JSON array, newer axolotl's mapping key
with open(array, "w") as f:
    json.dump(read_jsonl(os.path.join(DATA, "sharegpt.jsonl")), f)
(rows,), _ = preprocess("sharegpt-array", [{"path": array, "type": "chat_template", "field_messages": "conversations",
                                            "message_property_mappings": {"role": "from", "content": "value"}}])
compare("chat_template from a JSON array with message_property_mappings", rows, [ref_chat(m) for m in chats])
for opts, kw in [({"chat_template": "chatml", "train_on_eos": "all"}, dict(template=CHATML, train_on_eos="all")),
                 ({"roles_to_train": ["assistant", "user"], "train_on_eos": "last"},
                  dict(roles_to_train=("assistant", "user"), train_on_eos="last")),
                 ({"train_on_eos": "none"}, dict(train_on_eos="none"))]:
    (rows,), _ = preprocess("chat-" + "-".join(f"{k}" for k in opts), [dict({"path": chat_file, "type": "chat_template"}, **opts)])
    compare(f"chat_template {opts}", rows, [ref_chat(m, **kw) for m in chats])
(rows,), _ = preprocess("chat-inputs", [{"path": chat_file, "type": "chat_template"}], train_on_inputs=True)
compare("chat_template, train_on_inputs: true", rows, [ref_chat(m, train_on_inputs=True) for m in chats])

# ---- alpaca, completion, input_output ---------------------------------------------------------
(rows,), _ = preprocess("alpaca", [{"path": os.path.join(DATA, "alpaca.jsonl"), "type": "alpaca"}])
compare("alpaca", rows, [ref_alpaca(r) for r in alpaca])
(rows,), _ = preprocess("alpaca-inputs", [{"path": os.path.join(DATA, "alpaca.jsonl"), "type": "alpaca"}], train_on_inputs=True)
compare("alpaca, train_on_inputs: true", rows, [ref_alpaca(r, True) for r in alpaca])
texts = [r["text"] for r in read_jsonl(os.path.join(DATA, "completion.jsonl"))]
(rows,), _ = preprocess("completion", [{"path": os.path.join(DATA, "completion.jsonl"), "type": "completion"}])
compare("completion", rows, [(tok(t)["input_ids"] + [EOS],) * 2 for t in texts])
io_path = os.path.join(WORK, "io.jsonl")
segs = [[{"text": "Q: where is the cat?\n", "label": False}, {"text": "A: the cat is at home.", "label": True}],
        [{"text": "Hello", "label": True}, {"text": " there, friend", "label": False}]]
with open(io_path, "w") as f:
    for s in segs:
        f.write(json.dumps({"segments": s}) + "\n")


def ref_io(s):
    ids, labels = [], []
    for seg in s:
        t = tok(seg["text"], add_special_tokens=False)["input_ids"]
        ids += t
        labels += t if seg["label"] else [IGNORE] * len(t)
    return ids, labels


(rows,), _ = preprocess("io", [{"path": io_path, "type": "input_output"}])
compare("input_output", rows, [ref_io(s) for s in segs])

# ---- train on each format; eval loss == eo-ddp score on the same rows -------------------------
p = eo("--config", write_config("train-mixed", datasets=[
    {"path": chat_file, "type": "chat_template"}, {"path": os.path.join(DATA, "alpaca.jsonl"), "type": "alpaca"},
    {"path": os.path.join(DATA, "completion.jsonl"), "type": "completion"}], val_set_size=0.1, eval_steps=1))
check(p.returncode == 0, "chat_template + alpaca + completion train (val_set_size 0.1, eval_steps 1)")
out = os.path.join(WORK, "out-train-mixed")
metrics = read_jsonl(os.path.join(out, "metrics.jsonl"))
check(all("eval_loss" in m for m in metrics), "every step has an eval_loss in metrics.jsonl (eval_steps 1)")
check("eval loss" in p.stderr, "the progress line shows the eval loss")
s = eo("score", "--model", MODEL, "--adapter", out, "--data", os.path.join(out, "eval.jsonl"), "--json")
score = json.loads(s.stdout)
last = metrics[-1]
check(score["tokens"] == last["eval_tokens"] and abs(score["loss"] - last["eval_loss"]) <= 1e-5 * abs(score["loss"]),
      f"eval loss {last['eval_loss']:.7f} ({last['eval_tokens']} tokens) == eo-ddp score {score['loss']:.7f} "
      f"({score['tokens']} tokens)")
n_train = sum(1 for _ in open(chat_file)) + len(alpaca) + len(texts)
held = sum(1 for _ in open(os.path.join(out, "eval.jsonl")))
check(held >= 0.1 * n_train, f"val_set_size 0.1 held out {held} rows of {n_train}")

# test_datasets, evals_per_epoch and saves_per_epoch over one epoch (no max_steps).
p = eo("--config", write_config("epoch", datasets=[{"path": chat_file, "type": "chat_template"}],
                                test_datasets=[{"path": os.path.join(DATA, "alpaca.jsonl"), "type": "alpaca"}],
                                max_steps=None, num_epochs=1, micro_batch_size=4, evals_per_epoch=2, saves_per_epoch=2,
                                save_total_limit=5))
check(p.returncode == 0, "chat_template train with test_datasets (alpaca), evals_per_epoch 2, saves_per_epoch 2")
out = os.path.join(WORK, "out-epoch")
metrics = read_jsonl(os.path.join(out, "metrics.jsonl"))
total = metrics[-1]["step"]
half = -(-total // 2)
evals = [m["step"] for m in metrics if "eval_loss" in m]
check(evals == sorted(set(range(half, total + 1, half)) | {total}),
      f"evals_per_epoch 2 over {total} steps: evaluations at steps {evals}")
check(os.path.isdir(os.path.join(out, f"checkpoint-{half}")), f"saves_per_epoch 2: a checkpoint at step {half} of {total}")
s = eo("score", "--model", MODEL, "--adapter", out, "--data", os.path.join(out, "eval.jsonl"), "--json")
check(abs(json.loads(s.stdout)["loss"] - metrics[-1]["eval_loss"]) <= 1e-5 * metrics[-1]["eval_loss"],
      "test_datasets eval loss == eo-ddp score on output_dir/eval.jsonl")
alpaca_rows = sum(1 for r in read_jsonl(os.path.join(out, "eval.jsonl")))
check(alpaca_rows == len(alpaca), f"eval.jsonl holds the {len(alpaca)} test_datasets rows ({alpaca_rows})")

# ---- the cache: reused when nothing changed, rebuilt when the data or the tokenizer change, or
# when the cache file itself changed -------------------------------------------------------------
cfg = write_config("cache", datasets=[{"path": os.path.join(WORK, "chat-copy.jsonl"), "type": "chat_template"}],
                   dataset_prepared_path=os.path.join(WORK, "cache"))
shutil.copy(chat_file, os.path.join(WORK, "chat-copy.jsonl"))
first = eo("preprocess", "--config", cfg)
again = eo("preprocess", "--config", cfg)
check("0 dataset(s) tokenised, 1 already cached" in again.stdout, "an unchanged dataset is not tokenised again")
with open(os.path.join(WORK, "chat-copy.jsonl"), "a") as f:
    f.write(json.dumps({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}) + "\n")
changed = eo("preprocess", "--config", cfg)
check("1 dataset(s) tokenised" in changed.stdout and changed.stdout.split(" -> ")[1] != first.stdout.split(" -> ")[1],
      "a changed data file is tokenised again, into a new cache folder")
check(len(read_jsonl(changed.stdout.split(" -> ")[1].split("\n")[0])) == len(chats) + 1, "the new cache has the new row")
# The cache is checked at every use against the hash, size and rows its manifest recorded: a
# rewritten, truncated or symlinked data.jsonl is rebuilt, with a warning saying why.
cached = changed.stdout.split(" -> ")[1].split("\n")[0]
good = open(cached).read()
other = os.path.join(WORK, "other.jsonl")
shutil.copy(os.path.join(SRC, "fixtures/tiny-data/train.jsonl"), other)
for how, damage in [
        ("rewritten", lambda: open(cached, "w").write("".join(
            json.dumps(dict(r, input_ids=[7] * len(r["input_ids"]))) + "\n" for r in map(json.loads, good.splitlines())))),
        ("truncated", lambda: open(cached, "w").write("".join(good.splitlines(keepends=True)[:-2]))),
        ("symlinked", lambda: (os.remove(cached), os.symlink(other, cached)))]:
    damage()
    p = eo("preprocess", "--config", cfg)
    check("1 dataset(s) tokenised" in p.stdout and "cannot be used" in p.stderr and "it is rebuilt" in p.stderr,
          f"a {how} cache file is noticed and rebuilt")
    check(not os.path.islink(cached) and open(cached).read() == good, f"the rebuilt cache ({how}) is the original again")
# A dataset that trains nothing (roles_to_train matching no role) inside a mix is refused, naming it.
mix = write_config("mix-untrainable", datasets=[{"path": chat_file, "type": "chat_template"},
                                                {"path": os.path.join(WORK, "chat-copy.jsonl"), "type": "chat_template",
                                                 "roles_to_train": ["nobody"]}])
p = eo("--config", mix, ok=False)
check(p.returncode == 2 and "chat-copy.jsonl (type chat_template, one of 2 in datasets) has no trainable token" in p.stderr,
      "a dataset with no trainable label in a mix is a usage error naming it")
model2 = os.path.join(WORK, "model-chatml")
shutil.copytree(MODEL, model2)
tc = json.load(open(os.path.join(model2, "tokenizer_config.json")))
tc["chat_template"] = CHATML
json.dump(tc, open(os.path.join(model2, "tokenizer_config.json"), "w"))
retok = eo("preprocess", "--config", cfg, "--set", f"base_model={model2}")
check("1 dataset(s) tokenised" in retok.stdout, "a changed chat template in the tokenizer is tokenised again")
(rows,), _ = preprocess("cache-chatml", [{"path": chat_file, "type": "chat_template"}], base_model=model2)
compare("chat_template with the new tokenizer's template", rows, [ref_chat(m, template=CHATML) for m in chats])

# ---- pre-tokenized data needs no Python; formatted data without one says what to do ---------
no_python = dict(os.environ, EO_DDP_PYTHON="/nonexistent/python", PATH="/usr/bin/false-only")
p = eo("--config", write_config("tokenized", datasets=[{"path": os.path.join(SRC, "fixtures/tiny-data/train.jsonl"),
                                                        "type": "tokenized"}]), env=no_python)
check(p.returncode == 0, "pre-tokenized data trains with no Python reachable")
p = eo("--config", write_config("needs-python", datasets=[{"path": chat_file, "type": "chat_template"}],
                                dataset_prepared_path=os.path.join(WORK, "empty-cache")), env=no_python, ok=False)
check(p.returncode != 0 and "EO_DDP_PYTHON" in p.stderr, "a chat dataset with no Python fails, naming EO_DDP_PYTHON")
bad = os.path.join(WORK, "bad.jsonl")
with open(bad, "w") as f:
    f.write(json.dumps({"messages": [{"role": "user"}]}) + "\n")
p = eo("preprocess", "--config", write_config("bad", datasets=[{"path": bad, "type": "chat_template"}]), ok=False)
check(p.returncode == 2 and "bad.jsonl:1" in p.stderr, "a malformed row is a usage error naming file:line")

# Issue #32 item 10: bytes that are not UTF-8, a lone surrogate, a template that raises or uses an
# undefined name: exit 2 naming file:line (and the template's message), never a traceback.
good_row = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}
cases = {
    "utf8": (b'{"messages": [{"role": "user", "content": "caf\xe9"}]}\n', None, "not valid UTF-8"),
    "surrogate": (b'{"messages": [{"role": "user", "content": "\\ud800"}, {"role": "assistant", "content": "x"}]}\n', None,
                  "not valid Unicode"),
    "raises": (json.dumps(good_row).encode() + b"\n", "{{ raise_exception('no system message') }}", "no system message"),
    "undefined": (json.dumps(good_row).encode() + b"\n", "{% for m in messages %}{{ m.missing.deeper }}{% endfor %}",
                  "the chat template failed on this row"),
}
for name, (data, template, says) in cases.items():
    path = os.path.join(WORK, f"bad-{name}.jsonl")
    with open(path, "wb") as f:
        f.write(json.dumps(good_row).encode() + b"\n" + data)
    entry = {"path": path, "type": "chat_template"}
    if template:
        entry.update(chat_template="jinja", chat_template_jinja=template)
    p = eo("preprocess", "--config", write_config("bad-" + name, datasets=[entry]), ok=False)
    where = f"bad-{name}.jsonl:{1 if template else 2}"
    check(p.returncode == 2 and where in p.stderr and says in p.stderr and "Traceback" not in p.stderr,
          f"{name}: exit 2 naming {where} ({p.returncode}: {p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ''})")

print("data_formats_ref: all checks passed" if not failures else f"data_formats_ref: FAILED ({len(failures)})")
sys.exit(1 if failures else 0)
