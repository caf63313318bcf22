#include "models/arch.h"

#include <set>

#include "common/error.h"

namespace eo::model {

const std::vector<Family>& families() {
  // Module names as transformers 5.24 and peft 0.21 give them. A checkpoint of the per-expert
  // families stores experts.{e}.<linear>; transformers 5 loads it fused (gate_up_proj, down_proj).
  static const std::vector<Family> rows = {
      // arch, model_type, moe_block, experts, router, shared_expert, expert_linears,
      //   per_expert_lora, fused_expert_lora, fused_experts, rope_scaling, latent_attention
      {Arch::Qwen3Moe, "qwen3_moe", "mlp", "mlp.experts", "mlp.gate", "shared_experts", {"gate_proj", "up_proj", "down_proj"},
       true, true, "mlp.experts", false, false},
      {Arch::Olmoe, "olmoe", "mlp", "mlp.experts", "mlp.gate", "shared_experts", {"gate_proj", "up_proj", "down_proj"},
       true, true, "mlp.experts", false, false},
      // Mixtral's checkpoints name the block block_sparse_moe and its experts' linears w1 / w3 / w2;
      // transformers 5 holds the fused parameters under mlp.experts.
      {Arch::Mixtral, "mixtral", "block_sparse_moe", "block_sparse_moe.experts", "block_sparse_moe.gate", "shared_experts",
       {"w1", "w3", "w2"}, true, true, "mlp.experts", false, false},
      {Arch::Qwen2Moe, "qwen2_moe", "mlp", "mlp.experts", "mlp.gate", "shared_expert", {"gate_proj", "up_proj", "down_proj"},
       true, true, "mlp.experts", false, false},
      {Arch::Glm4Moe, "glm4_moe", "mlp", "mlp.experts", "mlp.gate", "shared_experts", {"gate_proj", "up_proj", "down_proj"},
       true, false, "mlp.experts", true, false},
      {Arch::DeepseekV2, "deepseek_v2", "mlp", "mlp.experts", "mlp.gate", "shared_experts", {"gate_proj", "up_proj", "down_proj"},
       true, false, "mlp.experts", true, true},
      {Arch::DeepseekV3, "deepseek_v3", "mlp", "mlp.experts", "mlp.gate", "shared_experts", {"gate_proj", "up_proj", "down_proj"},
       true, false, "mlp.experts", true, true},
      // gpt-oss: experts only ever fused, with biases and the clamped activation.
      {Arch::GptOss, "gpt_oss", "mlp", "mlp.experts", "mlp.router", "shared_experts", {"gate_proj", "up_proj", "down_proj"},
       false, false, "mlp.experts", true, false},
      {Arch::Glm4MoeLite, "glm4_moe_lite", "mlp", "mlp.experts", "mlp.gate", "shared_experts", {"gate_proj", "up_proj", "down_proj"},
       true, true, "mlp.experts", true, true},
      {Arch::Mistral4, "mistral4", "mlp", "mlp.experts", "mlp.gate", "shared_experts", {"gate_proj", "up_proj", "down_proj"},
       true, true, "mlp.experts", true, true},
      // Gemma 4: the experts and their router beside the layer's dense mlp, not inside it.
      {Arch::Gemma4, "gemma4_text", "mlp", "experts", "router.proj", "shared_experts", {"gate_proj", "up_proj", "down_proj"},
       false, true, "experts", true, false},
      // Llama 4: feed_forward holds the router, the shared expert and the fused experts (peft's
      // ParamWrapper would take their [E, H, 2I] as [E, out, in], so lora_target_parameters is refused there).
      {Arch::Llama4, "llama4_text", "feed_forward", "feed_forward.experts", "feed_forward.router", "shared_expert",
       {"gate_proj", "up_proj", "down_proj"}, false, false, "feed_forward.experts", true, false},
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
