#!/usr/bin/env python3
"""Text in and out for `eo-ddp generate`, with the model's own tokenizer (transformers).

    chat_io.py encode --model DIR (--prompt TEXT | --chat FILE) [--raw]
        prints {"ids": [...], "stop": [...]}: the prompt's token ids (through the chat template, as a
        user turn or the messages of FILE, a JSON list of {"role", "content"}, with the generation
        prompt; --raw: the text as it is) and the ids that end a turn (generation_config's and the
        tokenizer's end-of-sequence ids, the template's end-of-turn token when the vocabulary has one).
    chat_io.py decode --model DIR
        reads one token id per line on stdin and writes the text as it grows (flushed per token).
"""
import argparse
import json
import os
import sys

END_OF_TURN = ["<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|return|>", "<|endoftext|>", "</s>"]


def stop_ids(model, tok):
    ids = set()
    path = os.path.join(model, "generation_config.json")
    if os.path.exists(path):
        eos = json.load(open(path)).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tok.eos_token_id is not None:
        ids.add(tok.eos_token_id)
    vocab = tok.get_vocab()
    ids |= {vocab[t] for t in END_OF_TURN if t in vocab}
    return sorted(ids)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["encode", "decode"])
    p.add_argument("--model", required=True)
    p.add_argument("--prompt")
    p.add_argument("--chat")
    p.add_argument("--raw", action="store_true")
    a = p.parse_args()
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(a.model)
    if a.mode == "encode":
        if a.chat:
            messages = json.load(open(a.chat))
        else:
            messages = [{"role": "user", "content": a.prompt}]
        if a.raw or not tok.chat_template:
            text = a.prompt if a.prompt is not None else "".join(m["content"] for m in messages)
            ids = tok(text, add_special_tokens=True).input_ids
        else:
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
        print(json.dumps({"ids": [int(i) for i in ids], "stop": stop_ids(a.model, tok)}))
        return
    ids, shown = [], ""
    for line in sys.stdin:
        if not line.strip():
            continue
        ids.append(int(line))
        text = tok.decode(ids, skip_special_tokens=True)
        if text.startswith(shown) and not text.endswith("\ufffd"):  # a whole character more
            sys.stdout.write(text[len(shown):])
            sys.stdout.flush()
            shown = text
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
