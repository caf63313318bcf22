#!/usr/bin/env python3
"""Build a tiny random Hugging Face MoE checkpoint for tests and smoke runs.

    make_tiny_model.py --arch ARCH --out DIR [--seed N] [--fused-experts] [--mxfp4-experts]

ARCH: qwen3_moe, olmoe, mixtral, qwen2_moe, glm4_moe, deepseek_v2, deepseek_v3, or a variant of
the newer families with their unusual options on (glm4_moe_grouped, deepseek_v2_grouped,
deepseek_v3_yarn: group-limited routing, YaRN, dense first layers, biases, q/k norm), gpt_oss,
glm4_moe_lite (GLM-4.7-Flash) and mistral4 (Mistral Small 4), with their variants glm4_moe_lite_grouped
(a dense layer between sparse ones, groups, YaRN) and mistral4_scaled (Llama 4's query scaling on),
gemma4 (Gemma 4 26B-A4B's text model: sliding and full layers with their own geometry, attention_k_eq_v,
proportional RoPE, logit soft-capping), gemma4_kv (v_proj on every layer, default RoPE, untied) and
gemma4_mm (gemma4's text model inside Gemma4ForConditionalGeneration with a one-layer vision tower, as
the Hub ships Gemma 4: model.language_model.*, model.vision_tower.*), mistral4_mm (mistral4's text
model inside Mistral3ForConditionalGeneration with a one-layer Pixtral vision tower and projector, as
the Hub ships Mistral Small 4; the wrapper's own tie_word_embeddings, which transformers ties by, is
true while text_config's is false), llama4 (Llama 4's text model,
Llama4ForCausalLM, with its unusual options on: dense and MoE layers interleaved, a NoPE layer with
temperature tuning inside the test sequences, chunked attention with a chunk shorter than them, L2
q/k norm, llama3 RoPE scaling, top-2 routing) and llama4_mm (a Scout-like text model inside
Llama4ForConditionalGeneration with a one-layer vision tower: language_model.model.*, vision_model.*),
qwen3_next (Qwen3-Next: gated delta-rule layers beside a gated full-attention layer, (1 + w) norms, a
gated shared expert) and qwen3_5_moe_mm (Qwen3.5-MoE's text model inside
Qwen3_5MoeForConditionalGeneration with a one-layer vision tower: model.language_model.*, model.visual.*),
minimax_m2 (MiniMax-M2: Mixtral's storage, a sigmoid router with its correction bias, whole q/k norms),
ernie4_5_moe (ERNIE-4.5-MoE: dense layers before moe_layer_start_index and after moe_layer_end_index, a
softmax router with moe_statics' correction bias, two ungated shared experts, interleaved RoPE, tied embeddings),
hunyuan_v1_moe (Hunyuan-MoE: router mlp.gate.wg, a shared_mlp, q/k norms after RoPE, NTK-alpha RoPE, biased attention).

transformers 5.24 holds experts fused at run time (`mlp.experts.gate_up_proj` [E, 2I, H],
`mlp.experts.down_proj` [E, H, I]) but save_pretrained converts them back to per-expert names
(`mlp.experts.{e}.gate_proj.weight`, Mixtral `block_sparse_moe.experts.{e}.w1.weight`).
--fused-experts rewrites the file into the fused layout so loaders are tested on both.
Llama 4 is saved fused (`feed_forward.experts.gate_up_proj` [E, H, 2I], `down_proj` [E, I, H]);
--per-expert-experts splits it into the per-expert linears of axolotl's linearized Llama 4 checkpoints
(`feed_forward.experts.gate_projs.{e}.weight` [I, H], up_projs, down_projs [H, I]).
--mxfp4-experts (gpt_oss) stores the experts as the Hub's gpt-oss does: MXFP4 `gate_up_proj_blocks`
[E, 2I, H/32, 16] / `_scales` [E, 2I, H/32] (the transposed [E, H, 2I] parameter, 32-groups along H)
and `down_proj_blocks` / `_scales` likewise, with quant_method "mxfp4" in config.json; each
32-group's scale is the smallest power of two that fits its largest value in FP4's 6, codes round
to the nearest FP4 value.
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
    if arch == "glm4_moe":
        # GLM-4.5-Air's layout: layer 0 dense (first_k_dense_replace), sigmoid router with a
        # correction bias, one shared expert, half the head dims rotated, q/k/v biases.
        return transformers.Glm4MoeConfig(**COMMON, head_dim=24, n_routed_experts=8, num_experts_per_tok=2,
                                          moe_intermediate_size=32, intermediate_size=80, n_shared_experts=1,
                                          first_k_dense_replace=1, n_group=1, topk_group=1, norm_topk_prob=True,
                                          routed_scaling_factor=1.0, attention_bias=True, use_qk_norm=False,
                                          rope_theta=5000.0, partial_rotary_factor=0.5)
    if arch == "glm4_moe_grouped":
        # Group-limited routing (4 groups, best 2), q/k norm, 2 dense layers, scaled unnormalised
        # weights, two shared experts, YaRN on 3/4 of the head dims.
        return transformers.Glm4MoeConfig(**{**COMMON, "num_hidden_layers": 4}, head_dim=16, n_routed_experts=8,
                                          num_experts_per_tok=3, moe_intermediate_size=24, intermediate_size=64,
                                          n_shared_experts=2, first_k_dense_replace=2, n_group=4, topk_group=2,
                                          norm_topk_prob=False, routed_scaling_factor=2.5, attention_bias=False,
                                          use_qk_norm=True, partial_rotary_factor=0.75,
                                          rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                           "original_max_position_embeddings": 64})
    # Latent attention gives every head its own keys: num_key_value_heads = num_attention_heads.
    MLA_COMMON = {**COMMON, "num_key_value_heads": 4}
    mla = dict(kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)
    if arch == "deepseek_v3":
        # DeepSeek-V3's layout: low-rank q, sigmoid router with correction bias over 2 groups (best 1),
        # routed_scaling_factor 2.5, interleaved RoPE, a dense first layer.
        return transformers.DeepseekV3Config(**MLA_COMMON, q_lora_rank=24, **mla, n_routed_experts=8,
                                             num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=32,
                                             intermediate_size=80, n_shared_experts=1, first_k_dense_replace=1,
                                             routed_scaling_factor=2.5, norm_topk_prob=True, rope_interleave=True,
                                             rope_theta=5000.0)
    if arch == "deepseek_v3_yarn":
        # YaRN (mscale != mscale_all_dim: cos/sin scaled and the softmax scale too), half-split RoPE,
        # full q_proj, biased attention, 4 groups (best 2), 2 dense layers, unnormalised weights.
        return transformers.DeepseekV3Config(**{**MLA_COMMON, "num_hidden_layers": 4}, q_lora_rank=None, **mla,
                                             n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
                                             moe_intermediate_size=24, intermediate_size=64, n_shared_experts=1,
                                             first_k_dense_replace=2, routed_scaling_factor=1.5, norm_topk_prob=False,
                                             rope_interleave=False, attention_bias=True,
                                             rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                              "mscale": 0.707, "mscale_all_dim": 1.0,
                                                              "original_max_position_embeddings": 64,
                                                              "beta_fast": 16, "beta_slow": 2})
    if arch == "deepseek_v2":
        # DeepSeek-V2-Lite's layout: full q_proj, softmax greedy top-k, two shared experts, a dense
        # first layer, YaRN with mscale = mscale_all_dim (its rope_scaling).
        return transformers.DeepseekV2Config(**MLA_COMMON, q_lora_rank=None, **mla, n_routed_experts=8,
                                             num_experts_per_tok=2, topk_method="greedy", moe_intermediate_size=32,
                                             intermediate_size=80, n_shared_experts=2, first_k_dense_replace=1,
                                             routed_scaling_factor=1.0, norm_topk_prob=False,
                                             rope_scaling={"type": "yarn", "factor": 4.0, "mscale": 0.707,
                                                           "mscale_all_dim": 0.707,
                                                           "original_max_position_embeddings": 64,
                                                           "beta_fast": 32, "beta_slow": 1})
    if arch == "deepseek_v2_grouped":
        # DeepSeek-V2's group_limited_greedy (4 groups, best 2), low-rank q, biased attention and MLPs,
        # routed_scaling_factor 16 as V2, every layer sparse.
        return transformers.DeepseekV2Config(**MLA_COMMON, q_lora_rank=24, **mla, n_routed_experts=8,
                                             num_experts_per_tok=3, topk_method="group_limited_greedy", n_group=4,
                                             topk_group=2, moe_intermediate_size=24, intermediate_size=64,
                                             n_shared_experts=1, first_k_dense_replace=0, routed_scaling_factor=16.0,
                                             norm_topk_prob=False, attention_bias=True, mlp_bias=True,
                                             rope_theta=10000.0)
    if arch == "glm4_moe_lite":
        # GLM-4.7-Flash's layout: DeepSeek-V3's latent attention (low-rank q, interleaved RoPE) with
        # GLM-4.5's sigmoid router (correction bias, one group), routed_scaling_factor 1.8, one
        # shared expert, layer 0 dense (mlp_layer_types' default).
        return transformers.Glm4MoeLiteConfig(**MLA_COMMON, q_lora_rank=24, **mla, n_routed_experts=8,
                                              num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=80,
                                              n_shared_experts=1, routed_scaling_factor=1.8, norm_topk_prob=True,
                                              rope_interleave=True,
                                              rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    if arch == "glm4_moe_lite_grouped":
        # A dense layer in the middle (mlp_layer_types), full q_proj, biased attention, 4 groups
        # (best 2), unnormalised weights, two shared experts, half-split RoPE, YaRN with mscale_all_dim.
        return transformers.Glm4MoeLiteConfig(**{**MLA_COMMON, "num_hidden_layers": 4}, q_lora_rank=None, **mla,
                                              n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
                                              moe_intermediate_size=24, intermediate_size=64, n_shared_experts=2,
                                              mlp_layer_types=["sparse", "dense", "sparse", "sparse"],
                                              routed_scaling_factor=2.5, norm_topk_prob=False, rope_interleave=False,
                                              attention_bias=True,
                                              rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                               "mscale": 0.707, "mscale_all_dim": 1.0,
                                                               "original_max_position_embeddings": 64})
    if arch == "mistral4":
        # Mistral Small 4's layout: latent attention with low-rank q, a softmax router over one group,
        # every layer sparse, one shared expert, YaRN with mscale = mscale_all_dim and Llama 4's query
        # scaling (inactive below original_max_position_embeddings), rotary dims = qk_rope_head_dim.
        return transformers.Mistral4Config(**MLA_COMMON, q_lora_rank=24, **mla, n_routed_experts=8,
                                           num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=80,
                                           n_shared_experts=1, first_k_dense_replace=0, norm_topk_prob=True,
                                           routed_scaling_factor=1.0, rope_interleave=True,
                                           rope_parameters={"type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                            "original_max_position_embeddings": 64,
                                                            "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0,
                                                            "mscale": 1.0, "llama_4_scaling_beta": 0.1,
                                                            "max_position_embeddings": 256})
    if arch == "mistral4_scaled":
        # Llama 4's query scaling within the test sequences (original_max_position_embeddings 4),
        # mscale != mscale_all_dim, 4 groups (best 2), a dense first layer, full q_proj, biased
        # attention, half-split RoPE, unnormalised scaled weights, two shared experts.
        return transformers.Mistral4Config(**{**MLA_COMMON, "num_hidden_layers": 4}, q_lora_rank=None, **mla,
                                           n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
                                           moe_intermediate_size=24, intermediate_size=64, n_shared_experts=2,
                                           first_k_dense_replace=1, norm_topk_prob=False, routed_scaling_factor=2.0,
                                           rope_interleave=False, attention_bias=True,
                                           rope_parameters={"type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
                                                            "original_max_position_embeddings": 4,
                                                            "beta_fast": 16.0, "beta_slow": 2.0, "mscale_all_dim": 1.0,
                                                            "mscale": 0.707, "llama_4_scaling_beta": 0.5,
                                                            "max_position_embeddings": 256})
    if arch == "gpt_oss":
        # gpt-oss: attention sinks, a 4-token sliding window on every other layer (the test sequences
        # are longer), biases everywhere, a router with bias, clamped SwiGLU with a limit low enough
        # to clamp, YaRN without truncation (as gpt-oss-20b). Experts exist only fused.
        return transformers.GptOssConfig(**COMMON, head_dim=16, num_local_experts=6, num_experts_per_tok=2,
                                         intermediate_size=32, sliding_window=4, swiglu_limit=1.5,
                                         router_aux_loss_coef=0.02,
                                         rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                                          "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                          "original_max_position_embeddings": 64})
    if arch == "mistral4_mm":
        vision = transformers.PixtralVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                                  num_attention_heads=2, head_dim=16, image_size=32, patch_size=8)
        return transformers.Mistral3Config(text_config=make_config("mistral4"), vision_config=vision,
                                           tie_word_embeddings=True)
    if arch == "gemma4_mm":
        vision = transformers.Gemma4VisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                                 num_attention_heads=2, num_key_value_heads=2, head_dim=16)
        return transformers.Gemma4Config(text_config=make_config("gemma4"), vision_config=vision, audio_config=None)
    if arch in ("gemma4", "gemma4_kv"):
        # Gemma 4 26B-A4B's text model: a dense MLP beside the routed experts on every layer, sliding
        # (window 4, shorter than the test sequences) and full-attention layers, the full ones with
        # their own head_dim and key-value heads.
        g = dict(vocab_size=320, hidden_size=64, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, global_head_dim=32, max_position_embeddings=256,
                 hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=6, top_k_experts=2,
                 moe_intermediate_size=24, sliding_window=4, rms_norm_eps=1e-6,
                 layer_types=["sliding_attention", "sliding_attention", "full_attention"])
        if arch == "gemma4":
            # As the 26B: attention_k_eq_v (full layers: no v_proj, one kv head), proportional RoPE on
            # a quarter of the full layers' head, final logits soft-capped (at 3, so the cap bites), tied.
            return transformers.Gemma4TextConfig(**g, attention_k_eq_v=True, num_global_key_value_heads=1,
                                                 final_logit_softcapping=3.0, tie_word_embeddings=True)
        # v_proj everywhere, the full layers' kv heads as the sliding ones', default RoPE on the full
        # layers (another theta), no soft-capping, an untied lm_head.
        return transformers.Gemma4TextConfig(**g, attention_k_eq_v=False, final_logit_softcapping=None,
                                             tie_word_embeddings=False,
                                             rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                                              "full_attention": {"rope_type": "default", "rope_theta": 5000.0}})
    if arch == "llama4":
        # 4 layers: 0 and 2 dense (intermediate_size_mlp), 1 and 3 MoE with the shared expert;
        # layer 2 NoPE (its queries x the temperature from position 2 on: floor_scale 2), the others
        # RoPE with chunks of 4 positions and the L2 q/k norm; llama3 RoPE scaling with an original
        # length that puts frequencies in all three of its bands.
        return transformers.Llama4TextConfig(**{**COMMON, "num_hidden_layers": 4}, head_dim=16, num_local_experts=4,
                                             num_experts_per_tok=2, intermediate_size=32, intermediate_size_mlp=48,
                                             interleave_moe_layer_step=2, no_rope_layers=[1, 1, 0, 1],
                                             attention_chunk_size=4, use_qk_norm=True, attn_temperature_tuning=True,
                                             floor_scale=2, attn_scale=0.5, rms_norm_eps=1e-5,
                                             rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                              "original_max_position_embeddings": 64})
    if arch == "llama4_mm":
        # Scout's text layout (every layer MoE, top-1, a NoPE layer every 4th, chunked RoPE layers,
        # q/k norm), small, inside the multimodal model.
        text = transformers.Llama4TextConfig(**{**COMMON, "num_hidden_layers": 4}, head_dim=16, num_local_experts=4,
                                             num_experts_per_tok=1, intermediate_size=32, intermediate_size_mlp=48,
                                             attention_chunk_size=8, floor_scale=4, attn_scale=0.1,
                                             rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
        vision = transformers.Llama4VisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                                 num_attention_heads=2, image_size=28, patch_size=14,
                                                 vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)
        return transformers.Llama4Config(text_config=text, vision_config=vision)
    if arch == "qwen3_next":
        # 4 layers: gated delta-rule layers 0-2 and full attention on layer 3 (full_attention_interval
        # 4), every layer sparse as the 80B; 2 key heads serving 4 value heads, a conv of 4 taps, a
        # quarter of each attention head rotated, a sigmoid-gated shared expert.
        return transformers.Qwen3NextConfig(**{**COMMON, "num_hidden_layers": 4}, head_dim=16, num_experts=6,
                                            num_experts_per_tok=2, moe_intermediate_size=32,
                                            shared_expert_intermediate_size=24, intermediate_size=48,
                                            linear_num_key_heads=2, linear_num_value_heads=4,
                                            linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4,
                                            norm_topk_prob=True, router_aux_loss_coef=0.01,
                                            rope_parameters={"rope_type": "default", "rope_theta": 5000.0,
                                                             "partial_rotary_factor": 0.25})
    if arch == "minimax_m2":
        # MiniMax-M2: sigmoid router with a correction bias (beside the router, in the MoE block), top-2
        # of 6 renormalised, q/k norms over the whole projections, half of each head rotated.
        return transformers.MiniMaxM2Config(**COMMON, head_dim=16, num_local_experts=6, num_experts_per_tok=2,
                                            intermediate_size=32, router_aux_loss_coef=0.01, bos_token_id=None,
                                            eos_token_id=None,
                                            rope_parameters={"rope_type": "default", "rope_theta": 5000.0,
                                                             "partial_rotary_factor": 0.5})
    if arch == "ernie4_5_moe":
        # ERNIE-4.5-21B-A3B's layout on 4 layers: layer 0 dense (moe_layer_start_index 1), layer 3 dense
        # (moe_layer_end_index 2), softmax top-2 of 6 chosen with the correction bias, two shared
        # experts, tied embeddings (its config class's default).
        return transformers.Ernie4_5_MoeConfig(**{**COMMON, "num_hidden_layers": 4, "tie_word_embeddings": True},
                                               moe_num_experts=6, moe_k=2, moe_intermediate_size=32,
                                               intermediate_size=80, moe_num_shared_experts=2, moe_layer_start_index=1,
                                               moe_layer_end_index=2, moe_layer_interval=1, router_aux_loss_coef=0.01,
                                               rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    if arch == "hunyuan_v1_moe":
        # Hunyuan-A13B's layout: every layer sparse, softmax top-2 of 6 renormalised (moe_topk per layer, as
        # the Hub writes it), the shared_mlp, per-head q/k norms after RoPE, NTK-alpha RoPE (rope_scaling
        # "dynamic" with alpha, as the Hub ships it), tied embeddings; q/k/v/o biases.
        return transformers.HunYuanMoEV1Config(**{**COMMON, "tie_word_embeddings": True}, head_dim=16, num_experts=6,
                                               moe_topk=[2, 2, 2], intermediate_size=32, attention_bias=True,
                                               rope_theta=10000.0,
                                               rope_scaling={"alpha": 1000.0, "factor": 1.0, "type": "dynamic"})
    if arch == "qwen3_5_moe_mm":
        # Qwen3.5-MoE as the Hub ships it: the text model inside Qwen3_5MoeForConditionalGeneration
        # with a one-layer vision tower (model.language_model.*, model.visual.*); its delta-rule
        # layers have four projections (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a); every layer
        # sparse; interleaved M-RoPE on a quarter of each head (plain RoPE for text).
        text = transformers.Qwen3_5MoeTextConfig(**{**COMMON, "num_hidden_layers": 4}, head_dim=16, num_experts=6,
                                                 num_experts_per_tok=2, moe_intermediate_size=32,
                                                 shared_expert_intermediate_size=24, linear_num_key_heads=2,
                                                 linear_num_value_heads=4, linear_key_head_dim=8,
                                                 linear_value_head_dim=12, linear_conv_kernel_dim=4,
                                                 router_aux_loss_coef=0.01,
                                                 rope_parameters={"rope_type": "default", "rope_theta": 5000.0,
                                                                  "partial_rotary_factor": 0.25,
                                                                  "mrope_section": [1, 1, 0], "mrope_interleaved": True})
        vision = transformers.Qwen3_5MoeVisionConfig(depth=1, hidden_size=32, intermediate_size=48, num_heads=2,
                                                     patch_size=8, out_hidden_size=64, num_position_embeddings=16)
        return transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision)
    raise SystemExit(f"unknown --arch {arch}")


ARCHS = ["qwen3_moe", "olmoe", "mixtral", "qwen2_moe", "glm4_moe", "glm4_moe_grouped", "deepseek_v2",
         "deepseek_v2_grouped", "deepseek_v3", "deepseek_v3_yarn", "gpt_oss", "glm4_moe_lite", "glm4_moe_lite_grouped",
         "mistral4", "mistral4_scaled", "gemma4", "gemma4_kv", "gemma4_mm", "mistral4_mm", "llama4", "llama4_mm", "qwen3_next",
         "qwen3_5_moe_mm", "minimax_m2", "ernie4_5_moe", "hunyuan_v1_moe"]


def fuse_experts(path, cfg):
    """Rewrite per-expert tensors into transformers v5's fused [E, 2I, H] / [E, H, I] layout."""
    if cfg.model_type.startswith(("gemma4", "llama4")) or cfg.model_type in ("mistral4", "mistral3"):
        return  # saved fused already (transformers 5 has no per-expert form of these families' experts)
    sd = load_file(path)
    dec = "model.language_model." if cfg.model_type == "qwen3_5_moe" else "model."  # the multimodal wrapper's decoder
    cfg = getattr(cfg, "text_config", None) or cfg
    n_exp = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    names = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
    for layer in range(cfg.num_hidden_layers):
        for prefix in (f"{dec}layers.{layer}.mlp.experts", f"{dec}layers.{layer}.block_sparse_moe.experts"):
            mix = "block_sparse_moe" in prefix
            key = lambda e, m: f"{prefix}.{e}.{ {'gate': 'w1', 'up': 'w3', 'down': 'w2'}[m] if mix else names[m]}.weight"
            if key(0, "gate") not in sd:
                continue
            gate_up = torch.stack([torch.cat([sd.pop(key(e, "gate")), sd.pop(key(e, "up"))], 0) for e in range(n_exp)])
            down = torch.stack([sd.pop(key(e, "down")) for e in range(n_exp)])
            sd[f"{prefix}.gate_up_proj"] = gate_up.contiguous()
            sd[f"{prefix}.down_proj"] = down.contiguous()
    save_file(sd, path, metadata={"format": "pt"})


