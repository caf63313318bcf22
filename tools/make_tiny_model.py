#!/usr/bin/env python3
"""Build a tiny random Hugging Face MoE checkpoint for tests and smoke runs.

    make_tiny_model.py --arch {qwen3_moe,olmoe,mixtral,qwen2_moe} --out DIR [--seed N] [--fused-experts]

transformers 5.24 holds experts fused at run time (`mlp.experts.gate_up_proj` [E, 2I, H],
`mlp.experts.down_proj` [E, H, I]) but save_pretrained converts them back to per-expert names
(`mlp.experts.{e}.gate_proj.weight`, Mixtral `block_sparse_moe.experts.{e}.w1.weight`).
--fused-experts rewrites the file into the fused layout so loaders are tested on both.
Deterministic for a given seed; weights are scaled up from HF's tiny init so routing and
attention are far from uniform (a broken router or RoPE changes the logits visibly).
"""
import argparse
import json
import os
import sys

# tools/ is not a package: keep it off the import path (no tool may shadow a standard module).
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

COMMON = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=320, max_position_embeddings=256, tie_word_embeddings=False)


def make_config(arch):
    if arch == "qwen3_moe":
        # head_dim 24 != hidden / heads (16), as in the real model; layer 0 dense via mlp_only_layers.
        return transformers.Qwen3MoeConfig(**COMMON, head_dim=24, num_experts=6, num_experts_per_tok=2,
                                           moe_intermediate_size=32, intermediate_size=80, mlp_only_layers=[0],
                                           decoder_sparse_step=1, norm_topk_prob=True, rope_theta=5000.0,
                                           output_router_logits=False, router_aux_loss_coef=0.01)
    if arch == "olmoe":
        return transformers.OlmoeConfig(**COMMON, num_experts=8, num_experts_per_tok=2, intermediate_size=32,
                                        clip_qkv=4.0, norm_topk_prob=False, rms_norm_eps=1e-5,
                                        router_aux_loss_coef=0.01)
    if arch == "mixtral":
        return transformers.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2,
                                          intermediate_size=48, rope_theta=1e6, router_aux_loss_coef=0.02)
    if arch == "qwen2_moe":
        # decoder_sparse_step 2: layers 1 is MoE, 0 and 2 dense; plus a shared expert.
        return transformers.Qwen2MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                           shared_expert_intermediate_size=48, intermediate_size=72,
                                           decoder_sparse_step=2, norm_topk_prob=False, qkv_bias=True,
                                           router_aux_loss_coef=0.01)
    raise SystemExit(f"unknown --arch {arch}")


def fuse_experts(path, cfg):
    """Rewrite per-expert tensors into transformers v5's fused [E, 2I, H] / [E, H, I] layout."""
    sd = load_file(path)
    n_exp = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    names = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
    for layer in range(cfg.num_hidden_layers):
        for prefix in (f"model.layers.{layer}.mlp.experts", f"model.layers.{layer}.block_sparse_moe.experts"):
            mix = "block_sparse_moe" in prefix
            key = lambda e, m: f"{prefix}.{e}.{ {'gate': 'w1', 'up': 'w3', 'down': 'w2'}[m] if mix else names[m]}.weight"
            if key(0, "gate") not in sd:
                continue
            gate_up = torch.stack([torch.cat([sd.pop(key(e, "gate")), sd.pop(key(e, "up"))], 0) for e in range(n_exp)])
            down = torch.stack([sd.pop(key(e, "down")) for e in range(n_exp)])
            sd[f"{prefix}.gate_up_proj"] = gate_up.contiguous()
            sd[f"{prefix}.down_proj"] = down.contiguous()
    save_file(sd, path, metadata={"format": "pt"})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", required=True, choices=["qwen3_moe", "olmoe", "mixtral", "qwen2_moe"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fused-experts", action="store_true")
    args = ap.parse_args()

    cfg = make_config(args.arch)
    torch.manual_seed(args.seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    gen = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))  # norms away from 1 so they matter
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=gen) * (1.5 / fan_in ** 0.5))
    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    if args.fused_experts:
        fuse_experts(os.path.join(args.out, "model.safetensors"), cfg)
    print(json.dumps({"arch": args.arch, "out": args.out}))


if __name__ == "__main__":
    main()
