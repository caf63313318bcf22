#include "models/arch.h"

#include <set>

#include "common/error.h"
#include "models/family_config.h"

namespace eo::model {

const std::vector<Family>& families() {
  // Module names as transformers 5.24 and peft 0.21 give them. A checkpoint of the per-expert
  // families stores experts.{e}.<linear>; transformers 5 loads it fused (gate_up_proj, down_proj).
  static const std::vector<Family> rows = {
      // arch, model_type, moe_block, dense_mlp, experts, router, shared_expert, expert_linears,
      //   per_expert_lora, fused_expert_lora, fused_experts, fused_layout, rope_scaling, latent_attention,
      //   rms_eps, head_dim, router_aux_loss_coef, reads_hidden_act, partial_rotary, rotary_over_qk_head, rope_pairs,
      //   query_position_scaling, expert_storage, read_moe, parse_whole
      {Arch::Qwen3Moe, "qwen3_moe", "mlp", "mlp", "mlp.experts", "mlp.gate", "shared_experts", {"gate_proj", "up_proj", "down_proj"},
       true, true, "mlp.experts", {}, false, false,
       1e-6, 0, 0.0, true, 1.0, false, RopePairs::Halves, false, ExpertStorage::Standard, read_qwen3_moe, nullptr},
      {Arch::Olmoe, "olmoe", "mlp", "mlp", "mlp.experts", "mlp.gate", "shared_experts", {"gate_proj", "up_proj", "down_proj"},
       true, true, "mlp.experts", {}, false, false,
       1e-5, 0, 0.0, true, 1.0, false, RopePairs::Halves, false, ExpertStorage::Standard, read_olmoe, nullptr},
      // Mixtral's checkpoints name the block block_sparse_moe and its experts' linears w1 / w3 / w2;
      // transformers 5 holds the fused parameters under mlp.experts.
      {Arch::Mixtral, "mixtral", "block_sparse_moe", "mlp", "block_sparse_moe.experts", "block_sparse_moe.gate", "shared_experts",
       {"w1", "w3", "w2"}, true, true, "mlp.experts", {}, false, false,
       1e-6, 0, 0.0, true, 1.0, false, RopePairs::Halves, false, ExpertStorage::Standard, read_mixtral, nullptr},
      {Arch::Qwen2Moe, "qwen2_moe", "mlp", "mlp", "mlp.experts", "mlp.gate", "shared_expert", {"gate_proj", "up_proj", "down_proj"},
       true, true, "mlp.experts", {}, false, false,
       1e-6, 0, 0.0, true, 1.0, false, RopePairs::Halves, false, ExpertStorage::Standard, read_qwen2_moe, nullptr},
      {Arch::Glm4Moe, "glm4_moe", "mlp", "mlp", "mlp.experts", "mlp.gate", "shared_experts", {"gate_proj", "up_proj", "down_proj"},
       true, true, "mlp.experts", {}, true, false,
       1e-5, 0, 0.0, true, 0.5, false, RopePairs::Halves, false, ExpertStorage::Standard, read_glm4_moe, nullptr},
      {Arch::DeepseekV2, "deepseek_v2", "mlp", "mlp", "mlp.experts", "mlp.gate", "shared_experts", {"gate_proj", "up_proj", "down_proj"},
       true, true, "mlp.experts", {}, true, true,
       1e-6, 0, 0.0, true, 1.0, false, RopePairs::Interleaved, false, ExpertStorage::Standard, read_deepseek_v2, nullptr},
      {Arch::DeepseekV3, "deepseek_v3", "mlp", "mlp", "mlp.experts", "mlp.gate", "shared_experts", {"gate_proj", "up_proj", "down_proj"},
       true, true, "mlp.experts", {}, true, true,
       1e-6, 0, 0.0, true, 1.0, false, RopePairs::InterleavedByDefault, false, ExpertStorage::Standard, read_deepseek_v3, nullptr},
      // gpt-oss: experts only ever fused, with biases and the clamped activation; gate_up_proj
      // [E, H, 2I] (is_transposed) with gate and up interleaved.
      {Arch::GptOss, "gpt_oss", "mlp", "mlp", "mlp.experts", "mlp.router", "shared_experts", {"gate_proj", "up_proj", "down_proj"},
       false, true, "mlp.experts", {/*factors_swapped=*/false, /*gate_up_interleaved=*/true}, true, false,
       1e-5, 64, 0.001, false, 1.0, false, RopePairs::Halves, false, ExpertStorage::GptOss, read_gpt_oss, nullptr},
      {Arch::Glm4MoeLite, "glm4_moe_lite", "mlp", "mlp", "mlp.experts", "mlp.gate", "shared_experts", {"gate_proj", "up_proj", "down_proj"},
       true, true, "mlp.experts", {}, true, true,
       1e-5, 0, 0.0, true, 1.0, false, RopePairs::InterleavedByDefault, false, ExpertStorage::Standard, read_glm4_moe_lite, nullptr},
      {Arch::Mistral4, "mistral4", "mlp", "mlp", "mlp.experts", "mlp.gate", "shared_experts", {"gate_proj", "up_proj", "down_proj"},
       true, true, "mlp.experts", {}, true, true,
       1e-6, 0, 0.0, true, 1.0, true, RopePairs::InterleavedByDefault, true, ExpertStorage::Standard, read_mistral4, nullptr},
      // Gemma 4: the experts and their router beside the layer's dense mlp, not inside it.
      {Arch::Gemma4, "gemma4_text", "mlp", "mlp", "experts", "router.proj", "shared_experts", {"gate_proj", "up_proj", "down_proj"},
       false, true, "experts", {}, true, false,
       1e-6, 0, 0.0, true, 1.0, false, RopePairs::Halves, false, ExpertStorage::Standard, nullptr, parse_gemma4},
      // Llama 4: feed_forward holds the router, the shared expert and the fused experts, whose
      // [E, H, 2I] peft's ParamWrapper takes as [E, out, in] (no is_transposed flag).
      {Arch::Llama4, "llama4_text", "feed_forward", "feed_forward", "feed_forward.experts", "feed_forward.router", "shared_expert",
       {"gate_proj", "up_proj", "down_proj"}, false, true, "feed_forward.experts",
       {/*factors_swapped=*/true, /*gate_up_interleaved=*/false}, true, false,
       1e-5, 0, 0.0, true, 1.0, false, RopePairs::Halves, false, ExpertStorage::Standard, nullptr, parse_llama4},
      // Qwen3-Next and Qwen3.5-MoE: three of every four layers gated delta-rule linear attention
      // (linear_attn.*, hf_config.h LinearAttention), the others gated attention with a quarter
      // of each head rotated; a sigmoid-gated shared expert. transformers 5.24 holds their experts
      // only fused, so peft has no per-expert modules: gate_proj / up_proj / down_proj name the
      // shared expert's (axolotl's Qwen3-Next config targets shared_expert.gate_proj ...), and the
      // routed experts take LoRA as peft's ParamWrapper (lora_target_parameters).
      {Arch::Qwen3Next, "qwen3_next", "mlp", "mlp", "mlp.experts", "mlp.gate", "shared_expert", {"gate_proj", "up_proj", "down_proj"},
       false, true, "mlp.experts", {}, true, false,
       1e-6, 256, 0.001, true, 0.25, false, RopePairs::Halves, false, ExpertStorage::Standard, read_qwen3_next, nullptr},
      {Arch::Qwen35Moe, "qwen3_5_moe_text", "mlp", "mlp", "mlp.experts", "mlp.gate", "shared_expert", {"gate_proj", "up_proj", "down_proj"},
       false, true, "mlp.experts", {}, true, false,
       1e-6, 256, 0.001, true, 0.25, false, RopePairs::Halves, false, ExpertStorage::Standard, read_qwen3_5_moe, nullptr},
      // MiniMax-M2: stored as Mixtral is (block_sparse_moe, w1 / w3 / w2), whole-projection q/k norms,
      // partial RoPE, a sigmoid router whose correction bias sits in the MoE block, not the router.
      {Arch::MinimaxM2, "minimax_m2", "block_sparse_moe", "mlp", "block_sparse_moe.experts", "block_sparse_moe.gate",
       "shared_experts", {"w1", "w3", "w2"}, true, true, "mlp.experts", {}, true, false,
       1e-6, 128, 0.001, true, 1.0, false, RopePairs::Halves, false, ExpertStorage::Standard, read_minimax_m2, nullptr,
       "block_sparse_moe.e_score_correction_bias"},
      // ERNIE-4.5-MoE: softmax router with the correction bias for the choice (mlp.moe_statics),
      // ungated shared experts, dense layers outside moe_layer_start / end / interval, interleaved
      // RoPE pairs; its rotary embedding reads no partial_rotary_factor.
      {Arch::Ernie45Moe, "ernie4_5_moe", "mlp", "mlp", "mlp.experts", "mlp.gate", "shared_experts",
       {"gate_proj", "up_proj", "down_proj"}, true, true, "mlp.experts", {}, false, false,
       1e-5, 0, 0.001, true, 1.0, false, RopePairs::Interleaved, false, ExpertStorage::Standard, read_ernie4_5_moe, nullptr,
       "mlp.moe_statics.e_score_correction_bias"},
      // Hunyuan-MoE: the router's linear is mlp.gate.wg, one ungated shared_mlp beside the experts
      // (both intermediate_size wide), per-head q/k norms named query_layernorm / key_layernorm and
      // applied after RoPE, NTK-alpha RoPE; transformers computes no aux loss for it.
      {Arch::HunyuanV1Moe, "hunyuan_v1_moe", "mlp", "mlp", "mlp.experts", "mlp.gate.wg", "shared_mlp",
       {"gate_proj", "up_proj", "down_proj"}, true, true, "mlp.experts", {}, false, false,
       1e-5, 0, 0.0, true, 1.0, false, RopePairs::Halves, false, ExpertStorage::Standard, read_hunyuan_v1_moe, nullptr,
       /*correction_bias=*/nullptr, "query_layernorm", "key_layernorm", /*rope_ntk_alpha=*/true},
  };
  return rows;
}

const Family& family(Arch arch) {
  for (const auto& f : families())
    if (f.arch == arch) return f;
  EO_FAIL("no row in the architecture table for arch ", static_cast<int>(arch));
}

const Family* find_family(std::string_view model_type) {
  for (const auto& f : families())
    if (model_type == f.model_type) return &f;
  return nullptr;
}

const std::vector<std::string>& expert_linear_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    std::set<std::string> seen;
    for (const auto& f : families())
      for (const char* n : f.expert_linears)
        if (seen.insert(n).second) out.push_back(n);
    return out;
  }();
  return names;
}

}  // namespace eo::model