def split_llama4_experts(path, cfg):
    """Llama 4's fused experts as axolotl's linearized per-expert linears ([out, in] weights)."""
    sd = load_file(path)
    for key in [k for k in sd if k.endswith("feed_forward.experts.gate_up_proj")]:
        prefix = key[: -len(".gate_up_proj")]
        gu, down = sd.pop(key), sd.pop(prefix + ".down_proj")
        inter = down.shape[1]
        for e in range(gu.shape[0]):
            sd[f"{prefix}.gate_projs.{e}.weight"] = gu[e, :, :inter].T.contiguous()
            sd[f"{prefix}.up_projs.{e}.weight"] = gu[e, :, inter:].T.contiguous()
            sd[f"{prefix}.down_projs.{e}.weight"] = down[e].T.contiguous()
    save_file(sd, path, metadata={"format": "pt"})


FP4_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def mxfp4_quantize(x):
    """x [..., rows, cols] (cols a multiple of 32) -> blocks uint8 [..., rows, cols/32, 16] (code 2j in
    the low nibble of byte j) and E8M0 scales uint8 [..., rows, cols/32]."""
    g = x.float().reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    amax = g.abs().amax(-1)
    exp = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.full_like(amax, -127.0)).clamp(-127, 127)
    y = g / torch.exp2(exp).unsqueeze(-1)  # |y| <= 6
    mag = (y.abs().unsqueeze(-1) - FP4_MAGNITUDES).abs().argmin(-1)  # nearest (ties: the smaller)
    code = (mag + 8 * ((y < 0) & (mag > 0))).to(torch.uint8)
    blocks = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    return blocks.contiguous(), (exp + 127).to(torch.uint8).contiguous()


