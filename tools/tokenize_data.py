#!/usr/bin/env python3
"""Tokenize text or chat JSONL for eo-ddp with a Hugging Face tokenizer.

Input: JSONL, one document per line, either
  {"text": "..."}                                       plain text
  {"messages": [{"role": "user", "content": "..."}, ...]}   chat, rendered with the tokenizer's
                                                          chat template (apply_chat_template)

Output (--format):
  jsonl  tokenized JSONL, one line per document: {"input_ids": [...], "labels": [...]}
         (dataset type "tokenized"). Text: labels = input_ids. Chat: labels are -100 on every
         token outside the assistant turns when the chat template marks them with
         {% generation %} ... {% endgeneration %} (return_assistant_tokens_mask); otherwise all
         tokens are trained on and a warning says so.
  bin    a flat little-endian uint16/uint32 array of token ids (dataset type "tokens", --dtype),
         every document followed by the eos token, so eo-ddp can split documents at
         eos_token_id (printed at the end: put it in the dataset's `eos_token_id`). Labels are
         not stored: every token is trained on. Note that a chat template which itself emits the
         eos token (e.g. at each turn end) makes each such turn a separate document.

Text documents get the eos token appended (both formats) so the model learns to stop, unless
--no-eos; bin output always needs it. Examples:

  tokenize_data.py --tokenizer Qwen/Qwen3-30B-A3B --input chat.jsonl --output chat.tok.jsonl
  tokenize_data.py --tokenizer ./model --input corpus.jsonl --output corpus.bin --format bin --dtype uint32
"""
import os
import sys

# tools/ is not a package: keep our own folder off the import path, so no tool can shadow a
# standard module that transformers imports.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402

IGNORE_INDEX = -100
DTYPE_MAX = {"uint16": 0xFFFF, "uint32": 0xFFFFFFFF}


def fail(message):
    sys.exit(f"tokenize_data.py: error: {message}")


def has_generation_blocks(template):
    return template is not None and re.search(r"\{%-?\s*generation\s*-?%\}", template) is not None


def encode_chat(tokenizer, messages, use_mask):
    enc = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=use_mask)
    ids = list(enc["input_ids"])
    if not use_mask:
        return ids, list(ids)
    mask = enc["assistant_masks"]
    return ids, [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", required=True, help="tokenizer folder or Hugging Face model name")
    ap.add_argument("--input", required=True, help="text or chat JSONL file")
    ap.add_argument("--output", required=True, help="output file (.jsonl or .bin)")
    ap.add_argument("--format", choices=["jsonl", "bin"], default="jsonl", help="output format (default jsonl)")
    ap.add_argument("--dtype", choices=["uint16", "uint32"], default="uint32",
                    help="token dtype of --format bin (default uint32; uint16 needs ids < 65536)")
    ap.add_argument("--no-eos", action="store_true", help="do not append eos to text documents (jsonl only)")
    ap.add_argument("--trust-remote-code", action="store_true", help="allow tokenizer code from the hub")
    args = ap.parse_args()
    if args.format == "bin" and args.no_eos:
        fail("--no-eos cannot be used with --format bin: documents are delimited by eos")

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, trust_remote_code=args.trust_remote_code)
    eos = tokenizer.eos_token_id
    if eos is None and (args.format == "bin" or not args.no_eos):
        fail(f"tokenizer {args.tokenizer} has no eos_token; use --format jsonl --no-eos")
    use_mask = has_generation_blocks(getattr(tokenizer, "chat_template", None))
    warned_no_mask = False

    docs = tokens = trained = 0
    out = open(args.output, "wb" if args.format == "bin" else "w", encoding=None if args.format == "bin" else "utf-8")
    import numpy as np

    with open(args.input, encoding="utf-8") as f, out:
        for line_no, line in enumerate(f, 1):
            where = f"{args.input}:{line_no}"
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                fail(f"{where}: not valid JSON ({e})")
            if not isinstance(record, dict):
                fail(f"{where}: expected a JSON object with 'text' or 'messages'")
            if "messages" in record:
                messages = record["messages"]
                if not isinstance(messages, list) or not all(
                        isinstance(m, dict) and "role" in m and "content" in m for m in messages):
                    fail(f"{where}: 'messages' must be a list of {{role, content}} objects")
                if not use_mask and args.format == "jsonl" and not warned_no_mask:
                    print("tokenize_data.py: warning: the chat template has no {% generation %} blocks, so "
                          "assistant tokens cannot be told apart; training on all tokens", file=sys.stderr)
                    warned_no_mask = True
                ids, labels = encode_chat(tokenizer, messages, use_mask and args.format == "jsonl")
                if args.format == "bin" and (not ids or ids[-1] != eos):
                    ids.append(eos)
            elif "text" in record:
                if not isinstance(record["text"], str):
                    fail(f"{where}: 'text' must be a string")
                ids = list(tokenizer(record["text"])["input_ids"])
                if not args.no_eos and (not ids or ids[-1] != eos):
                    ids.append(eos)
                labels = list(ids)
            else:
                fail(f"{where}: expected a 'text' or 'messages' key, found {sorted(record)}")
            if not ids:
                continue
            if args.format == "bin":
                if max(ids) > DTYPE_MAX[args.dtype]:
                    fail(f"{where}: token id {max(ids)} does not fit {args.dtype}; use --dtype uint32")
                np.asarray(ids, dtype="<u2" if args.dtype == "uint16" else "<u4").tofile(out)
                trained += len(ids)
            else:
                out.write(json.dumps({"input_ids": ids, "labels": labels}) + "\n")
                trained += sum(1 for t in labels if t != IGNORE_INDEX)
            docs += 1
            tokens += len(ids)
    if docs == 0:
        os.remove(args.output)
        fail(f"{args.input} holds no documents")
    print(f"wrote {args.output}: {docs} documents, {tokens} tokens ({trained} trained on)"
          + (f"; dataset: type tokens, dtype {args.dtype}, eos_token_id {eos}" if args.format == "bin" else ""))


if __name__ == "__main__":
    main()
