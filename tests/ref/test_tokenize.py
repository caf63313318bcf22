"""Offline test of tools/tokenize_data.py with a tiny word-level tokenizer built here.

Expected ids are written down from the vocabulary by hand, so they do not come from the tool or
from transformers; the assistant mask is checked against the template's own generation block.
Usage: test_tokenize.py TOOL WORKDIR
"""
import contextlib
import io
import json
import os
import runpy
import sys

import numpy as np
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

TOOL, WORK = sys.argv[1], sys.argv[2]
os.makedirs(WORK, exist_ok=True)

VOCAB = {"[UNK]": 0, "<eos>": 1, "<user>": 2, "<assistant>": 3, "hello": 4, "world": 5, "hi": 6, "there": 7,
         "big": 8}
CHAT_WITH_MASK = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<assistant> {% generation %}"
                  "{{ m['content'] }} <eos>{% endgeneration %} {% else %}<user> {{ m['content'] }} "
                  "{% endif %}{% endfor %}")
CHAT_WITHOUT_MASK = CHAT_WITH_MASK.replace("{% generation %}", "").replace("{% endgeneration %}", "")


def make_tokenizer(folder, template):
    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="<eos>")
    fast.add_special_tokens({"additional_special_tokens": ["<user>", "<assistant>"]})
    fast.chat_template = template
    fast.save_pretrained(folder)
    return folder


class Result:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def run(*args, ok=True):
    # In-process (runpy) rather than a subprocess: transformers is imported once, not per call.
    out, err, rc = io.StringIO(), io.StringIO(), 0
    saved_argv, sys.argv = sys.argv, [TOOL, *args]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(TOOL, run_name="__main__")
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
        if isinstance(e.code, str):
            err.write(e.code)
    finally:
        sys.argv = saved_argv
    p = Result(rc, out.getvalue(), err.getvalue())
    assert (p.returncode == 0) == ok, f"tokenize_data.py {args}: rc {p.returncode}\n{p.stdout}\n{p.stderr}"
    return p


def write_jsonl(name, records):
    path = os.path.join(WORK, name)
    with open(path, "w") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


tok_mask = make_tokenizer(os.path.join(WORK, "tok_mask"), CHAT_WITH_MASK)
tok_plain = make_tokenizer(os.path.join(WORK, "tok_plain"), CHAT_WITHOUT_MASK)
assert "--format" in run("--help").stdout

# Text -> JSONL: ids + eos, labels = ids.
text = write_jsonl("text.jsonl", [{"text": "hello world"}, {"text": "hi there big world"}])
out = os.path.join(WORK, "text.tok.jsonl")
run("--tokenizer", tok_mask, "--input", text, "--output", out)
assert read_jsonl(out) == [{"input_ids": [4, 5, 1], "labels": [4, 5, 1]},
                           {"input_ids": [6, 7, 8, 5, 1], "labels": [6, 7, 8, 5, 1]}], read_jsonl(out)

# Text -> bin (uint16 and uint32): documents concatenated, each ending in eos, little-endian.
for dtype, np_dtype in (("uint16", "<u2"), ("uint32", "<u4")):
    out = os.path.join(WORK, f"text.{dtype}.bin")
    p = run("--tokenizer", tok_mask, "--input", text, "--output", out, "--format", "bin", "--dtype", dtype)
    assert "eos_token_id 1" in p.stdout, p.stdout
    assert os.path.getsize(out) == 8 * np.dtype(np_dtype).itemsize
    assert np.fromfile(out, dtype=np_dtype).tolist() == [4, 5, 1, 6, 7, 8, 5, 1]

# Chat with a {% generation %} template: only the assistant's tokens are trained on.
chat = write_jsonl("chat.jsonl", [{"messages": [{"role": "user", "content": "hi there"},
                                                {"role": "assistant", "content": "hello world"}]}])
out = os.path.join(WORK, "chat.tok.jsonl")
run("--tokenizer", tok_mask, "--input", chat, "--output", out)
# "<user> hi there <assistant> hello world <eos>"
assert read_jsonl(out) == [{"input_ids": [2, 6, 7, 3, 4, 5, 1], "labels": [-100, -100, -100, -100, 4, 5, 1]}], \
    read_jsonl(out)

# Chat without generation blocks: every token trained on, with a warning.
p = run("--tokenizer", tok_plain, "--input", chat, "--output", out)
assert "warning" in p.stderr, p.stderr
assert read_jsonl(out) == [{"input_ids": [2, 6, 7, 3, 4, 5, 1], "labels": [2, 6, 7, 3, 4, 5, 1]}]

# Bad input names the line.
bad = write_jsonl("bad.jsonl", [{"text": "hello"}, "{not json", {"other": 1}])
p = run("--tokenizer", tok_mask, "--input", bad, "--output", out, ok=False)
assert f"{bad}:2: not valid JSON" in p.stderr, p.stderr
bad = write_jsonl("bad2.jsonl", [{"other": 1}])
p = run("--tokenizer", tok_mask, "--input", bad, "--output", out, ok=False)
assert f"{bad}:1: expected a 'text' or 'messages' key" in p.stderr, p.stderr
print("tokenize.py: ok")
