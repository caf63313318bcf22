#!/usr/bin/env python3
"""Tokenize axolotl-style datasets for eo-ddp: chat_template, alpaca, completion, input_output.

eo-ddp runs this (rank 0, when its dataset_prepared_path cache is missing or stale; or
`eo-ddp preprocess --config F`); it is not meant to be called by hand. Input: a JSON spec
written by eo-ddp,

  {"tokenizer": DIR, "tokenizer_type": null|"AutoTokenizer"|..., "trust_remote_code": false,
   "special_tokens": {"pad_token": ...}, "train_on_inputs": false, "chat_template": NAME,
   "chat_template_jinja": null|TEXT,
   "dataset_defaults": {KEY: VALUE, ...},
   "datasets": [{"path": F, "files": [F, ...], "type": T, "output": OUT.jsonl, "shards": N, "shards_idx": I,
                 "seed": S, ...per-type keys...}, ...]}

A dataset key left out of an entry takes its value from dataset_defaults, which eo-ddp writes from
its table of dataset keys (`eo-ddp --help-config`, runtime/config_datasets.cpp): this tool keeps no
default of its own.

Rows are read from `files` in order (a Hub dataset's data files; else path): JSON lines, a JSON
array, or parquet (through pyarrow); then the split's slice, then axolotl's shards.

Output: one tokenized JSONL per dataset, {"input_ids": [...], "labels": [...]}, labels -100 where
axolotl masks. The rules follow axolotl's prompt strategies:

  chat_template  the conversation rendered by tokenizer.apply_chat_template (the tokenizer's own
                 template, one of axolotl's named templates shipped in chat_templates/ -- chatml,
                 qwen3, ... -- or chat_template_jinja). Each turn's content tokens are found as
                 axolotl 0.19's find_turn does: the whole conversation rendered to text again with
                 the turn's content replaced by each of two placeholders, the characters where
                 the renders differ, and the tokens over them (the offsets of the full render's
                 tokenization); where that tokenization is not the rendered ids, the older token
                 diff of the conversation up to the turn. A turn is trained when train_on_inputs is true, its role (after the
                 `roles` mapping: human -> user, gpt -> assistant, ...) is in roles_to_train, or
                 its message_field_training flag says so. EOS: the first eos token at or after the
                 turn's end, if within 3 tokens, is trained for train_on_eos: all (every turn),
                 turn (trained turns), last (the last such eos only); none trains no eos.
  alpaca         axolotl's instruct prompt ("Below is an instruction ... ### Response:\\n"),
                 tokenized with the tokenizer's special tokens; the response tokenized alone
                 (bos stripped, eos appended). Prompt tokens are -100 unless train_on_inputs.
  completion     the `field` text tokenized, eos appended, every token trained.
  input_output   `segments: [{"text", "label"}]`, each tokenized without special tokens;
                 segments with label false are -100 unless train_on_inputs.

Rows longer than sequence_len are dealt with by eo-ddp, not here (the cache does not depend on
sequence_len). Progress goes to stderr every few seconds. Exit 2 with `file:line: message` for
data that does not fit its type (JSON nested too deeply, a chat template that fails on a row, a tokenizer that
needs trust_remote_code included); exit 1 with `prepare_data.py: failed: what` when the tool itself cannot go on
(out of memory, a tokenizer that does not load, anything unexpected).
"""
import os
import sys

# tools/ is not a package; keep our own folder off the import path (it must not shadow stdlib).
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

import bisect  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402

import jinja2  # noqa: E402  (transformers renders chat templates with it)

IGNORE = -100
# axolotl's two placeholders: their first and last characters differ, so a template that glues an
# edge character onto one cannot hide it from both diffs.
SENTINELS = ("[[dummy_message]]", "zzdummymessagezz")
# axolotl's named templates that eo-ddp ships, copied unchanged from axolotl's
# src/axolotl/utils/chat_templates/templates/ (tools/axolotl_corpus.py templates; the version in
# chat_templates/VERSION). eo-ddp's config check lists the same names (named_templates).
TEMPLATE_DIR = os.path.join(_HERE, "chat_templates")


