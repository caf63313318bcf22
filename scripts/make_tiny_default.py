#!/usr/bin/env python3
"""Make the bundled tiny default: a Qwen3-MoE-architecture checkpoint and a tokenized dataset.

    .venv/bin/python scripts/make_tiny_default.py [--out fixtures]

Writes fixtures/tiny-qwen3-moe/ (config.json + model.safetensors, saved by transformers, so
transformers loads it) and fixtures/tiny-data/train.jsonl. Deterministic; the outputs are
committed so a fresh clone trains without network or Python.

The data is learnable in a minute on a CPU: documents are random concatenations of 8 fixed
"phrases" of 5 tokens each, so within a phrase the next token is determined by the current one:
the loss falls from ~ln(256) = 5.5 towards ln(8)/5 = 0.4 as the adapter learns them.
"""
import argparse
import json
import os
import random
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def make_model(out_dir: str) -> None:
    import torch
    import transformers

    torch.manual_seed(1234)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, max_position_embeddings=512,
        rope_theta=10000.0, tie_word_embeddings=False, router_aux_loss_coef=0.001, rms_norm_eps=1e-6,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
        # Larger than HF's 0.02 so logits can move far enough for the loss to fall visibly.
        initializer_range=0.15)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    model.save_pretrained(out_dir, safe_serialization=True)


def make_data(path: str, n_docs: int = 512, seed: int = 7) -> None:
    rng = random.Random(seed)
    tokens = list(range(16, 256))
    rng.shuffle(tokens)
    phrases = [tokens[i * 5:(i + 1) * 5] for i in range(8)]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for _ in range(n_docs):
            ids = [1]  # bos
            for _ in range(rng.randint(4, 10)):
                ids += phrases[rng.randrange(8)]
            ids.append(2)  # eos
            f.write(json.dumps({"input_ids": ids}) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "fixtures"))
    args = ap.parse_args()
    if not os.path.exists(os.path.join(args.out, "tiny-qwen3-moe", "model.safetensors")):
        make_model(os.path.join(args.out, "tiny-qwen3-moe"))
    make_data(os.path.join(args.out, "tiny-data", "train.jsonl"))
    print(f"wrote {args.out}/tiny-qwen3-moe and {args.out}/tiny-data/train.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
