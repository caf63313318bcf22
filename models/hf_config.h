// Hugging Face config.json → one ModelConfig for the supported MoE architectures.
//
// The families (qwen3_moe, olmoe, mixtral, qwen2_moe, glm4_moe, deepseek_v2, deepseek_v3, gpt_oss,
// glm4_moe_lite, mistral4, gemma4, llama4, qwen3_next, qwen3_5_moe, minimax_m2, ernie4_5_moe, hunyuan_v1_moe) share a decoder and differ in a few switches (q/k norm style, biases,
// shared experts, which layers are sparse, the router's scoring, partial / interleaved / YaRN RoPE,
// DeepSeek's latent attention, Mistral 4's position-scaled queries, gpt-oss's attention sinks,
// sliding-window layers and biased, clamped experts);
// this struct holds exactly those switches so the decoder never looks at model_type strings again.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "models/arch.h"

namespace eo::model {

// The families' Arch and their rows (module names, LoRA forms): models/arch.h. Glm4MoeLite
// (GLM-4.7-Flash) and Mistral4 (Mistral Small 4) are DeepSeek-V3's latent attention with GLM-4.5's
// router, and with a softmax group-limited router and Llama 4's query scaling; Gemma4 is Gemma 4's
// MoE text model (26B-A4B, Gemma4Block below); Llama4 is Llama 4's text model (Llama4Block below).

// The names config.json's model_type takes, comma separated (error messages): the table's text
// models and the multimodal wrappers around them.
const std::string& supported_model_types();

// How the attention block normalises q and k.
enum class QkNorm {
  None,      // mixtral, qwen2_moe
  PerHead,   // qwen3_moe: RMSNorm(head_dim) after the view into heads
  Whole,     // olmoe: RMSNorm over the whole projection before the split
  L2,        // llama4 use_qk_norm: a weightless RMSNorm per head after RoPE, on the RoPE layers only
};

// RoPE as transformers' rotary embeddings compute it (rope_parameters / rope_scaling).
struct Rope {
  std::int64_t dim = 0;      // rotated dims of each q/k head: head_dim × partial_rotary_factor; MLA: qk_rope_head_dim
  bool interleaved = false;  // DeepSeek: pairs (x0, x1), (x2, x3), ... rotate together, not the two halves
  bool yarn = false;         // rope_type "yarn": blended inv_freq and cos/sin × attention_factor
  double factor = 1.0, beta_fast = 32.0, beta_slow = 1.0;
  double original_max_positions = 0;
  bool truncate = true;
  double attention_factor = 1.0;  // cos and sin are multiplied by it
  // Gemma 4's "proportional" RoPE: the whole head is rotated (dim = head_dim), but only the first
  // `pairs` frequencies are non-zero (the rest: cos 1, sin 0), each ÷ factor. 0 = off.
  std::int64_t proportional_pairs = 0;
  // rope_type "llama3" (_compute_llama3_parameters): wavelengths above original / low_freq_factor
  // ÷ factor, below original / high_freq_factor kept, smoothed between.
  bool llama3 = false;
  double low_freq_factor = 1.0, high_freq_factor = 4.0;
};

// How the router turns logits into the top-k experts and their weights.
// SoftmaxTopK (gpt-oss): top-k of the logits, then a softmax over those k only.
enum class RouterScore { Softmax, Sigmoid, SoftmaxTopK };
// Group-limited routing: experts fall into n_group groups; only the topk_group best groups
// compete. A group's score: its best expert (DeepSeek-V2 group_limited_greedy) or the sum of its
// two best (DeepSeek-V3 / GLM-4.5 noaux_tc).
enum class GroupScore { None, Max, TopTwoSum };
struct Router {
  RouterScore score = RouterScore::Softmax;
  bool correction_bias = false;  // e_score_correction_bias: added to the scores for the choice only
  GroupScore group = GroupScore::None;
  std::int64_t n_group = 1, topk_group = 1;
  double scaling = 1.0;  // routed_scaling_factor, on the final weights
  bool fp32 = false;     // weight and logits in fp32 whatever the compute dtype (transformers keeps gate.weight fp32)
  bool bias = false;     // a bias on the router linear (gpt-oss)
};

// gpt-oss's expert activation: (clamp(up, ±limit) + 1) · g · sigmoid(alpha · g), g = min(gate, limit).
struct SwigluClamp {
  double alpha = 1.702, limit = 7.0;
};

// Gemma 4's block (Gemma4TextDecoderLayer): norms after attention and after each feed-forward
// (post_attention / pre_ / post_feedforward_layernorm), a dense MLP beside the routed experts on
// every layer (pre_feedforward_layernorm → mlp → post_feedforward_layernorm_1, and
// pre_feedforward_layernorm_2 → experts → post_feedforward_layernorm_2, summed), the router on the
// un-normed residual (scale-free RMSNorm, × scale × hidden^-1/2, softmax, top-k renormalised, ×
// per_expert_scale), q/k norms per head and a scale-free v norm, softmax scale 1, and its
// full-attention layers with their own head_dim / key-value heads (attention_k_eq_v: no v_proj,
// the values are k_proj's output) and RoPE table. Each layer's output × its layer_scalar.
struct Gemma4Block {
  std::int64_t full_head_dim = 0, full_kv_heads = 0;
  bool k_eq_v = false;  // full layers only
  Rope full_rope;
  double full_rope_theta = 0;
};

// Llama 4's attention and MoE (Llama4TextAttention / Llama4TextMoe): RoPE (interleaved pairs) on
// some layers only, the others (NoPE) scale their queries by 1 + attn_scale · log1p(floor((pos + 1)
// / floor_scale)) when attn_temperature_tuning is on; the RoPE layers may attend within chunks of
// attention_chunk_size positions (layer_types "chunked_attention") and L2-norm q and k
// (QkNorm::L2). The router's sigmoid top-k score scales each expert's input, not its output.
struct Llama4Block {
  std::vector<bool> rope_layers;    // per layer: RoPE (no_rope_layers 1), else NoPE
  std::vector<bool> chunked_layers;  // per layer: chunked attention
  std::int64_t chunk = 0;            // attention_chunk_size; 0 = none
  bool temperature_tuning = false;
  double floor_scale = 8192, attn_scale = 0.1;
};

// Qwen3-Next's and Qwen3.5's gated delta-rule layers (Qwen3NextGatedDeltaNet, Qwen3_5MoeGatedDeltaNet):
// the input projections (Qwen3-Next: in_proj_qkvz and in_proj_ba, grouped per key head; Qwen3.5:
// in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, each contiguous), a depthwise causal conv1d of
// conv_kernel taps over [q; k; v] and SiLU, L2-normalised q and k, the gated delta rule
// (models/delta_rule.h) with log decay -exp(A_log) · softplus(a + dt_bias) and write strength
// sigmoid(b), the gated RMSNorm (weight × norm(o) × silu(z), per value head) and out_proj.
struct LinearAttention {
  std::int64_t k_heads = 0, v_heads = 0, k_dim = 0, v_dim = 0, conv_kernel = 0;
  bool split_projections = false;  // Qwen3.5's four in_proj_* (else Qwen3-Next's two fused ones)
  std::vector<bool> layers;        // per layer: linear attention (layer_types "linear_attention")
  std::int64_t key_width() const { return k_heads * k_dim; }
  std::int64_t value_width() const { return v_heads * v_dim; }
  std::int64_t conv_width() const { return 2 * key_width() + value_width(); }
};

// The activation of the MLPs and experts between gate and up: silu (SwiGLU) or GELU's tanh
// approximation (Gemma: gelu_pytorch_tanh).
enum class Activation { Silu, GeluTanh };

// Multi-head latent attention (DeepSeek-V2/V3): q (optionally through a low-rank q_a → norm →
// q_b) and one compressed kv latent per token (kv_a_proj_with_mqa → norm → kv_b_proj), with the
// RoPE part of each key shared by all heads.
struct Mla {
  std::int64_t q_lora_rank = 0;  // 0: a full q_proj (DeepSeek-V2-Lite)
  std::int64_t kv_lora_rank = 0;
  std::int64_t nope_dim = 0, rope_dim = 0, v_dim = 0;  // qk_nope_head_dim, qk_rope_head_dim, v_head_dim
  std::int64_t qk_dim() const { return nope_dim + rope_dim; }
};

// A multimodal checkpoint around a text model eo-ddp trains (transformers' *ForConditionalGeneration):
// config.json is the wrapper's, with the text model's config as text_config. One row per wrapper
// (multimodal_wrappers()).
struct MultimodalWrapper {
  // Where a checkpoint stores the text decoder's tensors and lm_head.
  struct Layout {
    std::string decoder;  // "model.language_model." (then embed_tokens.weight, layers.N. ...)
    std::string lm_head;  // "lm_head.weight"
  };
  std::string model_type;         // the wrapper's config.json model_type: "gemma4", "mistral3", "llama4"
  std::string text_model_type;    // the text_config model_type eo-ddp trains inside it: "gemma4_text", "mistral4"
  std::string text_type_default;  // transformers' text_config model_type when the file names none
  std::string class_name;         // "Gemma4ForConditionalGeneration"
  // The decoder's module path in transformers' model, which peft names the adapter by.
  std::string decoder_prefix;
  // The checkpoint layouts transformers loads, the first whose embeddings a checkpoint has is used.
  std::vector<Layout> layouts;
  // The wrapper config's tie_word_embeddings when absent (transformers ties lm_head by the
  // wrapper's flag, not text_config's).
  bool tie_default = true;
  std::string towers = "vision tower";  // what it holds beside the text model, none of it loaded (the log says)
};
// Every wrapper eo-ddp reads, in one table.
const std::vector<MultimodalWrapper>& multimodal_wrappers();

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
  std::int64_t shared_expert_width = 0;  // shared expert(s), summed width (0 = none)
  bool shared_expert_gated = false;      // qwen2_moe: sigmoid(shared_expert_gate(x)) × shared expert
  bool norm_topk_prob = false;           // renormalise the top-k probabilities (mixtral: always)
  int decoder_sparse_step = 1;
  std::vector<int> mlp_only_layers;
  int first_k_dense = 0;  // first_k_dense_replace: layers below it are dense
  bool tie_word_embeddings = false;
  double router_aux_loss_coef = 0.0;
  double initializer_range = 0.02;  // std of random init (synthetic weights)
  double router_jitter_noise = 0.0;  // mixtral, training only; not applied (warned by callers)
  std::optional<double> clip_qkv;    // olmoe
  bool qkv_bias = false;             // bias on q/k/v projections (qwen2_moe, glm4_moe); MLA: q_a / kv_a
  bool o_bias = false;               // bias on o_proj (DeepSeek attention_bias)
  bool mlp_bias = false;             // bias on dense and shared-expert MLP linears (deepseek_v2 mlp_bias)
  QkNorm qk_norm = QkNorm::None;
  bool qk_norm_after_rope = false;  // Hunyuan: the PerHead norms of q and k after RoPE, not before
  Rope rope;
  double attn_scale = 0;  // softmax scale: 1/sqrt(qk head dim), DeepSeek YaRN × mscale²
  // Mistral 4 (transformers' get_llama_4_attn_scale): every query × 1 + beta · log(1 + floor(
  // position / llama4_positions)), which is exactly 1 below llama4_positions; beta 0 = off.
  double llama4_beta = 0, llama4_positions = 0;
  Router router;
  std::optional<Mla> mla;
  // transformers computes the load-balancing aux loss for this family (glm4_moe and DeepSeek
  // balance with e_score_correction_bias / not at all in training and return none).
  bool has_aux_loss = true;
  // gpt-oss: a learned per-head sink logit in every attention softmax, sliding-window layers
  // (each attends to the last sliding_window positions, itself included), expert biases and the
  // clamped activation.
  bool attention_sinks = false;
  std::int64_t sliding_window = 0;
  std::vector<bool> sliding_layers;  // per layer; empty = none
  bool expert_bias = false;
  std::optional<SwigluClamp> swiglu_clamp;
  // The checkpoint stores its experts in MXFP4 (quantization_config.quant_method "mxfp4": gpt-oss
  // as the Hub ships it), so with load_in_4bit they can stay in that format (models/mxfp4.h).
  bool mxfp4_experts = false;
  // A modelopt NVFP4 checkpoint (quantization_config.quant_method "modelopt", quant_algo "NVFP4",
  // or hf_quant_config.json): its quantised linears are NVFP4 (models/nvfp4.h), the routed experts
  // held so.
  bool nvfp4 = false;
  Activation act = Activation::Silu;
  std::optional<Gemma4Block> gemma;
  std::optional<Llama4Block> llama4;
  std::optional<LinearAttention> linear_attn;  // Qwen3-Next, Qwen3.5-MoE
  // Every RMSNorm of the decoder (layer norms, q/k norms, the final norm) scales by 1 + weight
  // (Qwen3NextRMSNorm's zero-centred weights): the loader adds the 1 once.
  bool norm_plus_one = false;
  // The full-attention layers' q_proj gives each head its query and a gate (2 · head_dim), and the
  // attention output is × sigmoid(gate) before o_proj (Qwen3NextAttention).
  bool attn_output_gate = false;
  double final_logit_softcap = 0;  // logits = cap · tanh(logits / cap); 0 = off (Gemma)
  bool embed_scaled = false;       // embeddings × sqrt(hidden_size) in the compute dtype (Gemma)
  // The checkpoint is a multimodal model around this text model (Gemma4ForConditionalGeneration,
  // Mistral3ForConditionalGeneration): its decoder is under the wrapper's decoder prefix, its
  // vision / audio towers are not loaded or trained. model_type is then the wrapper's.
  std::optional<MultimodalWrapper> multimodal;
  // The wrapper's other towers, as its config.json names them (vision_config, audio_config), for
  // the log: "vision tower", "vision and audio towers".
  std::string other_towers;