def setting(spec, ds, key):
    """A dataset entry's key, or its default from eo-ddp's table (spec["dataset_defaults"])."""
    value = ds.get(key)
    if value is not None and value != "":
        return value
    defaults = spec.get("dataset_defaults")
    if defaults is None:
        raise ToolError("the spec has no dataset_defaults (eo-ddp writes them); run this tool through eo-ddp")
    return defaults.get(key)


def named_template(name):
    path = os.path.join(TEMPLATE_DIR, name + ".jinja")
    if not os.path.isfile(path):
        raise DataError(f"chat_template {name!r}: eo-ddp ships no {path}")
    with open(path, encoding="utf-8") as f:
        return f.read()
DEFAULT_ROLES = {"human": "user", "user": "user", "assistant": "assistant", "gpt": "assistant",
                 "system": "system", "tool": "tool"}
ALPACA_INPUT = ("Below is an instruction that describes a task, paired with an input that provides further context. "
                "Write a response that appropriately completes the request.\n\n"
                "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
ALPACA_NO_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately completes the "
                   "request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")


class DataError(Exception):
    pass


class ToolError(Exception):
    """The tool cannot go on (not the data's fault): exit 1, naming what failed."""


def load_tokenizer(spec):
    import transformers
    cls = getattr(transformers, spec.get("tokenizer_type") or "AutoTokenizer", None)
    if cls is None:
        raise DataError(f"tokenizer_type {spec['tokenizer_type']!r} is not a transformers class")
    try:
        tok = cls.from_pretrained(spec["tokenizer"], trust_remote_code=bool(spec.get("trust_remote_code")))
    except (MemoryError, KeyboardInterrupt):
        raise
    except Exception as e:
        if "trust_remote_code" in str(e):
            raise DataError(f"the tokenizer of {spec['tokenizer']} runs code from its folder, which needs "
                            "trust_remote_code: true in the config (set it only if you trust that code)")
        raise ToolError(f"loading the tokenizer of {spec['tokenizer']} failed: {type(e).__name__}: {e}")
    vocab = tok.get_vocab()
    for name, value in (spec.get("special_tokens") or {}).items():
        # A token the vocabulary lacks would need new embedding rows, which eo-ddp does not train.
        if value not in vocab:
            raise DataError(f"special_tokens.{name}: {value!r} is not in the tokenizer's vocabulary; eo-ddp cannot "
                            "add tokens (the embeddings are frozen); use a token the tokenizer has")
        setattr(tok, name, value)
    return tok


def chat_ids(tok, template, messages, **kwargs):
    enc = tok.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True, **kwargs)
    return list(enc["input_ids"])


