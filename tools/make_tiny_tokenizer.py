#!/usr/bin/env python3
"""Build the bundled tiny tokenizer and the small chat / alpaca / completion datasets.

    make_tiny_tokenizer.py [--model fixtures/tiny-qwen3-moe] [--data fixtures/tiny-chat]

Writes, deterministically:
  DATA/chat.jsonl        {"messages": [{"role", "content"}, ...]}  (some with a system turn)
  DATA/sharegpt.jsonl    the same conversations as {"conversations": [{"from", "value"}, ...]}
  DATA/alpaca.jsonl      {"instruction", "input", "output"}
  DATA/completion.jsonl  {"text"}
  MODEL/tokenizer.json, MODEL/tokenizer_config.json   a BPE trained with `tokenizers` on those
      texts, sized to the tiny model's vocab_size (256), with a ChatML chat template whose
      default system turn is added when a conversation has none (like Qwen's), so that
      `chat_template: tokenizer_default` and `chat_template: chatml` give different tokens.
Special tokens take the ids the tiny model's config.json names: 0 <|endoftext|> (pad),
1 <|im_start|> (bos_token_id), 2 <|im_end|> (eos_token_id); 3 is <unk>.
"""
import argparse
import json
import os
import random
import sys

sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

NAMES = ["the cat", "a dog", "my friend", "the river", "a small bird", "the old tree", "our team", "the red car"]
VERBS = ["runs", "sleeps", "sings", "grows", "waits", "jumps", "shines", "moves"]
PLACES = ["in the park", "by the sea", "at home", "under the moon", "on the hill", "near the road"]
QUESTIONS = ["What does {n} do?", "Where is {n}?", "Tell me about {n}.", "Why is {n} happy?"]
ANSWERS = ["{N} {v} {p}.", "I think {n} {v} {p}, every day.", "{N} is {p}; it {v} slowly.", "Yes! {N} {v}."]
SYSTEMS = ["You answer in one short sentence.", "Be kind and brief."]
TASKS = ["Write a sentence about {n}.", "Describe where {n} is.", "Say what {n} does.", "Give one fact."]


def sentence(rng, pattern):
    n = rng.choice(NAMES)
    return pattern.format(n=n, N=n[0].upper() + n[1:], v=rng.choice(VERBS), p=rng.choice(PLACES))


def make_rows(rng):
    chats, alpaca, completion = [], [], []
    for i in range(48):
        messages = [{"role": "system", "content": rng.choice(SYSTEMS)}] if i % 3 == 0 else []
        for _ in range(1 + i % 3):  # one to three exchanges
            messages.append({"role": "user", "content": sentence(rng, rng.choice(QUESTIONS))})
            messages.append({"role": "assistant", "content": sentence(rng, rng.choice(ANSWERS))})
        chats.append({"messages": messages})
        row = {"instruction": sentence(rng, rng.choice(TASKS)),
               "input": sentence(rng, "{N} {v} {p}.") if i % 2 else "",
               "output": " ".join(sentence(rng, rng.choice(ANSWERS)) for _ in range(1 + i % 2))}
        alpaca.append(row)
        completion.append({"text": " ".join(sentence(rng, rng.choice(ANSWERS)) for _ in range(2 + i % 4))})
    return chats, alpaca, completion


ALPACA_WORDS = ("Below is an instruction that describes a task, paired with an input that provides further context. "
                "Write a response that appropriately completes the request.\n\n### Instruction:\n\n### Input:\n"
                "### Response:\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="fixtures/tiny-qwen3-moe", help="model folder to write the tokenizer into")
    ap.add_argument("--data", default="fixtures/tiny-chat", help="folder for the JSONL datasets")
    args = ap.parse_args()
    with open(os.path.join(args.model, "config.json")) as f:
        vocab_size = json.load(f)["vocab_size"]

    chats, alpaca, completion = make_rows(random.Random(16))
    os.makedirs(args.data, exist_ok=True)

    def write(name, rows):
        with open(os.path.join(args.data, name), "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")

    write("chat.jsonl", chats)
    write("sharegpt.jsonl", [{"conversations": [{"from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]),
                                                 "value": m["content"]} for m in c["messages"]]} for c in chats])
    write("alpaca.jsonl", alpaca)
    write("completion.jsonl", completion)

    texts = [ALPACA_WORDS, "You are a helpful assistant. system user assistant"]
    texts += [m["content"] for c in chats for m in c["messages"]]
    texts += [r[k] for r in alpaca for k in ("instruction", "input", "output")]
    texts += [r["text"] for r in completion]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False)
    tok.train_from_iterator(texts, trainer)
    assert tok.get_vocab_size() <= vocab_size, tok.get_vocab_size()
    for i, s in enumerate(SPECIALS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    tok.save(os.path.join(args.model, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "unk_token": "<unk>", "model_max_length": 512,
              "add_bos_token": False, "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE}
    with open(os.path.join(args.model, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    print(f"wrote {args.model}/tokenizer.json ({tok.get_vocab_size()} tokens), tokenizer_config.json; "
          f"{args.data}/chat.jsonl, sharegpt.jsonl, alpaca.jsonl, completion.jsonl")


if __name__ == "__main__":
    main()
