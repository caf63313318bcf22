// config.json parsing: strict about types, explicit about which keys each family uses.
#include "models/hf_config.h"

#include <climits>
#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "common/json_depth.h"

namespace eo::model {
namespace {

using nlohmann::json;

// Typed field access with errors naming the key and file.
struct Fields {
  const json& j;
  const std::string& source;

  bool has(const char* key) const { return j.contains(key) && !j.at(key).is_null(); }
  std::int64_t integer(const char* key) const {
    if (!has(key)) throw UsageError(source + ": required field '" + key + "' is missing");
    const json& v = j.at(key);
    if (!v.is_number_integer()) throw UsageError(source + ": field '" + key + "' must be an integer, got " + v.dump());
    if (v.is_number_unsigned() && v.get<std::uint64_t>() > static_cast<std::uint64_t>(INT64_MAX))
      throw UsageError(source + ": field '" + key + "' is too large, got " + v.dump());
    return v.get<std::int64_t>();
  }
  // An integer that must fit in an int (layer indices and counts used as int).
  int small_integer(const char* key, std::int64_t fallback) const {
    const std::int64_t v = integer(key, fallback);
    if (v < INT_MIN || v > INT_MAX) throw UsageError(source + ": field '" + key + "' is out of range, got " + std::to_string(v));
    return static_cast<int>(v);
  }
  std::int64_t integer(const char* key, std::int64_t fallback) const { return has(key) ? integer(key) : fallback; }
  double number(const char* key) const {
    if (!has(key)) throw UsageError(source + ": required field '" + key + "' is missing");
    const json& v = j.at(key);
    if (!v.is_number()) throw UsageError(source + ": field '" + key + "' must be a number, got " + v.dump());
    return v.get<double>();
  }
  double number(const char* key, double fallback) const { return has(key) ? number(key) : fallback; }
  bool boolean(const char* key, bool fallback) const {
    if (!has(key)) return fallback;
    const json& v = j.at(key);
    if (!v.is_boolean()) throw UsageError(source + ": field '" + key + "' must be true or false, got " + v.dump());
    return v.get<bool>();
  }
  std::vector<int> int_list(const char* key) const {
    std::vector<int> out;
    if (!has(key)) return out;
    const json& v = j.at(key);
    if (!v.is_array()) throw UsageError(source + ": field '" + key + "' must be a list of integers, got " + v.dump());
    for (const auto& x : v) {
      if (!x.is_number_integer()) throw UsageError(source + ": field '" + key + "' must be a list of integers, got " + v.dump());
      // Out-of-int values would wrap into valid-looking indices; report them as they are.
      if (x.is_number_unsigned() ? x.get<std::uint64_t>() > static_cast<std::uint64_t>(INT_MAX)
                                 : (x.get<std::int64_t>() < INT_MIN || x.get<std::int64_t>() > INT_MAX))
        throw UsageError(source + ": field '" + key + "' entry " + x.dump() + " is out of range");
      out.push_back(x.get<int>());
    }
    return out;
  }
};

void require_positive(std::int64_t v, const char* what, const std::string& source) {
  if (v <= 0) throw UsageError(source + ": '" + what + "' must be positive, got " + std::to_string(v));
  // Products of two sizes (vocab x hidden, heads x head_dim, ...) must not overflow int64 in the
  // model builder; no real dimension comes near 2^31.
  if (v > INT32_MAX)
    throw UsageError(source + ": '" + what + "' is " + std::to_string(v) + ", over 2^31 - 1; the file is damaged");
}

}  // namespace

bool ModelConfig::is_moe_layer(int layer) const {
  if (experts <= 0) return false;
  for (int l : mlp_only_layers)
    if (l == layer) return false;
  return (layer + 1) % decoder_sparse_step == 0;
}

ModelConfig parse_config(const json& j, const std::string& source) {
  if (!j.is_object()) throw UsageError(source + ": expected a JSON object");
  Fields f{j, source};
  ModelConfig c;
  if (!j.contains("model_type") || !j.at("model_type").is_string())
    throw UsageError(source + ": field 'model_type' (string) is missing; supported: qwen3_moe, olmoe, mixtral, qwen2_moe");
  c.model_type = j.at("model_type").get<std::string>();
  if (c.model_type == "qwen3_moe") c.arch = Arch::Qwen3Moe;
  else if (c.model_type == "olmoe") c.arch = Arch::Olmoe;
  else if (c.model_type == "mixtral") c.arch = Arch::Mixtral;
  else if (c.model_type == "qwen2_moe") c.arch = Arch::Qwen2Moe;
  else
    throw UsageError(source + ": model_type '" + c.model_type +
                     "' is not supported; supported model types: qwen3_moe, olmoe, mixtral, qwen2_moe");

  c.hidden = f.integer("hidden_size");
  c.layers = f.integer("num_hidden_layers");
  c.heads = f.integer("num_attention_heads");
  c.kv_heads = f.integer("num_key_value_heads", c.heads);
  c.vocab = f.integer("vocab_size");
  require_positive(c.hidden, "hidden_size", source);
  require_positive(c.layers, "num_hidden_layers", source);
  require_positive(c.heads, "num_attention_heads", source);
  require_positive(c.kv_heads, "num_key_value_heads", source);
  require_positive(c.vocab, "vocab_size", source);
  // Layers are indexed with int and visited one by one here and in the model builder; a count
  // far beyond any real model (largest today: a few hundred) is a damaged file, not a model.
  constexpr std::int64_t kMaxLayers = 1 << 16;
  if (c.layers > kMaxLayers)
    throw UsageError(source + ": num_hidden_layers " + std::to_string(c.layers) + " is over the limit of " +
                     std::to_string(kMaxLayers) + "; the file is damaged");
  if (c.heads % c.kv_heads != 0)
    throw UsageError(source + ": num_attention_heads (" + std::to_string(c.heads) +
                     ") must be a multiple of num_key_value_heads (" + std::to_string(c.kv_heads) + ")");
  if (f.has("head_dim")) {
    c.head_dim = f.integer("head_dim");
  } else {
    if (c.hidden % c.heads != 0) throw UsageError(source + ": hidden_size must be divisible by num_attention_heads when head_dim is absent");
    c.head_dim = c.hidden / c.heads;
  }
  require_positive(c.head_dim, "head_dim", source);
  if (c.head_dim % 2 != 0) throw UsageError(source + ": head_dim must be even for RoPE");
  c.rms_eps = f.number("rms_norm_eps", c.arch == Arch::Olmoe ? 1e-5 : 1e-6);

  // rope_theta: top level (older configs) or rope_parameters.rope_theta (transformers v5).
  if (f.has("rope_theta")) {
    c.rope_theta = f.number("rope_theta");
  } else if (f.has("rope_parameters")) {
    const json& rp = j.at("rope_parameters");
    if (!rp.is_object()) throw UsageError(source + ": field 'rope_parameters' must be an object");
    Fields rf{rp, source};
    c.rope_theta = rf.number("rope_theta");
    if (rp.contains("rope_type") && rp.at("rope_type").is_string() && rp.at("rope_type").get<std::string>() != "default")
      throw UsageError(source + ": rope_parameters.rope_type '" + rp.at("rope_type").get<std::string>() +
                       "' is not supported (only 'default' RoPE)");
  } else {
    throw UsageError(source + ": neither 'rope_theta' nor 'rope_parameters.rope_theta' is present");
  }
  if (f.has("rope_scaling") && !j.at("rope_scaling").is_null())
    throw UsageError(source + ": rope_scaling is not supported (only default RoPE)");

  c.tie_word_embeddings = f.boolean("tie_word_embeddings", false);
  c.initializer_range = f.number("initializer_range", 0.02);
  c.router_aux_loss_coef = f.number("router_aux_loss_coef", 0.0);

  switch (c.arch) {
    case Arch::Qwen3Moe:
      // transformers 5 writes num_local_experts for qwen3_moe; Hub configs have num_experts.
      c.experts = f.has("num_local_experts") ? f.integer("num_local_experts") : f.integer("num_experts");
      c.top_k = f.integer("num_experts_per_tok");
      c.expert_width = f.integer("moe_intermediate_size");
      c.dense_width = f.integer("intermediate_size", 0);
      c.norm_topk_prob = f.boolean("norm_topk_prob", false);
      c.decoder_sparse_step = f.small_integer("decoder_sparse_step", 1);
      c.mlp_only_layers = f.int_list("mlp_only_layers");
      c.qkv_bias = f.boolean("attention_bias", false);
      c.qk_norm = QkNorm::PerHead;
      break;
    case Arch::Olmoe:
      c.experts = f.has("num_local_experts") ? f.integer("num_local_experts") : f.integer("num_experts");
      c.top_k = f.integer("num_experts_per_tok");
      c.expert_width = f.integer("intermediate_size");
      c.norm_topk_prob = f.boolean("norm_topk_prob", false);
      c.qkv_bias = f.boolean("attention_bias", false);
      if (f.has("clip_qkv")) c.clip_qkv = f.number("clip_qkv");
      c.qk_norm = QkNorm::Whole;
      break;
    case Arch::Mixtral:
      c.experts = f.integer("num_local_experts");
      c.top_k = f.integer("num_experts_per_tok");
      c.expert_width = f.integer("intermediate_size");
      c.norm_topk_prob = true;  // Mixtral always renormalises the top-k
      c.router_jitter_noise = f.number("router_jitter_noise", 0.0);
      break;
    case Arch::Qwen2Moe:
      c.experts = f.has("num_local_experts") ? f.integer("num_local_experts") : f.integer("num_experts");
      c.top_k = f.integer("num_experts_per_tok");
      c.expert_width = f.integer("moe_intermediate_size");
      c.dense_width = f.integer("intermediate_size", 0);
      c.shared_expert_width = f.integer("shared_expert_intermediate_size", 0);
      c.norm_topk_prob = f.boolean("norm_topk_prob", false);
      c.decoder_sparse_step = f.small_integer("decoder_sparse_step", 1);
      c.mlp_only_layers = f.int_list("mlp_only_layers");
      c.qkv_bias = f.boolean("qkv_bias", true);
      break;
  }
  require_positive(c.experts, "number of experts", source);
  require_positive(c.top_k, "num_experts_per_tok", source);
  require_positive(c.expert_width, "expert intermediate size", source);
  require_positive(c.decoder_sparse_step, "decoder_sparse_step", source);
  if (c.top_k > c.experts)
    throw UsageError(source + ": num_experts_per_tok (" + std::to_string(c.top_k) + ") exceeds the number of experts (" +
                     std::to_string(c.experts) + ")");
  for (int l : c.mlp_only_layers)
    if (l < 0 || l >= c.layers) throw UsageError(source + ": mlp_only_layers entry " + std::to_string(l) + " is not a layer index");
  for (int l = 0; l < c.layers; ++l)
    if (!c.is_moe_layer(l) && c.dense_width <= 0)
      throw UsageError(source + ": layer " + std::to_string(l) + " is dense but 'intermediate_size' is missing or zero");
  return c;
}

ModelConfig load_config(const std::string& model_dir) {
  const std::string path = model_dir + "/config.json";
  std::ifstream in(path);
  if (!in) throw UsageError(path + ": cannot open (is --model a Hugging Face checkpoint folder?)");
  json j;
  try {
    j = json::parse(in, json_depth_limit([&] {
      throw UsageError(path + ": JSON nested deeper than " + std::to_string(kMaxJsonDepth) + " levels; not a config.json");
    }));
  } catch (const json::exception& e) {
    throw UsageError(path + ": invalid JSON: " + e.what());
  }
  return parse_config(j, path);
}

}  // namespace eo::model