class ChatTemplate:
    def __init__(self, tok, spec, ds):
        self.tok = tok
        name = ds.get("chat_template") or spec["chat_template"]  # the top-level key, with its default
        jinja = ds.get("chat_template_jinja") or spec.get("chat_template_jinja")
        own = getattr(tok, "chat_template", None)
        if name == "tokenizer_default":
            if not own:
                raise DataError(f"chat_template: tokenizer_default, but the tokenizer in {spec['tokenizer']} has no chat "
                                "template; set chat_template: chatml (or jinja with chat_template_jinja)")
            self.template = own
        elif name == "tokenizer_default_fallback_chatml":
            self.template = own or named_template("chatml")
        elif name == "jinja":
            if not jinja:
                raise DataError("chat_template: jinja needs chat_template_jinja (the template text)")
            self.template = jinja
        else:
            self.template = named_template(name)
        self.field_messages = setting(spec, ds, "field_messages")
        self.field_role = setting(spec, ds, "message_field_role")
        self.field_content = setting(spec, ds, "message_field_content")
        self.field_training = ds.get("message_field_training")
        self.drop_system = bool(setting(spec, ds, "drop_system_message"))
        roles = ds.get("roles")
        self.roles = {s: t for t, sources in roles.items() for s in sources} if roles else dict(DEFAULT_ROLES)
        self.roles_to_train = [self.roles.get(r, r) for r in setting(spec, ds, "roles_to_train")]
        self.train_on_eos = setting(spec, ds, "train_on_eos")
        self.train_on_inputs = bool(spec.get("train_on_inputs"))
        # axolotl: the data's field_thinking goes into each message as template_thinking_key (set
        # by eo-ddp only when the message fields are not mapped, as axolotl maps it only then).
        self.field_thinking = ds.get("field_thinking")
        self.thinking_key = ds.get("template_thinking_key")
        # axolotl's end-of-turn tokens: eot_tokens (default the eos token), each one token, kept
        # only where the template writes it; labelled as train_on_eot says (default train_on_eos).
        self.train_on_eot = ds.get("train_on_eot") or self.train_on_eos
        eot = spec.get("eot_tokens")
        self.eot_ids = {tok.eos_token_id}
        if eot:
            kept = []
            for t in eot:
                if t not in self.template:
                    print(f"prepare: eot_tokens: {t!r} is not in the chat template; dropped (as axolotl)", file=sys.stderr)
                    continue
                ids = tok.encode(t, add_special_tokens=False)
                if len(ids) != 1:
                    raise DataError(f"eot_tokens: {t!r} is {len(ids)} tokens of this tokenizer, not one; eo-ddp adds no "
                                    "tokens, so name a token the tokenizer has")
                kept.append(t)
            self.eot_ids = {tok.encode(t, add_special_tokens=False)[0] for t in kept}
            if tok.eos_token in kept and self.train_on_eos != self.train_on_eot:
                raise DataError(f"eot_tokens holds the eos token {tok.eos_token!r}, but train_on_eos ({self.train_on_eos}) "
                                f"and train_on_eot ({self.train_on_eot}) differ; make them equal (axolotl refuses this too)")

    def turns(self, row):
        messages = row.get(self.field_messages)
        if not isinstance(messages, list) or not messages:
            raise DataError(f"'{self.field_messages}' must be a non-empty list of messages (field_messages)")
        out = []
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get(self.field_role), str) or not isinstance(
                    m.get(self.field_content), str):
                raise DataError(f"each message needs a string '{self.field_role}' and '{self.field_content}' "
                                "(message_field_role / message_field_content)")
            role = self.roles.get(m[self.field_role], m[self.field_role])
            thinking = m.get(self.field_thinking) if self.field_thinking else None
            out.append({"role": role, "content": m[self.field_content], "thinking": thinking,
                        "training": m.get(self.field_training) if self.field_training else None})
        if self.drop_system and out[0]["role"] == "system":
            out = out[1:]
        return out

    def messages(self, turns):
        def message(t):
            m = {"role": t["role"], "content": t["content"]}
            if t.get("thinking") is not None:
                m[self.thinking_key] = t["thinking"]
            return m
        return [message(t) for t in turns]

    def render(self, turns, **kwargs):
        return chat_ids(self.tok, self.template, self.messages(turns), **kwargs)

    def render_text(self, turns):
        return self.tok.apply_chat_template(self.messages(turns), chat_template=self.template, tokenize=False)

    def locator(self, turns, ids):
        """The full render as text and its tokens' character offsets, or None where that text does
        not tokenize back to IDS (then turns are found by the token diff)."""
        if not getattr(self.tok, "is_fast", False):
            return None
        text = self.render_text(turns)
        if not isinstance(text, str) or not text:
            return None
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        if list(enc["input_ids"]) != list(ids):
            return None
        return text, [a for a, _ in enc["offset_mapping"]], [b for _, b in enc["offset_mapping"]]

    def span_from_text(self, turns, i, locator):
        """Turn i's token span from the characters where the whole conversation, rendered with the
        turn's content replaced by each placeholder (its thinking dropped, so thinking is in the
        span), differs from the real render; None to fall back to the token diff."""
        full, starts, ends = locator
        lo, hi = len(full), 0
        for sentinel in SENTINELS:
            dummy = self.render_text(turns[:i] + [{"role": turns[i]["role"], "content": sentinel}] + turns[i + 1:])
            if not isinstance(dummy, str) or not dummy:
                return None
            limit = min(len(full), len(dummy))
            a = 0
            while a < limit and full[a] == dummy[a]:
                a += 1
            b = 0  # the common suffix, bounded by the prefix so the two cannot overlap
            while b < limit - a and full[-1 - b] == dummy[-1 - b]:
                b += 1
            lo, hi = min(lo, a), max(hi, len(full) - b)
        if hi <= lo:
            return -1, -1
        # A character split over tokens that share an offset: the end bisects the starts.
        start, end = bisect.bisect_right(ends, lo), bisect.bisect_left(starts, hi)
        if start >= len(ends) or end > len(ends):
            return None
        return start, end

    def span_from_tokens(self, turns, i):
        """The token diff of the conversation up to turn i with and without a placeholder for its
        content (real_last_index: the templates that treat the last turn apart see the real one)."""
        kwargs = {"real_last_index": len(turns) - 1} if len(turns) > 1 else {}
        dummy = self.render(turns[:i] + [{"role": turns[i]["role"], "content": SENTINELS[0]}], **kwargs)
        full = self.render(turns[:i + 1], **kwargs)
        if not dummy or not full:
            return None
        n = min(len(dummy), len(full))
        start = next((k for k in range(n) if dummy[k] != full[k]), None)
        end = next((len(full) - k for k in range(n) if dummy[len(dummy) - 1 - k] != full[len(full) - 1 - k]), None)
        if start is None or end is None:
            return None
        return start, end

    def find_turn(self, turns, i, locator):
        """Token span [start, end) of turn i's content, or (-1, -1) (axolotl's find_turn)."""
        name = (self.tok.name_or_path or "").lower()
        if i == 0 and turns[0]["role"] == "system" and "mistral" in name:
            return -1, -1
        span = self.span_from_text(turns, i, locator) if locator is not None else None
        if span is None:
            span = self.span_from_tokens(turns, i)
        if span is None or span[0] == -1 or span[1] <= span[0]:
            return -1, -1
        return span

    def __call__(self, row):
        turns = self.turns(row)
        ids = self.render(turns)
        labels = [IGNORE] * len(ids)
        locator = self.locator(turns, ids)
        # The turn's span (with its thinking: the dummy turn has none) is trained; then the first
        # end-of-turn token and the first eos within 3 tokens after it, as train_on_eot / _eos say.
        ends = [(self.eot_ids, self.train_on_eot), ({self.tok.eos_token_id}, self.train_on_eos)]
        last = [-1, -1]
        for i, turn in enumerate(turns):
            train = turn["training"] if turn["training"] is not None else (
                self.train_on_inputs or turn["role"] in self.roles_to_train)
            if not train and self.train_on_eos != "all" and self.train_on_eot != "all":
                continue  # axolotl does not locate untrained turns (nor their eos for "last")
            start, end = self.find_turn(turns, i, locator)
            if start == -1:
                continue
            if train:
                labels[start:end] = ids[start:end]
            for j, (which, option) in enumerate(ends):
                at = next((k for k in range(end, len(ids)) if ids[k] in which), -1)
                if at != -1 and at - end <= 3:  # the template may put a few tokens before it
                    last[j] = at
                    if option == "all" or (option == "turn" and train):
                        labels[at] = ids[at]
        for j, (_, option) in enumerate(ends):
            if option == "last" and last[j] != -1:
                labels[last[j]] = ids[last[j]]
        return ids, labels


