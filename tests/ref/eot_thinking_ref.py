"""eot_tokens / train_on_eot and field_thinking / template_thinking_key (issue #31) against
axolotl's chat_template masking rules, found on the rendered text (not by the tool's token diff):

- a message's thinking (the data's field_thinking, default reasoning_content) is passed to the
  template as template_thinking_key (default reasoning_content); axolotl's dummy turn carries no
  thinking, so a trained turn's span is its rendered thinking and content together;
- after each located turn the first end-of-turn token (eot_tokens, default the eos) and the first
  eos within 3 tokens of the span's end are labelled as train_on_eot (default train_on_eos) and
  train_on_eos say: all, turn (trained turns), last (of the located turns), none; untrained turns
  are not located unless one of the two is all;
- an eot token of several tokens is refused; one the template never writes is dropped.
The ids must equal tokenizer.apply_chat_template of the messages with the thinking key.
usage: eot_thinking_ref.py EO_DDP SOURCE_DIR WORK_DIR
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
IGNORE = -100
failures = []


def check(ok, what):
    print(("ok: " if ok else "FAILED: ") + what, flush=True)
    if not ok:
        failures.append(what)


tok = AutoTokenizer.from_pretrained(MODEL)
EOT = "<|endoftext|>"  # one token of the tiny tokenizer, not its eos (<|im_end|>)
# A template like gpt-oss's: thinking in its own block, turns ended by an end token; the eos only
# after the last assistant turn.
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
            "{% if m.get('THINK') %}thinking {{ m['THINK'] }} done {% endif %}{{ m['content'] }}"
            "{% if loop.last and m['role'] == 'assistant' %}<|im_end|>{% else %}" + EOT + "{% endif %}\n{% endfor %}")


def template_for(key):
    return TEMPLATE.replace("THINK", key)


rows = [
    {"messages": [{"role": "user", "content": "what is two and two"},
                  {"role": "assistant", "content": "four", "reasoning_content": "two plus two is four"},
                  {"role": "user", "content": "and three"},
                  {"role": "assistant", "content": "five", "reasoning_content": "add one more"}]},
    {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                  {"role": "assistant", "content": "hello there"}]},
]
data = os.path.join(WORK, "chat.jsonl")
with open(data, "w") as f:
    for r in rows:
        f.write(json.dumps(r) + "\n")


def reference(messages, template, key, train_on_eos, train_on_eot, eot_ids):
    msgs = []
    for m in messages:
        x = {"role": m["role"], "content": m["content"]}
        if m.get("reasoning_content") is not None and key:
            x[key] = m["reasoning_content"]
        msgs.append(x)

    def text(ms):
        return tok.apply_chat_template(ms, chat_template=template, tokenize=False)

    ids = list(tok.apply_chat_template(msgs, chat_template=template, tokenize=True, return_dict=True)["input_ids"])
    full = text(msgs)
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    assert list(enc["input_ids"]) == ids
    offsets = enc["offset_mapping"]
    labels = [IGNORE] * len(ids)
    ends = [(eot_ids, train_on_eot), ({tok.eos_token_id}, train_on_eos)]
    last = [-1, -1]
    for i, m in enumerate(msgs):
        train = m["role"] == "assistant"
        if not train and "all" not in (train_on_eos, train_on_eot):
            continue
        a = text(msgs[: i + 1])
        b = text(msgs[:i] + [{"role": m["role"], "content": "\x00"}])  # axolotl's dummy: no thinking
        start = next(k for k in range(min(len(a), len(b))) if a[k] != b[k])
        back = next(k for k in range(min(len(a), len(b))) if a[len(a) - 1 - k] != b[len(b) - 1 - k])
        end = len(a) - back  # the chars this turn's content and thinking take
        toks = [t for t, (x, y) in enumerate(offsets) if x >= start and y <= end and y > x]
        if train:
            for t in toks:
                labels[t] = ids[t]
        after = toks[-1] + 1
        for j, (which, option) in enumerate(ends):
            at = next((t for t in range(after, min(after + 4, len(ids))) if ids[t] in which), None)
            if at is not None:
                last[j] = at
                if option == "all" or (option == "turn" and train):
                    labels[at] = ids[at]
    for j, (_, option) in enumerate(ends):
        if option == "last" and last[j] != -1:
            labels[last[j]] = ids[last[j]]
    return ids, labels


def preprocess(name, dataset, ok=True, **keys):
    cfg = {"base_model": MODEL, "adapter": "lora", "sequence_len": 512, "output_dir": os.path.join(WORK, "out"),
           "dataset_prepared_path": os.path.join(WORK, "prepared"), "chat_template": "jinja", "datasets": [dataset]}
    cfg.update(keys)
    path = os.path.join(WORK, name + ".yaml")
    with open(path, "w") as f:
        json.dump(cfg, f)
    p = subprocess.run([EO, "preprocess", "--config", path], capture_output=True, text=True, timeout=300)
    if (p.returncode == 0) != ok:
        print(p.stdout[-2000:], p.stderr[-2000:])
    files = [line.split(" -> ")[1] for line in p.stdout.splitlines() if " -> " in line]
    out = []
    if files:
        with open(files[0]) as f:
            out = [json.loads(line) for line in f]
    return out, p


EOT_ID = tok.encode(EOT, add_special_tokens=False)[0]
cases = [  # name, dataset keys, top-level keys, thinking key the template reads, eos rule, eot rule, eot ids
    ("default", {}, {}, "reasoning_content", "turn", "turn", {tok.eos_token_id}),
    ("eot-turn", {}, {"eot_tokens": [EOT]}, "reasoning_content", "turn", "turn", {EOT_ID}),
    ("eot-all", {"train_on_eot": "all"}, {"eot_tokens": [EOT]}, "reasoning_content", "turn", "all", {EOT_ID}),
    ("eot-last", {"train_on_eot": "last", "train_on_eos": "none"}, {"eot_tokens": [EOT]}, "reasoning_content", "none",
     "last", {EOT_ID}),
    ("thinking-key", {"field_thinking": "reasoning_content", "template_thinking_key": "thinking"},
     {"eot_tokens": [EOT]}, "thinking", "turn", "turn", {EOT_ID}),
]
for name, ds_keys, top, key, on_eos, on_eot, eot_ids in cases:
    template = template_for(key)
    ds = {"path": data, "type": "chat_template", **ds_keys}
    got, p = preprocess(name, ds, chat_template_jinja=template, **top)
    want = [dict(zip(("input_ids", "labels"), reference(r["messages"], template, key, on_eos, on_eot, eot_ids))) for r in rows]
    check(p.returncode == 0 and [(g["input_ids"], g["labels"]) for g in got] == [(w["input_ids"], w["labels"]) for w in want],
          f"{name}: ids and labels as axolotl's rules give them")
    if name == "default":
        trained_with_thinking = sum(x != IGNORE for x in got[0]["labels"])

# Mapped message fields: axolotl passes no thinking then.
mapped, p = preprocess("mapped", {"path": data, "type": "chat_template",
                                  "message_property_mappings": {"role": "role", "content": "content"}},
                       chat_template_jinja=template_for("reasoning_content"))
want = [reference(r["messages"], template_for("reasoning_content"), None, "turn", "turn", {tok.eos_token_id}) for r in rows]
check(p.returncode == 0 and [(g["input_ids"], g["labels"]) for g in mapped] == want,
      "with message_property_mappings no thinking is passed, as axolotl")
reasoning = len(tok.encode(" two plus two is four", add_special_tokens=False))
check(sum(x != IGNORE for x in mapped[0]["labels"]) + reasoning <= trained_with_thinking,
      "the thinking is trained with its turn (more trained tokens than without it)")

_, p = preprocess("multi", {"path": data, "type": "chat_template"}, ok=False,
                  chat_template_jinja=template_for("reasoning_content") + "two words", eot_tokens=["two words"])
check(p.returncode != 0 and "is 8 tokens of this tokenizer, not one" in p.stderr + p.stdout, "an eot token of several tokens is refused")
_, p = preprocess("conflict", {"path": data, "type": "chat_template", "train_on_eot": "all"}, ok=False,
                  chat_template_jinja=template_for("reasoning_content"), eot_tokens=["<|im_end|>"])
check(p.returncode != 0 and "train_on_eos (turn) and train_on_eot (all) differ" in p.stderr + p.stdout,
      "the eos as an eot token with different rules is refused")

if failures:
    print(f"eot_thinking_ref: {len(failures)} FAILED")
    sys.exit(1)
print("eot_thinking_ref: all checks passed")
