#include "models/family_config.h"

#include <set>

namespace eo::model {
namespace {

// The group-limited top-k parameters (n_group, topk_group) of a router that has them.
void parse_groups(const ConfigFields& f, ModelConfig& c, std::int64_t n_group, std::int64_t topk_group, GroupScore score) {
  Router& r = c.router;
  r.n_group = f.integer("n_group", n_group);
  r.topk_group = f.integer("topk_group", topk_group);
  require_positive(r.n_group, "n_group", f.source);
  require_positive(r.topk_group, "topk_group", f.source);
  if (c.experts % r.n_group != 0 || r.topk_group > r.n_group)
    throw UsageError(f.source + ": n_group (" + std::to_string(r.n_group) + ") must divide the number of experts (" +
                     std::to_string(c.experts) + ") and be at least topk_group (" + std::to_string(r.topk_group) + ")");
  if (score == GroupScore::TopTwoSum && c.experts / r.n_group < 2)
    throw UsageError(f.source + ": each of the n_group groups needs at least two experts (the group score sums its best two)");
  // One group is every expert: the mask selects all of them, so skip the work.
  r.group = r.n_group > 1 ? score : GroupScore::None;
}

// glm4_moe_lite's layer kinds: mlp_layer_types ("dense" / "sparse" per layer; transformers' default
// is layer 0 dense, the rest sparse). Its config class has no first_k_dense_replace, so one that
// disagrees with the layers transformers builds is refused rather than followed.
void parse_mlp_layer_types(const ConfigFields& f, ModelConfig& c) {
  std::vector<bool> dense;
  if (f.has("mlp_layer_types")) {
    const nlohmann::json& lt = f.j.at("mlp_layer_types");
    if (!lt.is_array() || static_cast<std::int64_t>(lt.size()) != c.layers)
      throw UsageError(f.source + ": mlp_layer_types must be a list of num_hidden_layers (" + std::to_string(c.layers) +
                       ") strings, \"dense\" or \"sparse\"");
    for (const auto& t : lt) {
      if (t != "dense" && t != "sparse")
        throw UsageError(f.source + ": mlp_layer_types entry " + t.dump() + " is not supported (dense, sparse)");
      dense.push_back(t == "dense");
    }
  } else {
    for (int l = 0; l < c.layers; ++l) dense.push_back(l == 0);
  }
  if (f.has("first_k_dense_replace")) {
    const int k = f.small_integer("first_k_dense_replace", 0);
    int leading = 0;
    while (leading < c.layers && dense[leading]) ++leading;
    bool rest_sparse = true;
    for (int l = leading; l < c.layers; ++l) rest_sparse = rest_sparse && !dense[l];
    if (k != leading || !rest_sparse)
      throw UsageError(f.source + ": first_k_dense_replace " + std::to_string(k) + " disagrees with the dense layers "
                       "transformers builds for glm4_moe_lite (from " +
                       std::string(f.has("mlp_layer_types") ? "mlp_layer_types" : "its default: layer 0 only") +
                       "); set mlp_layer_types to the layers the checkpoint has");
  }
  for (int l = 0; l < c.layers; ++l)
    if (dense[l]) c.mlp_only_layers.push_back(l);
}

}  // namespace

namespace {

// transformers 5 writes num_local_experts for qwen3_moe and olmoe; Hub configs have num_experts.
std::int64_t experts_count(const ConfigFields& f) {
  return f.has("num_local_experts") ? f.integer("num_local_experts") : f.integer("num_experts");
}

// The latent-attention families and GLM-4.5: transformers' config classes' defaults (used when a
// key is absent).
struct LatentDefaults {
  std::int64_t experts, top_k, shared;
  int first_k_dense;
  double scaling;
  std::int64_t n_group, topk_group;
};

// What DeepSeek-V2/V3, GLM-4.5 (-Air), GLM-4.7-Flash and Mistral 4 read alike; each reads its
// router after it.
void read_deepseek_like(const ConfigFields& f, ModelConfig& c, const LatentDefaults& d, bool layer_types) {
  // transformers 5 saves n_routed_experts; num_local_experts / num_experts are its aliases.
  c.experts = f.has("n_routed_experts") ? f.integer("n_routed_experts")
              : f.has("num_local_experts") ? f.integer("num_local_experts") : f.integer("num_experts", d.experts);
  c.top_k = f.integer("num_experts_per_tok", d.top_k);
  c.expert_width = f.integer("moe_intermediate_size");
  c.dense_width = f.integer("intermediate_size", 0);
  c.shared_expert_width = c.expert_width * f.integer("n_shared_experts", d.shared);
  if (layer_types) {
    parse_mlp_layer_types(f, c);
  } else {
    c.first_k_dense = f.small_integer("first_k_dense_replace", d.first_k_dense);
    if (c.first_k_dense < 0) throw UsageError(f.source + ": first_k_dense_replace must be >= 0");
  }
  require_value(f, "moe_layer_freq", "1", "transformers makes every layer from first_k_dense_replace on sparse");
  c.has_aux_loss = false;
  c.router.fp32 = true;
  c.router.scaling = f.number("routed_scaling_factor", d.scaling);
}

// DeepSeek-V3's router (noaux_tc): sigmoid scores with the correction bias, groups by their best two.
void read_noaux_router(const ConfigFields& f, ModelConfig& c, const LatentDefaults& d) {
  c.norm_topk_prob = f.boolean("norm_topk_prob", true);
  require_value(f, "scoring_func", "\"sigmoid\"", c.model_type + " routes on sigmoid scores");
  require_value(f, "topk_method", "\"noaux_tc\"", c.model_type + " routes with the correction bias (noaux_tc)");
  c.router.score = RouterScore::Sigmoid;
  c.router.correction_bias = true;
  parse_groups(f, c, d.n_group, d.topk_group, GroupScore::TopTwoSum);
}

}  // namespace

void read_qwen3_moe(const ConfigFields& f, ModelConfig& c) {
  c.experts = experts_count(f);
  c.top_k = f.integer("num_experts_per_tok");
  c.expert_width = f.integer("moe_intermediate_size");
  c.dense_width = f.integer("intermediate_size", 0);
  c.norm_topk_prob = f.boolean("norm_topk_prob", false);
  c.decoder_sparse_step = f.small_integer("decoder_sparse_step", 1);
  c.mlp_only_layers = f.int_list("mlp_only_layers");
  c.qkv_bias = f.boolean("attention_bias", false);
  c.qk_norm = QkNorm::PerHead;
}

void read_olmoe(const ConfigFields& f, ModelConfig& c) {
  c.experts = experts_count(f);
  c.top_k = f.integer("num_experts_per_tok");
  c.expert_width = f.integer("intermediate_size");
  c.norm_topk_prob = f.boolean("norm_topk_prob", false);
  c.qkv_bias = f.boolean("attention_bias", false);
  if (f.has("clip_qkv")) c.clip_qkv = f.number("clip_qkv");
  c.qk_norm = QkNorm::Whole;
}

void read_mixtral(const ConfigFields& f, ModelConfig& c) {
  c.experts = f.integer("num_local_experts");
  c.top_k = f.integer("num_experts_per_tok");
  c.expert_width = f.integer("intermediate_size");
  c.norm_topk_prob = true;  // Mixtral always renormalises the top-k
  c.router_jitter_noise = f.number("router_jitter_noise", 0.0);
}

void read_qwen2_moe(const ConfigFields& f, ModelConfig& c) {
  c.experts = experts_count(f);
  c.top_k = f.integer("num_experts_per_tok");
  c.expert_width = f.integer("moe_intermediate_size");
  c.dense_width = f.integer("intermediate_size", 0);
  c.shared_expert_width = f.integer("shared_expert_intermediate_size", 0);
  c.shared_expert_gated = true;
  c.norm_topk_prob = f.boolean("norm_topk_prob", false);
  c.decoder_sparse_step = f.small_integer("decoder_sparse_step", 1);
  c.mlp_only_layers = f.int_list("mlp_only_layers");
  c.qkv_bias = f.boolean("qkv_bias", true);
}

void read_glm4_moe(const ConfigFields& f, ModelConfig& c) {
  const LatentDefaults d{128, 8, 1, 1, 1.0, 1, 1};
  read_deepseek_like(f, c, d, /*layer_types=*/false);
  read_noaux_router(f, c, d);
  c.qkv_bias = f.boolean("attention_bias", false);
  if (f.boolean("use_qk_norm", false)) c.qk_norm = QkNorm::PerHead;
}

void read_deepseek_v2(const ConfigFields& f, ModelConfig& c) {
  read_deepseek_like(f, c, {64, 0, 2, 0, 1.0, 1, 1}, /*layer_types=*/false);
  // transformers' DeepseekV2 router never renormalises; DeepSeek's own code does when
  // norm_topk_prob is set. The two disagree, so a config asking for it is refused.
  if (f.boolean("norm_topk_prob", false))
    throw UsageError(f.source + ": norm_topk_prob true is not supported for deepseek_v2 (transformers ignores it, "
                     "DeepSeek's reference code renormalises; the weights would differ)");
  require_value(f, "scoring_func", "\"softmax\"", "deepseek_v2 routes on softmax scores");
  const std::string method = text(f, "topk_method", "greedy");
  c.router.score = RouterScore::Softmax;
  if (method == "group_limited_greedy") parse_groups(f, c, 1, 1, GroupScore::Max);
  else if (method != "greedy")
    throw UsageError(f.source + ": topk_method '" + method + "' is not supported for deepseek_v2 (greedy, group_limited_greedy)");
  c.mlp_bias = f.boolean("mlp_bias", false);
  c.qkv_bias = c.o_bias = f.boolean("attention_bias", false);
}

void read_deepseek_v3(const ConfigFields& f, ModelConfig& c) {
  const LatentDefaults d{256, 8, 1, 3, 2.5, 8, 4};
  read_deepseek_like(f, c, d, /*layer_types=*/false);
  read_noaux_router(f, c, d);
  c.qkv_bias = c.o_bias = f.boolean("attention_bias", false);
}

void read_glm4_moe_lite(const ConfigFields& f, ModelConfig& c) {
  const LatentDefaults d{64, 4, 1, 1, 1.8, 1, 1};
  read_deepseek_like(f, c, d, /*layer_types=*/true);
  read_noaux_router(f, c, d);
  c.qkv_bias = c.o_bias = f.boolean("attention_bias", false);
}

void read_mistral4(const ConfigFields& f, ModelConfig& c) {
  const LatentDefaults d{128, 4, 1, 0, 1.0, 1, 1};
  read_deepseek_like(f, c, d, /*layer_types=*/false);
  c.router.fp32 = false;  // Mistral4's router runs in the compute dtype (no fp32-kept modules)
  // Mistral4TopkRouter: softmax scores, groups by their best two, no correction bias.
  c.norm_topk_prob = f.boolean("norm_topk_prob", true);
  require_value(f, "scoring_func", "\"softmax\"", "mistral4 routes on softmax scores");
  c.router.score = RouterScore::Softmax;
  parse_groups(f, c, d.n_group, d.topk_group, GroupScore::TopTwoSum);
  c.qkv_bias = c.o_bias = f.boolean("attention_bias", false);
}

void read_gpt_oss(const ConfigFields& f, ModelConfig& c) {
  c.experts = f.has("num_local_experts") ? f.integer("num_local_experts") : f.integer("num_experts", 128);
  c.top_k = f.integer("num_experts_per_tok", 4);
  c.expert_width = f.integer("intermediate_size");
  c.qkv_bias = c.o_bias = f.boolean("attention_bias", true);
  c.router.score = RouterScore::SoftmaxTopK;
  c.router.bias = true;
  c.expert_bias = true;
  c.swiglu_clamp = SwigluClamp{f.number("swiglu_alpha", 1.702), f.number("swiglu_limit", 7.0)};
  if (!(c.swiglu_clamp->limit > 0)) throw UsageError(f.source + ": swiglu_limit must be positive");
  c.attention_sinks = true;
  c.sliding_window = f.integer("sliding_window", f.j.contains("sliding_window") ? 0 : 128);  // null: no window
  if (c.sliding_window < 0) throw UsageError(f.source + ": sliding_window must be positive or null");
  if (f.has("layer_types")) {
    const nlohmann::json& lt = f.j.at("layer_types");
    if (!lt.is_array() || static_cast<std::int64_t>(lt.size()) != c.layers)
      throw UsageError(f.source + ": layer_types must be a list of num_hidden_layers (" + std::to_string(c.layers) + ") strings");
    for (const auto& t : lt) {
      if (t == "sliding_attention") c.sliding_layers.push_back(true);
      else if (t == "full_attention") c.sliding_layers.push_back(false);
      else throw UsageError(f.source + ": layer_types entry " + t.dump() + " is not supported (sliding_attention, full_attention)");
    }
  } else {
    for (int l = 0; l < c.layers; ++l) c.sliding_layers.push_back(l % 2 == 0);  // transformers' default: even layers slide
  }
}

namespace {

// Qwen3-Next's and Qwen3.5's shared reading (Qwen3_5MoeTextConfig derives from Qwen3NextConfig):
// the gated delta-rule layers, the gated full attention, the (1 + w) norms, the gated shared expert.
void read_qwen3_next_like(const ConfigFields& f, ModelConfig& c, bool split_projections) {
  c.experts = f.has("num_local_experts") ? f.integer("num_local_experts") : f.integer("num_experts", split_projections ? 256 : 512);
  c.top_k = f.integer("num_experts_per_tok", split_projections ? 8 : 10);
  c.expert_width = f.integer("moe_intermediate_size", 512);
  c.shared_expert_width = f.integer("shared_expert_intermediate_size", 512);
  c.shared_expert_gated = c.shared_expert_width > 0;
  c.qkv_bias = f.boolean("attention_bias", false);
  c.qk_norm = QkNorm::PerHead;
  c.norm_plus_one = true;
  c.attn_output_gate = true;
  LinearAttention la;
  la.k_heads = f.integer("linear_num_key_heads", 16);
  la.v_heads = f.integer("linear_num_value_heads", 32);
  la.k_dim = f.integer("linear_key_head_dim", 128);
  la.v_dim = f.integer("linear_value_head_dim", 128);
  la.conv_kernel = f.integer("linear_conv_kernel_dim", 4);
  require_positive(la.k_heads, "linear_num_key_heads", f.source);
  require_positive(la.v_heads, "linear_num_value_heads", f.source);
  require_positive(la.k_dim, "linear_key_head_dim", f.source);
  require_positive(la.v_dim, "linear_value_head_dim", f.source);
  require_positive(la.conv_kernel, "linear_conv_kernel_dim", f.source);
  if (la.v_heads % la.k_heads != 0)
    throw UsageError(f.source + ": linear_num_value_heads (" + std::to_string(la.v_heads) +
                     ") must be a multiple of linear_num_key_heads (" + std::to_string(la.k_heads) + ")");
  la.split_projections = split_projections;
  if (f.has("layer_types")) {
    const nlohmann::json& lt = f.j.at("layer_types");
    if (!lt.is_array() || static_cast<std::int64_t>(lt.size()) != c.layers)
      throw UsageError(f.source + ": layer_types must be a list of num_hidden_layers (" + std::to_string(c.layers) +
                       ") strings, \"linear_attention\" or \"full_attention\"");
    for (const auto& t : lt) {
      if (t != "linear_attention" && t != "full_attention")
        throw UsageError(f.source + ": layer_types entry " + t.dump() + " is not supported (linear_attention, full_attention)");
      la.layers.push_back(t == "linear_attention");
    }
  } else {  // transformers' default: every full_attention_interval-th layer is full attention
    const int interval = f.small_integer("full_attention_interval", 4);
    require_positive(interval, "full_attention_interval", f.source);
    for (int l = 0; l < c.layers; ++l) la.layers.push_back((l + 1) % interval != 0);
  }
  c.linear_attn = la;
}

}  // namespace

void read_qwen3_next(const ConfigFields& f, ModelConfig& c) {
  read_qwen3_next_like(f, c, /*split_projections=*/false);
  c.dense_width = f.integer("intermediate_size", 5632);
  c.norm_topk_prob = f.boolean("norm_topk_prob", true);
  c.decoder_sparse_step = f.small_integer("decoder_sparse_step", 1);
  c.mlp_only_layers = f.int_list("mlp_only_layers");
}

// Qwen3_5MoeTextConfig: every layer sparse (no intermediate_size, decoder_sparse_step or
// mlp_only_layers), and its router always renormalises the top-k (Qwen3VLMoeTextTopKRouter).
void read_qwen3_5_moe(const ConfigFields& f, ModelConfig& c) {
  read_qwen3_next_like(f, c, /*split_projections=*/true);
  c.norm_topk_prob = true;
}

// MiniMaxM2Config: every layer sparse; MiniMaxM2TopKRouter's sigmoid scores (+ the correction
// bias for the choice), top-k weights always renormalised; q_norm / k_norm over the whole projections.
void read_minimax_m2(const ConfigFields& f, ModelConfig& c) {
  c.experts = f.integer("num_local_experts", 256);
  c.top_k = f.integer("num_experts_per_tok", 8);
  c.expert_width = f.integer("intermediate_size", 1536);
  c.norm_topk_prob = true;
  c.router.score = RouterScore::Sigmoid;
  c.router.correction_bias = true;
  c.router_jitter_noise = f.number("router_jitter_noise", 0.0);
  c.qk_norm = QkNorm::Whole;
}

// Ernie4_5_MoeConfig: layer i is sparse when (i + 1) % moe_layer_interval == 0 and
// moe_layer_start_index <= i <= moe_layer_end_index (-1: the last layer), else a dense MLP of
// intermediate_size; Ernie4_5_MoeTopKRouter: fp32 softmax, the top-k chosen on softmax +
// moe_statics' correction bias, weighted by the unbiased softmax renormalised (its clamp at
// moe_norm_min cannot bind: the top-k of a softmax sum to at least k / E); the shared experts one
// ungated MLP of moe_intermediate_size × moe_num_shared_experts; embeddings tied by default.
void read_ernie4_5_moe(const ConfigFields& f, ModelConfig& c) {
  c.experts = f.has("moe_num_experts") ? f.integer("moe_num_experts") : f.integer("num_experts", 64);
  c.top_k = f.has("moe_k") ? f.integer("moe_k") : f.integer("num_experts_per_tok", 6);
  c.expert_width = f.integer("moe_intermediate_size", 1536);
  c.dense_width = f.integer("intermediate_size", 12288);
  c.shared_expert_width = c.expert_width * f.integer("moe_num_shared_experts", 2);
  c.norm_topk_prob = true;
  c.router.score = RouterScore::Softmax;
  c.router.correction_bias = true;
  c.router.fp32 = true;
  c.tie_word_embeddings = f.boolean("tie_word_embeddings", true);
  if (f.boolean("use_bias", false))
    throw UsageError(f.source + ": use_bias true is not supported for ernie4_5_moe (it puts a bias on lm_head too, "
                     "which eo-ddp's LM head does not have); ERNIE-4.5's released checkpoints set it false");
  const int start = f.small_integer("moe_layer_start_index", 1);
  const int interval = f.small_integer("moe_layer_interval", 1);
  int end = f.small_integer("moe_layer_end_index", -1);
  if (end == -1) end = static_cast<int>(c.layers) - 1;
  if (start < 0) throw UsageError(f.source + ": moe_layer_start_index must be >= 0");
  require_positive(interval, "moe_layer_interval", f.source);
  c.first_k_dense = start;
  c.decoder_sparse_step = interval;
  for (int l = std::max(end + 1, 0); l < c.layers; ++l) c.mlp_only_layers.push_back(l);
}

namespace {

// Hunyuan's per-layer lists (moe_topk, moe_intermediate_size, num_shared_expert): an integer, or one
// per layer; eo-ddp builds every layer alike, so a list must hold one value.
std::int64_t same_for_every_layer(const ConfigFields& f, const char* key, std::int64_t fallback) {
  if (!f.has(key) || !f.j.at(key).is_array()) return f.integer(key, fallback);
  const nlohmann::json& v = f.j.at(key);
  std::set<std::int64_t> values;
  for (const auto& x : v) {
    if (!x.is_number_integer()) throw UsageError(f.source + ": field '" + key + "' must be an integer or a list of integers");
    values.insert(x.get<std::int64_t>());
  }
  if (values.size() != 1)
    throw UsageError(f.source + ": field '" + key + "' " + v.dump() + " differs between layers; eo-ddp routes and sizes " +
                     "every layer alike, so a list must hold one value");
  return *values.begin();
}

}  // namespace

// HunYuanMoEV1Config: every layer sparse; HunYuanMoEV1Gate: fp32 softmax of mlp.gate.wg, top-k
// renormalised; the experts and the shared_mlp beside them both intermediate_size wide (transformers
// reads neither moe_intermediate_size nor num_shared_expert: a file whose values would build other
// shapes is refused); q/k norms per head after RoPE; no aux loss.
void read_hunyuan_v1_moe(const ConfigFields& f, ModelConfig& c) {
  c.experts = f.has("num_experts") ? f.integer("num_experts") : f.integer("num_local_experts", 1);
  c.top_k = same_for_every_layer(f, "moe_topk", 1);
  c.expert_width = f.integer("intermediate_size", 11008);
  c.shared_expert_width = c.expert_width;
  c.norm_topk_prob = true;
  c.router.fp32 = true;
  c.has_aux_loss = false;
  c.qkv_bias = c.o_bias = f.boolean("attention_bias", false);
  c.qk_norm = QkNorm::PerHead;
  c.qk_norm_after_rope = true;
  if (f.has("moe_intermediate_size") && same_for_every_layer(f, "moe_intermediate_size", 0) != c.expert_width)
    throw UsageError(f.source + ": moe_intermediate_size differs from intermediate_size; transformers' HunYuanMoEV1 builds "
                     "its experts intermediate_size wide, so this checkpoint is not one it (or eo-ddp) reads");
  if (f.has("num_shared_expert") && same_for_every_layer(f, "num_shared_expert", 1) != 1)
    throw UsageError(f.source + ": num_shared_expert must be 1 (transformers' HunYuanMoEV1 builds one shared_mlp)");
  // Switches of Tencent's own code that transformers' class does not have.
  const std::string no = " is not supported for hunyuan_v1_moe: transformers' HunYuanMoEV1 ";
  if (!f.boolean("use_mixed_mlp_moe", true)) throw UsageError(f.source + ": use_mixed_mlp_moe false" + no + "always builds the shared_mlp");
  if (!f.boolean("use_qk_norm", true)) throw UsageError(f.source + ": use_qk_norm false" + no + "always norms q and k");
  if (f.boolean("use_cla", false))
    throw UsageError(f.source + ": use_cla true (cross-layer attention)" + no + "gives every layer its own k_proj / v_proj");
}

}  // namespace eo::model
