// The architecture table: one row per model family, holding every fact about a family that code
// outside its block may know (module and expert names, where the router sits, which LoRA forms
// peft gives it, whether its config may scale RoPE). runtime/ asks ModelConfig, which reads its
// row; nothing outside models/ names an Arch.
//
// Adding a family (docs/contributing.md lists every file): a row in families() (models/arch.cpp),
// its config reader in models/family_config.cpp, its block code where it differs from the shared
// decoder (models/moe_model.cpp) and that block's extra bytes in models/block_memory.cpp.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "models/fused_expert_layout.h"

namespace eo::model {

struct ConfigFields;
struct ModelConfig;
struct MultimodalWrapper;

// How q and k rotate their RoPE pairs: the two halves of the rotated dims (x_i, x_{i+d/2}), or
// adjacent pairs (x0, x1), (x2, x3), ... (DeepSeek-V2 always; the others' rope_interleave, default true).
enum class RopePairs { Halves, Interleaved, InterleavedByDefault };
// How the family's checkpoints store the routed experts: per expert (experts.{e}.gate_proj ...)
// or fused as transformers 5 holds them, or gpt-oss's own: gate_up_proj transposed [E, H, 2I]
// with gate and up interleaved, down_proj [E, I, H], float or MXFP4 as the Hub ships it (never
// per expert).
enum class ExpertStorage { Standard, GptOss };

enum class Arch { Qwen3Moe, Olmoe, Mixtral, Qwen2Moe, Glm4Moe, DeepseekV2, DeepseekV3, GptOss, Glm4MoeLite, Mistral4, Gemma4, Llama4, Qwen3Next, Qwen35Moe, MinimaxM2, Ernie45Moe, HunyuanV1Moe };

struct Family {
  Arch arch;
  const char* model_type;  // config.json's model_type of the text model
  // The HF module names, under a decoder layer's prefix.
  const char* moe_block;      // the MoE block ("mlp", Mixtral's "block_sparse_moe", Llama 4's "feed_forward")
  const char* dense_mlp;      // a dense layer's MLP, and Gemma 4's beside its experts ("mlp", Llama 4's "feed_forward")
  const char* experts;        // the routed experts' module
  const char* router;         // the router
  const char* shared_expert;  // the shared expert(s), under the MoE block (where the config has any)
  // The routed experts' per-expert linears as peft names them: gate, up, down (Mixtral: w1, w3, w2).
  std::array<const char*, 3> expert_linears;
  // peft reaches the routed experts as modules, one per expert (experts.{e}.gate_proj ...): not
  // where transformers 5 holds the experts only fused (gpt-oss, Gemma 4, Llama 4).
  bool per_expert_lora;
  // lora_target_parameters is implemented: peft's ParamWrapper on the experts' gate_up_proj and
  // down_proj as transformers 5 holds them, under fused_experts, in fused_layout.
  bool fused_expert_lora;
  const char* fused_experts;  // the module peft's ParamWrapper adapts ("mlp.experts", Gemma 4's "experts")
  // Where peft's lora_A / lora_B sit on those parameters: {} for transformers' [E, 2I, H] /
  // [E, H, I] (gate the first half of 2I); gpt-oss's and Llama 4's differ (fused_expert_layout.h).
  FusedExpertLayout fused_layout;
  // config.json's rope_scaling / rope_parameters and partial_rotary_factor are read (the families
  // whose transformers classes read them); the others refuse a scaling type or a partial rotation.
  bool rope_scaling;
  bool latent_attention;  // DeepSeek's multi-head latent attention (MLA)
  // config.json read as the family's transformers config class reads it: its defaults where a
  // key is absent, and what it reads at all.
  double rms_eps;               // rms_norm_eps
  std::int64_t head_dim;        // head_dim (0: hidden_size / num_attention_heads)
  double router_aux_loss_coef;  // router_aux_loss_coef
  bool reads_hidden_act;        // hidden_act (silu only); gpt-oss's experts have their own activation
  double partial_rotary;        // partial_rotary_factor
  // Latent attention whose partial_rotary_factor applies to the whole (nope + rope) qk head
  // (Mistral 4; its default then rotates qk_rope_head_dim), not to qk_rope_head_dim.
  bool rotary_over_qk_head;
  RopePairs rope_pairs;
  // Mistral 4: its queries scaled by rope_parameters' llama_4_scaling_beta (transformers'
  // get_llama_4_attn_scale), with the YaRN RoPE it ships, which its config must spell out.
  bool query_position_scaling;
  ExpertStorage expert_storage;
  // The family's own reading (models/family_config.h): the MoE block's fields after the shared
  // attention reading, or (parse_whole, then read_moe is null) the whole config.
  void (*read_moe)(const ConfigFields& f, ModelConfig& c);
  ModelConfig (*parse_whole)(const nlohmann::json& j, const std::string& source, const MultimodalWrapper* wrapper);
  // Where a router's e_score_correction_bias sits under a layer; null: under the router
  // (<router>.e_score_correction_bias), MiniMax-M2's beside it in the MoE block, ERNIE-4.5's in
  // the block's moe_statics ([1, E]: one row per expert group, of which it has one).
  const char* correction_bias = nullptr;
  // The per-head q/k norms' modules under self_attn (Hunyuan's query_layernorm / key_layernorm).
  const char* q_norm = "q_norm";
  const char* k_norm = "k_norm";
  // rope type "dynamic" with a fixed alpha is NTK-alpha RoPE: the base × alpha^(d / (d - 2)), d the
  // head_dim, whatever the length (transformers' HunYuanDenseV1RotaryEmbedding "ntk_alpha").
  bool rope_ntk_alpha = false;
};

const std::vector<Family>& families();
const Family& family(Arch arch);
// The row of a text model_type; nullptr when no family has it.
const Family* find_family(std::string_view model_type);
// Every per-expert linear name some family has (gate_proj, up_proj, down_proj, w1, w3, w2).
const std::vector<std::string>& expert_linear_names();

}  // namespace eo::model