def text_field(row, key, required=True):
    v = row.get(key, "" if not required else None)
    if not isinstance(v, str):
        raise DataError(f"'{key}' must be a string")
    return v


class Alpaca:
    def __init__(self, tok, spec, ds):
        self.tok, self.train_on_inputs = tok, bool(spec.get("train_on_inputs"))

    def __call__(self, row):
        instruction, inp, output = text_field(row, "instruction"), text_field(row, "input", False), text_field(row, "output")
        prompt = (ALPACA_INPUT.format(instruction=instruction, input=inp) if inp
                  else ALPACA_NO_INPUT.format(instruction=instruction))
        p = list(self.tok(prompt)["input_ids"])
        r = list(self.tok(output)["input_ids"])
        if r and r[0] == self.tok.bos_token_id:
            r = r[1:]
        if not r or r[-1] != self.tok.eos_token_id:
            r.append(self.tok.eos_token_id)
        return p + r, (list(p) if self.train_on_inputs else [IGNORE] * len(p)) + r


class Completion:
    def __init__(self, tok, spec, ds):
        self.tok, self.field = tok, setting(spec, ds, "field")

    def __call__(self, row):
        ids = list(self.tok(text_field(row, self.field))["input_ids"])
        if ids and ids[-1] != self.tok.eos_token_id:
            ids.append(self.tok.eos_token_id)
        return ids, list(ids)