def mxfp4_experts(out_dir, cfg):
    """Replace gpt-oss's float experts by MXFP4 blocks / scales in the Hub layout."""
    path = os.path.join(out_dir, "model.safetensors")
    sd = load_file(path)
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}.mlp.experts."
        for name in ("gate_up_proj", "down_proj"):  # [E, H, 2I] and [E, I, H]: stored transposed
            blocks, scales = mxfp4_quantize(sd.pop(p + name).transpose(1, 2))
            sd[p + name + "_blocks"], sd[p + name + "_scales"] = blocks, scales
    save_file(sd, path, metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json")) as f:
        c = json.load(f)
    c["quantization_config"] = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                           "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(c, f, indent=2)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", required=True, choices=ARCHS)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fused-experts", action="store_true")
    ap.add_argument("--mxfp4-experts", action="store_true")
    ap.add_argument("--per-expert-experts", action="store_true")
    args = ap.parse_args()
    if args.per_expert_experts and not args.arch.startswith("llama4"):
        raise SystemExit("--per-expert-experts: only llama4 checkpoints are saved fused and split")
    if args.mxfp4_experts and args.arch != "gpt_oss":
        raise SystemExit("--mxfp4-experts: only gpt_oss checkpoints store MXFP4 experts")

    cfg = make_config(args.arch)
    torch.manual_seed(args.seed)
    # transformers 5.24 maps mistral4 to no causal-LM auto class (only inside Mistral 3's multimodal
    # model); Mistral4ForCausalLM is built directly.
    if cfg.model_type == "mistral4":
        model = transformers.Mistral4ForCausalLM._from_config(cfg, dtype=torch.float32)
    elif cfg.model_type == "gemma4":  # the multimodal wrappers
        model = transformers.Gemma4ForConditionalGeneration._from_config(cfg, dtype=torch.float32)
    elif cfg.model_type == "mistral3":
        model = transformers.Mistral3ForConditionalGeneration._from_config(cfg, dtype=torch.float32)
    elif cfg.model_type == "qwen3_5_moe":  # the multimodal wrapper
        model = transformers.Qwen3_5MoeForConditionalGeneration._from_config(cfg, dtype=torch.float32)
    elif cfg.model_type == "llama4":  # the multimodal wrapper
        model = transformers.Llama4ForConditionalGeneration._from_config(cfg, dtype=torch.float32)
    else:
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    gen = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight") or "layernorm" in name or name.endswith("scale"):
                # norms (and Gemma's router scales) away from 1 so they matter
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=gen) * (1.5 / fan_in ** 0.5))
        for name, b in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):  # non-zero, so that it changes which experts are chosen
                b.copy_(0.3 * torch.randn(b.shape, generator=gen))
            if name.endswith("layer_scalar"):  # Gemma 4 (saved with the weights): away from 1
                b.copy_(0.8 + 0.4 * torch.rand(b.shape, generator=gen))
    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    if args.fused_experts:
        fuse_experts(os.path.join(args.out, "model.safetensors"), cfg)
    if args.mxfp4_experts:
        mxfp4_experts(args.out, cfg)
    if args.per_expert_experts:
        split_llama4_experts(os.path.join(args.out, "model.safetensors"), cfg)
    print(json.dumps({"arch": args.arch, "out": args.out}))


if __name__ == "__main__":
    main()
