// The architecture table: one row per model family, holding every fact about a family that code
// outside its block may know (module and expert names, where the router sits, which LoRA forms
// peft gives it, whether its config may scale RoPE). runtime/ asks ModelConfig, which reads its
// row; nothing outside models/ names an Arch.
//
// Adding a family: a row in families() (models/arch.cpp), its config.json fields in
// models/hf_config.cpp, and its block code where it differs from the shared decoder.
#pragma once

#include <array>
#include <string>
#include <string_view>
#include <vector>

namespace eo::model {

enum class Arch { Qwen3Moe, Olmoe, Mixtral, Qwen2Moe, Glm4Moe, DeepseekV2, DeepseekV3, GptOss, Glm4MoeLite, Mistral4, Gemma4, Llama4 };

struct Family {
  Arch arch;
  const char* model_type;  // config.json's model_type of the text model
  // The HF module names, under a decoder layer's prefix.
  const char* moe_block;      // the MoE block ("mlp", Mixtral's "block_sparse_moe", Llama 4's "feed_forward")
  const char* experts;        // the routed experts' module
  const char* router;         // the router
  const char* shared_expert;  // the shared expert(s), under the MoE block (where the config has any)
  // The routed experts' per-expert linears as peft names them: gate, up, down (Mixtral: w1, w3, w2).
  std::array<const char*, 3> expert_linears;
  // peft reaches the routed experts as modules, one per expert (experts.{e}.gate_proj ...): not
  // where transformers 5 holds the experts only fused (gpt-oss, Gemma 4, Llama 4).
  bool per_expert_lora;
  // lora_target_parameters is implemented: the experts fused as transformers 5 holds them,
  // gate_up_proj [E, 2I, H] and down_proj [E, H, I], under fused_experts.
  bool fused_expert_lora;
  const char* fused_experts;  // the module peft's ParamWrapper adapts ("mlp.experts", Gemma 4's "experts")
  // config.json's rope_scaling / rope_parameters and partial_rotary_factor are read (the families
  // whose transformers classes read them); the others refuse a scaling type or a partial rotation.
  bool rope_scaling;
  bool latent_attention;  // DeepSeek's multi-head latent attention (MLA)
};

const std::vector<Family>& families();
const Family& family(Arch arch);
// The row of a text model_type; nullptr when no family has it.
const Family* find_family(std::string_view model_type);
// Every per-expert linear name some family has (gate_proj, up_proj, down_proj, w1, w3, w2).
const std::vector<std::string>& expert_linear_names();

}  // namespace eo::model