class InputOutput:
    def __init__(self, tok, spec, ds):
        self.tok, self.train_on_inputs = tok, bool(spec.get("train_on_inputs"))

    def __call__(self, row):
        segments = row.get("segments")
        if not isinstance(segments, list):
            raise DataError("'segments' must be a list of {\"text\", \"label\"}")
        ids, labels = [], []
        for s in segments:
            if not isinstance(s, dict) or not isinstance(s.get("text"), str) or not isinstance(s.get("label"), bool):
                raise DataError("each segment needs a string 'text' and a boolean 'label'")
            t = list(self.tok(s["text"], add_special_tokens=False)["input_ids"])
            ids += t
            labels += t if (s["label"] or self.train_on_inputs) else [IGNORE] * len(t)
        return ids, labels


FORMATS = {"chat_template": ChatTemplate, "alpaca": Alpaca, "completion": Completion, "input_output": InputOutput}


def parquet_rows(path):
    """(row count, iterator of (row number, JSON text)) of a parquet file, through pyarrow."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading parquet needs pyarrow in this Python (pip install pyarrow)")
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow's own errors name the problem
        raise DataError(f"{path}: not a readable parquet file ({e})")
    rows = table.to_pylist()
    return len(rows), ((i + 1, json.dumps(r, ensure_ascii=False, default=str)) for i, r in enumerate(rows))


def rows_of(path):
    """(row count, iterator of (line number, JSON text)): JSON lines, streamed, one JSON array
    (axolotl reads both), or a parquet file's rows."""
    if path.endswith(".parquet"):
        return parquet_rows(path)
    if path.endswith((".arrow", ".csv")):
        raise DataError(f"{path}: eo-ddp reads JSON lines, a JSON array or parquet; convert it, e.g. "
                        "datasets.load_dataset(...).to_json('data.jsonl')")
    with open(path, encoding="utf-8", errors="replace") as f:
        is_array = f.read(4096).lstrip().startswith("[")
    if is_array:
        with open(path, encoding="utf-8") as f:
            try:
                rows = json.load(f)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: not valid JSON ({e})")
            except RecursionError:
                raise DataError(f"{path}: JSON nested too deeply to read (thousands of levels); not a dataset")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}: not valid UTF-8 (byte {e.start}: {e.reason})")
            if not isinstance(rows, list):
                raise DataError(f"{path}: expected JSON lines or a JSON array of rows")
            return len(rows), ((i + 1, json.dumps(r)) for i, r in enumerate(rows))
    with open(path, "rb") as f:
        total = sum(1 for line in f if line.strip())

    def lines():
        with open(path, "rb") as f:
            for n, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(f"{path}:{n}: not valid UTF-8 (byte {e.start} of the line: {e.reason})")
                if line.strip():
                    yield n, line
    return total, lines()


# Hugging Face datasets' split syntax, one split (a local file is all "train"): train, train[10:50],
# train[:20%], train[-10%:]. As datasets' ReadInstruction: a % on either side makes both
# percentages, rounded to the closest row (Python's round), negatives count from the end.
SPLIT_RE = re.compile(r"^train(\[((?P<from>-?\d+)(?P<from_pct>%)?)?:((?P<to>-?\d+)(?P<to_pct>%)?)?\])?$")


def split_bounds(split, n):
    if not split:
        return 0, n
    m = SPLIT_RE.match(split)
    if not m:
        raise DataError(f"split '{split}' is not train or a slice of it such as train[:20%] or train[10:50]")
    pct = bool(m.group("from_pct") or m.group("to_pct"))
    lo = int(m.group("from")) if m.group("from") is not None else None
    hi = int(m.group("to")) if m.group("to") is not None else None
    if pct:
        lo = 0 if lo is None else int(round(lo * n / 100.0))
        hi = n if hi is None else int(round(hi * n / 100.0))
    else:
        lo = 0 if lo is None else lo
        hi = n if hi is None else hi
    if lo < 0:
        lo = max(n + lo, 0)
    if hi < 0:
        hi = max(n + hi, 0)
    return min(lo, n), min(hi, n)


def rows_of_files(files):
    """(row count, iterator of (where, JSON text)) over a dataset's files in order (a Hub dataset's
    shards, as datasets concatenates them)."""
    parts = [(f, rows_of(f)) for f in files]

    def rows():
        for f, (_, it) in parts:
            for n, line in it:
                yield f"{f}:{n}", line
    return sum(n for _, (n, _) in parts), rows()


