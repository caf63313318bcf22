"""axolotl's named chat templates (issue #31): eo-ddp preprocess with chat_template: chatml, qwen3,
deepseek_v2, deepseek_v3, gemma4, llama4 against axolotl's own jinja rendered here with jinja2 and
axolotl 0.19's labelling rules, on the same rows.

The templates are read from tools/chat_templates (copied unchanged from axolotl 0.19.0; their
sha256 in tools/chat_templates/VERSION is checked here, and against an unpacked axolotl sdist when
AXOLOTL_SDIST names one). Each is rendered by a jinja2 environment set up as transformers sets up
its own (trim_blocks, lstrip_blocks, loop controls, tojson) with the tokenizer's special tokens,
and that text must be what tokenizer.apply_chat_template renders. The tiny tokenizer is given the
template's special tokens (and its family's bos / eos), so turns end in one token as they do on the
real models.

The reference labels follow axolotl 0.19's ChatTemplateStrategy, written here without
tools/prepare_data.py's code: for each turn to locate, the whole conversation is rendered again with
the turn's content replaced by "[[dummy_message]]" and by "zzdummymessagezz" (its thinking
dropped); the characters where either render differs from the real one are the turn; its tokens
are those of the real render's tokenization that overlap them. Trained turns (role assistant) get
their labels; the first eos within 3 tokens after a located turn is labelled as train_on_eos says.
Rows: one turn, several turns (qwen3's template renders a think block on the last turn only), a
system prompt, thinking (reasoning_content), content with surrounding white space
(llama4 and gemma4 trim it).
usage: chat_templates_ref.py EO_DDP SOURCE_DIR WORK_DIR
"""
import hashlib
import json
import os
import shutil
import subprocess
import sys

import jinja2
import jinja2.ext
import jinja2.sandbox
from transformers import AutoTokenizer

EO, SRC, WORK = sys.argv[1], sys.argv[2], sys.argv[3]
shutil.rmtree(WORK, ignore_errors=True)
os.makedirs(WORK)
TEMPLATES = os.path.join(SRC, "tools", "chat_templates")
TINY = os.path.join(SRC, "fixtures", "tiny-qwen3-moe")
IGNORE = -100
failures = []


def check(ok, what):
    print(("ok: " if ok else "FAILED: ") + what, flush=True)
    if not ok:
        failures.append(what)


# ---- the templates are axolotl's -----------------------------------------------------------------
with open(os.path.join(TEMPLATES, "VERSION")) as f:
    recorded = dict(line.split("\t") for line in f.read().splitlines() if line and not line.startswith("#"))
for name, digest in sorted(recorded.items()):
    with open(os.path.join(TEMPLATES, name), "rb") as f:
        check(hashlib.sha256(f.read()).hexdigest() == digest, f"{name}: the sha256 VERSION records for axolotl's file")
sdist = os.environ.get("AXOLOTL_SDIST")
if sdist:
    for name in recorded:
        with open(os.path.join(sdist, "src/axolotl/utils/chat_templates/templates", name), "rb") as a, \
                open(os.path.join(TEMPLATES, name), "rb") as b:
            check(a.read() == b.read(), f"{name}: byte for byte the file of {sdist}")

# template -> (special tokens it writes, plain added tokens, bos, eos): the tokens of the family's
# tokenizer the template relies on.
FAMILIES = {
    "chatml": ([], [], None, "<|im_end|>"),
    "qwen3": ([], ["<think>", "</think>"], None, "<|im_end|>"),
    "deepseek_v2": (["<｜User｜>", "<｜Assistant｜>"], [], "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "deepseek_v3": (["<｜User｜>", "<｜Assistant｜>"], ["<think>", "</think>"], "<｜begin▁of▁sentence｜>",
                    "<｜end▁of▁sentence｜>"),
    "gemma4": (["<|turn>", "<|channel>", "<channel|>", "<|think|>"], [], "<bos>", "<turn|>"),
    "llama4": (["<|header_start|>", "<|header_end|>"], [], "<|begin_of_text|>", "<|eot|>"),
}

ROWS = [
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}],
    [{"role": "user", "content": "what is two and two"}, {"role": "assistant", "content": "four"},
     {"role": "user", "content": "and three"}, {"role": "assistant", "content": "five, with one more"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "name a colour"},
     {"role": "assistant", "content": "blue"}],
    [{"role": "user", "content": "add two and two"},
     {"role": "assistant", "content": "four", "reasoning_content": "two plus two is four"},
     {"role": "user", "content": "and one more"},
     {"role": "assistant", "content": "five", "reasoning_content": "four plus one"}],
    [{"role": "user", "content": "  spaced out \n"}, {"role": "assistant", "content": "\n  so am I  "}],
]
data = os.path.join(WORK, "chat.jsonl")
with open(data, "w") as f:
    for r in ROWS:
        f.write(json.dumps({"messages": r}) + "\n")