  bool is_moe_layer(int layer) const;
  std::vector<int> moe_layer_ids() const;  // the layers is_moe_layer selects, in order
  int moe_layer_count() const { return static_cast<int>(moe_layer_ids().size()); }
  // Where the decoder's tensors are: "model." or, in a multimodal checkpoint, its wrapper's prefix.
  std::string decoder_prefix() const { return multimodal ? multimodal->decoder_prefix : "model."; }
  // Llama 4: whether layer i rotates q and k (else NoPE) and attends within chunks.
  bool uses_rope(int layer) const { return !llama4 || llama4->rope_layers.at(layer); }
  bool is_chunked_layer(int layer) const { return llama4 && llama4->chunk > 0 && llama4->chunked_layers.at(layer); }
  // Gemma 4's full-attention layers have their own attention geometry.
  bool is_full_gemma_layer(int layer) const { return gemma && !is_sliding_layer(layer); }
  std::int64_t head_dim_at(int layer) const { return is_full_gemma_layer(layer) ? gemma->full_head_dim : head_dim; }
  std::int64_t kv_heads_at(int layer) const { return is_full_gemma_layer(layer) ? gemma->full_kv_heads : kv_heads; }
  bool has_v_proj(int layer) const { return !(is_full_gemma_layer(layer) && gemma->k_eq_v); }
  // Qwen3-Next / Qwen3.5: whether layer i is a gated delta-rule layer (linear_attn.*), else full attention.
  bool is_linear_attention_layer(int layer) const { return linear_attn && linear_attn->layers.at(layer); }
  // Whether every layer has a dense MLP beside its routed experts (Gemma 4).
  bool dense_beside_experts() const { return gemma.has_value(); }
  // This family's row of the architecture table (models/arch.h).
  const Family& family() const { return ::eo::model::family(arch); }
  // The HF name prefix of a layer's MoE block: "mlp", Mixtral's "block_sparse_moe", Llama 4's "feed_forward".
  std::string moe_prefix() const { return family().moe_block; }
  // The HF name of a layer's dense MLP: "mlp", Llama 4 "feed_forward" (its MoE block too).
  std::string mlp_prefix() const { return family().dense_mlp; }
  // Where the routed experts are under a layer's prefix: "<moe prefix>.experts", Gemma 4 "experts".
  std::string experts_path() const { return family().experts; }
  // The module transformers 5 holds the fused expert parameters in, under a layer's prefix (peft's
  // ParamWrapper path, lora_target_parameters): "mlp.experts" (Mixtral's too), Gemma 4 "experts".
  std::string fused_experts_path() const { return family().fused_experts; }
  // The router's module under a layer's prefix: "mlp.gate", gpt-oss "mlp.router", Gemma 4 "router.proj".
  std::string router_path() const { return family().router; }
  bool is_sliding_layer(int layer) const { return !sliding_layers.empty() && sliding_layers.at(layer) && sliding_window > 0; }
  // Whether peft names the routed experts per expert (experts.{e}.gate_proj ...): not for gpt-oss,
  // Gemma 4 and Llama 4, whose experts exist only fused.
  bool experts_lora_ok() const { return family().per_expert_lora; }
  // Whether lora_target_parameters reaches the fused experts (gate_up_proj, down_proj; Family::fused_layout).
  bool fused_expert_lora_ok() const { return family().fused_expert_lora; }
  // The routed experts' per-expert linears as peft names them: gate, up, down (Mixtral's w1, w3, w2).
  std::array<std::string, 3> expert_linears() const {
    const auto& n = family().expert_linears;
    return {n[0], n[1], n[2]};
  }
  // The shared expert's module under the MoE block: qwen2_moe and Llama 4 "shared_expert", else "shared_experts".
  std::string shared_expert_name() const { return family().shared_expert; }
  // The attention linears (peft's short names, in model order) and their shapes.
  struct Linear {
    std::string name;
    std::int64_t in = 0, out = 0;
    std::string module = "self_attn";  // its parent under the layer: self_attn, or linear_attn (delta-rule layers)
  };
  // Of one layer (Gemma 4's full layers differ: their own head_dim and key-value heads, no v_proj
  // with attention_k_eq_v); attention_linears: every name some layer has, in model order.
  std::vector<Linear> attention_shapes(int layer = 0) const;
  std::vector<std::string> attention_linears() const;
  // Every LoRA-able linear's short name (attention, then MLP / expert matrices): what
  // lora_target_linear selects.
  std::vector<std::string> linear_modules() const;
};

// Every linear short name some supported family has (what lora_target_modules may name).
const std::vector<std::string>& all_linear_modules();

// `source` names the file in error messages.
ModelConfig parse_config(const nlohmann::json& j, const std::string& source);
ModelConfig load_config(const std::string& model_dir);  // reads DIR/config.json
// DIR/config.json as load_config reads it (with a modelopt export's hf_quant_config.json folded in
// as quantization_config), before parse_config.
nlohmann::json read_config_json(const std::string& model_dir);

}  // namespace eo::model