def shard_rows(rows, total, shards, index, seed):
    """axolotl's shards: datasets' Dataset.shuffle(seed) (numpy's default_rng(seed).permutation)
    then .shard(shards, index) (contiguous: the index-th of `shards` nearly equal runs)."""
    import numpy as np
    order = np.random.default_rng(seed).permutation(total)
    div, mod = divmod(total, shards)
    start = div * index + min(index, mod)
    picked = order[start:start + div + (1 if index < mod else 0)]
    rows = list(rows)
    return len(picked), (rows[int(i)] for i in picked)


def prepare(tok, spec, ds):
    fmt = FORMATS[ds["type"]](tok, spec, ds)
    path = ds["path"]
    total, rows = rows_of_files(ds["files"])
    lo, hi = split_bounds(setting(spec, ds, "split"), total)
    if (lo, hi) != (0, total):
        rows = (r for i, r in enumerate(rows) if lo <= i < hi)
        total = max(hi - lo, 0)
    if ds.get("shards"):
        total, rows = shard_rows(rows, total, int(ds["shards"]), int(setting(spec, ds, "shards_idx")), int(ds["seed"]))
    done = kept = tokens = trained = 0
    t0 = last = time.monotonic()
    with open(ds["output"], "w", encoding="utf-8") as out:
        for where, line in rows:
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e})")
            except RecursionError:
                raise DataError(f"{where}: JSON nested too deeply to read (thousands of levels); not a dataset row")
            if not isinstance(row, dict):
                raise DataError(f"{where}: expected a JSON object per line")
            try:  # a \ud800 escape decodes to a lone surrogate, which no tokenizer can take
                json.dumps(row, ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError as e:
                raise DataError(f"{where}: text that is not valid Unicode ({e.reason}: a lone surrogate escape?)")
            try:
                ids, labels = fmt(row)
            except DataError as e:
                raise DataError(f"{where}: {e} (dataset type {ds['type']})")
            except jinja2.TemplateError as e:  # the chat template raised, or used an undefined name
                raise DataError(f"{where}: the chat template failed on this row: {type(e).__name__}: {e}")
            except RecursionError:
                raise DataError(f"{where}: the row is nested too deeply to format")
            except TypeError as e:
                # jinja2's sandbox without a loader: {% include %}, {% import %}, {% extends %}
                if "loader" in str(e):
                    raise DataError(f"{where}: the chat template uses {{% include %}}, {{% import %}} or "
                                    f"{{% extends %}}, which load other files; a chat template must be one text")
                raise
            done += 1
            if ids:
                out.write(json.dumps({"input_ids": ids, "labels": labels}) + "\n")
                kept += 1
                tokens += len(ids)
                trained += sum(1 for x in labels if x != IGNORE)
            now = time.monotonic()
            if now - last >= 5:
                last = now
                print(f"prepare: {path}: {done}/{total} rows ({done / (now - t0):.0f} rows/s)", file=sys.stderr, flush=True)
    if kept == 0:
        raise DataError(f"{path}: no rows (the file is empty or every row tokenized to nothing)")
    return {"path": path, "type": ds["type"], "rows": kept, "tokens": tokens, "trained_tokens": trained,
            "seconds": round(time.monotonic() - t0, 3)}


def main():
    if len(sys.argv) != 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if len(sys.argv) == 2 else 2)
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    try:
        tok = load_tokenizer(spec)
        if tok.eos_token_id is None:
            raise DataError(f"the tokenizer in {spec['tokenizer']} has no eos_token; set special_tokens.eos_token")
        stats = [prepare(tok, spec, ds) for ds in spec["datasets"]]
    except DataError as e:
        print(f"prepare_data.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    except MemoryError:
        print("prepare_data.py: failed: out of memory while tokenising (MemoryError); free memory or split "
              "the dataset", file=sys.stderr)
        sys.exit(1)
    except ToolError as e:
        print(f"prepare_data.py: failed: {e}", file=sys.stderr)
        sys.exit(1)
    for s in stats:
        print(f"prepare: {s['path']} ({s['type']}): {s['rows']} rows, {s['tokens']} tokens, "
              f"{s['trained_tokens']} trained on ({s['seconds']} s)", file=sys.stderr)
    print(json.dumps({"datasets": stats}))


if __name__ == "__main__":
    main()
