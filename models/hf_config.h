// Hugging Face config.json → one ModelConfig for the supported MoE architectures.
//
// The four families (qwen3_moe, olmoe, mixtral, qwen2_moe) share a decoder and differ in a few
// switches (q/k norm style, biases, shared expert, which layers are sparse); this struct holds
// exactly those switches so the decoder never looks at model_type strings again.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace eo::model {

enum class Arch { Qwen3Moe, Olmoe, Mixtral, Qwen2Moe };

// How the attention block normalises q and k.
enum class QkNorm {
  None,      // mixtral, qwen2_moe
  PerHead,   // qwen3_moe: RMSNorm(head_dim) after the view into heads
  Whole,     // olmoe: RMSNorm over the whole projection before the split
};

struct ModelConfig {
  Arch arch = Arch::Qwen3Moe;
  std::string model_type;
  std::int64_t hidden = 0;
  std::int64_t layers = 0;
  std::int64_t heads = 0;
  std::int64_t kv_heads = 0;
  std::int64_t head_dim = 0;  // explicit, else hidden / heads
  std::int64_t vocab = 0;
  double rms_eps = 1e-6;
  double rope_theta = 10000.0;
  std::int64_t experts = 0;
  std::int64_t top_k = 0;
  std::int64_t expert_width = 0;         // per-expert intermediate size
  std::int64_t dense_width = 0;          // intermediate_size of dense MLP layers (0 = none)
  std::int64_t shared_expert_width = 0;  // qwen2_moe shared expert (0 = none)
  bool norm_topk_prob = false;           // renormalise the top-k probabilities (mixtral: always)
  int decoder_sparse_step = 1;
  std::vector<int> mlp_only_layers;
  bool tie_word_embeddings = false;
  double router_aux_loss_coef = 0.0;
  double initializer_range = 0.02;  // std of random init (synthetic weights)
  double router_jitter_noise = 0.0;  // mixtral, training only; not applied (warned by callers)
  std::optional<double> clip_qkv;    // olmoe
  bool qkv_bias = false;             // bias on q/k/v projections (qwen2_moe)
  QkNorm qk_norm = QkNorm::None;

  bool is_moe_layer(int layer) const;
  // The HF name prefix of a layer's MoE block: "mlp" or Mixtral's "block_sparse_moe".
  std::string moe_prefix() const { return arch == Arch::Mixtral ? "block_sparse_moe" : "mlp"; }
};

// `source` names the file in error messages.
ModelConfig parse_config(const nlohmann::json& j, const std::string& source);
ModelConfig load_config(const std::string& model_dir);  // reads DIR/config.json

}  // namespace eo::model