def make_tokenizer(name):
    special, plain, bos, eos = FAMILIES[name]
    out = os.path.join(WORK, "model-" + name)
    tok = AutoTokenizer.from_pretrained(TINY)
    extra = [t for t in special + [bos, eos] if t and t not in tok.get_vocab()]
    tok.add_special_tokens({"additional_special_tokens": extra}, replace_extra_special_tokens=False)
    tok.add_tokens([t for t in plain if t not in tok.get_vocab()])
    if bos:
        tok.bos_token = bos
    tok.eos_token = eos
    tok.save_pretrained(out)
    # A config.json whose vocabulary holds the added tokens: preprocess reads no weights.
    with open(os.path.join(TINY, "config.json")) as f:
        cfg = json.load(f)
    cfg["vocab_size"] = max(cfg["vocab_size"], len(tok))
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    return out, AutoTokenizer.from_pretrained(out)


def jinja_env():
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env


def reference(tok, source, messages):
    template = jinja_env().from_string(source)
    tokens = {k: v for k, v in tok.special_tokens_map.items() if isinstance(v, str)}

    def render(msgs):
        return template.render(messages=msgs, add_generation_prompt=False, **tokens)

    text = render(messages)
    assert text == tok.apply_chat_template(messages, chat_template=source, tokenize=False), "jinja2 and transformers differ"
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    labels = [IGNORE] * len(ids)
    eos = tok.eos_token_id
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue  # train_on_eos turn: untrained turns are not located
        lo, hi = len(text), 0
        for placeholder in ("[[dummy_message]]", "zzdummymessagezz"):
            other = render(messages[:i] + [{"role": m["role"], "content": placeholder}] + messages[i + 1:])
            common = os.path.commonprefix([text, other])
            tail = os.path.commonprefix([text[len(common):][::-1], other[len(common):][::-1]])
            lo, hi = min(lo, len(common)), max(hi, len(text) - len(tail))
        assert hi > lo, f"turn {i} not found"
        turn = [t for t, (a, b) in enumerate(offsets) if b > lo and a < hi]
        for t in turn:
            labels[t] = ids[t]
        after = turn[-1] + 1
        at = next((t for t in range(after, min(after + 4, len(ids))) if ids[t] == eos), None)
        if at is not None:
            labels[at] = eos
    return ids, labels


def preprocess(name, model):
    cfg = {"base_model": model, "adapter": "lora", "sequence_len": 1024, "output_dir": os.path.join(WORK, "out"),
           "dataset_prepared_path": os.path.join(WORK, "prepared"), "chat_template": name,
           "datasets": [{"path": data, "type": "chat_template", "field_thinking": "reasoning_content"}]}
    path = os.path.join(WORK, name + ".yaml")
    with open(path, "w") as f:
        json.dump(cfg, f)
    p = subprocess.run([EO, "preprocess", "--config", path], capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        print(p.stdout[-3000:], p.stderr[-3000:])
    files = [line.split(" -> ")[1] for line in p.stdout.splitlines() if " -> " in line]
    if not files:
        return [], p
    with open(files[0]) as f:
        return [json.loads(line) for line in f], p


for name in sorted(FAMILIES):
    model, tok = make_tokenizer(name)
    with open(os.path.join(TEMPLATES, name + ".jinja")) as f:
        source = f.read()
    got, p = preprocess(name, model)
    check(p.returncode == 0 and len(got) == len(ROWS), f"{name}: eo-ddp preprocess with chat_template: {name}")
    want = [reference(tok, source, r) for r in ROWS]
    bad = [k for k, (g, w) in enumerate(zip(got, want)) if (g["input_ids"], g["labels"]) != w]
    check(len(got) == len(want) and not bad, f"{name}: ids and labels equal the reference on {len(want)} rows"
          + (f" (first difference at row {bad[0]})" if bad else ""))
    if bad:
        g, w = got[bad[0]], want[bad[0]]
        print("  eo-ddp   ", [(tok.decode([i]), l != IGNORE) for i, l in zip(g["input_ids"], g["labels"])])
        print("  reference", [(tok.decode([i]), l != IGNORE) for i, l in zip(*w)])
    # Not an empty agreement: the one-turn row trains its answer and its end, and none of the prompt.
    trained = [i for i, l in zip(*want[0]) if l != IGNORE]
    text = tok.decode(trained[:-1])
    check(text.strip() == "hello there" and trained[-1] == tok.eos_token_id,
          f"{name}: the one-turn row trains {text!r} and the eos {tok.eos_token!r}")
    if name == "qwen3":
        # The thinking row: the last turn's reasoning is rendered and trained with it (gemma4
        # renders it only beside tool calls; deepseek_v3 drops it).
        last = tok.decode([i for i, l in zip(*want[3]) if l != IGNORE])
        check("four plus one" in last, f"{name}: the last turn's thinking is trained ({last!r})")

if failures:
    print(f"chat_templates_ref: {len(failures)} FAILED")
    sys.exit(1)
print("chat_templates_ref: all checks passed")
