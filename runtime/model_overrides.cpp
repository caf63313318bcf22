// axolotl's overrides of config.json. See model_overrides.h.
#include "runtime/model_overrides.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <tuple>

#include "runtime/yaml_values.h"

namespace eo {
namespace {

using nlohmann::json;

// A YAML value as the JSON config.json would hold: unquoted booleans, numbers and null keep their
// type; a quoted scalar stays a string.
json to_json(const YAML::Node& n) {
  if (n.IsMap()) {
    json o = json::object();
    for (const auto& kv : n) o[key_text(kv.first)] = to_json(kv.second);
    return o;
  }
  if (n.IsSequence()) {
    json a = json::array();
    for (const auto& x : n) a.push_back(to_json(x));
    return a;
  }
  if (is_null(n)) return nullptr;
  if (n.Tag() == "!") return n.Scalar();  // quoted
  if (const auto b = as_bool(n)) return *b;
  if (const auto i = as_int(n); i && n.Scalar().find_first_of(".eE") == std::string::npos) return *i;
  if (const auto d = as_double(n)) return *d;
  return n.Scalar();
}

// What differs between the weights `a` and `b` describe: each a short description, empty when
// every tensor has the same name and shape.
std::vector<std::string> weight_differences(const model::ModelConfig& a, const model::ModelConfig& b) {
  std::vector<std::string> out;
  auto same = [&](const char* what, auto x, auto y) {
    if (x != y) out.push_back(what);
  };
  same("the architecture (model_type)", a.model_type, b.model_type);
  same("hidden_size", a.hidden, b.hidden);
  same("the number of layers", a.layers, b.layers);
  same("the vocabulary size", a.vocab, b.vocab);
  same("the number of experts", a.experts, b.experts);
  same("the experts' width", a.expert_width, b.expert_width);
  same("the dense MLP width", a.dense_width, b.dense_width);
  same("the shared experts' width", a.shared_expert_width, b.shared_expert_width);
  same("the shared expert's gate", a.shared_expert_gated, b.shared_expert_gated);
  same("which layers are MoE layers", a.moe_layer_ids(), b.moe_layer_ids());
  same("tie_word_embeddings", a.tie_word_embeddings, b.tie_word_embeddings);
  same("the attention biases", std::make_tuple(a.qkv_bias, a.o_bias), std::make_tuple(b.qkv_bias, b.o_bias));
  same("the MLP and expert biases", std::make_tuple(a.mlp_bias, a.expert_bias), std::make_tuple(b.mlp_bias, b.expert_bias));
  same("the q/k norms", a.qk_norm, b.qk_norm);
  same("the attention sinks", a.attention_sinks, b.attention_sinks);
  same("the router's bias or correction bias", std::make_tuple(a.router.bias, a.router.correction_bias),
       std::make_tuple(b.router.bias, b.router.correction_bias));
  same("the quantisation of the checkpoint", std::make_tuple(a.mxfp4_experts, a.nvfp4), std::make_tuple(b.mxfp4_experts, b.nvfp4));
  same("the multimodal wrapper", a.multimodal.has_value(), b.multimodal.has_value());
  if (out.empty())
    for (int l = 0; l < a.layers; ++l) {
      const auto x = a.attention_shapes(l), y = b.attention_shapes(l);
      bool equal = x.size() == y.size();
      for (std::size_t i = 0; equal && i < x.size(); ++i) equal = x[i].name == y[i].name && x[i].in == y[i].in && x[i].out == y[i].out;
      if (!equal) {
        out.push_back("the attention projections' shapes (heads, key-value heads, head_dim or the latent ranks)");
        break;
      }
    }
  return out;
}

// config.json keeps one RoPE in rope_parameters (transformers 5), not one per layer type (Gemma 4).
bool flat_rope_parameters(const json& j) {
  if (!j.contains("rope_parameters") || !j.at("rope_parameters").is_object()) return false;
  for (const auto& v : j.at("rope_parameters"))
    if (v.is_object()) return false;
  return true;
}

}  // namespace

void read_model_config_overrides(const YAML::Node& n, const std::string& key, TrainConfig& c,
                                 std::vector<ConfigIssue>& problems) {
  if (!n.IsMap())
    return problems.push_back({key, "expected a map of config.json keys to their values, e.g. " + key +
                                          ": {rope_theta: 1000000}"});
  for (const auto& kv : n) {
    const std::string k = key_text(kv.first);
    if (k == "output_router_logits") {  // the router aux loss: eo-ddp's own key
      if (const auto b = as_bool(kv.second)) c.output_router_logits = *b;
      else problems.push_back({key + "." + k, "expected true or false, got '" + yaml_text(kv.second) + "'"});
      continue;
    }
    auto& list = c.model_config_overrides;
    const std::string value = to_json(kv.second).dump();
    const auto it = std::find_if(list.begin(), list.end(), [&](const auto& p) { return p.first == k; });
    if (it != list.end()) it->second = value;  // overrides_of_model_config after model_config: the later one
    else list.emplace_back(k, value);
  }
}

model::ModelConfig load_model_config(const TrainConfig& c, std::vector<std::string>* notes) {
  const std::string source = c.base_model + "/config.json";
  json j = model::read_config_json(c.base_model);
  if (c.model_config_overrides.empty()) return model::parse_config(j, source);
  if (!j.is_object()) throw UsageError(source + ": expected a JSON object");
  const model::ModelConfig written = model::parse_config(j, source);
  std::string changed;
  for (const auto& [k, v] : c.model_config_overrides) {
    const json value = json::parse(v);
    std::string at = k, now = v;
    std::string was = j.contains(k) ? j.at(k).dump() : "absent";
    if ((k == "rope_theta" || k == "rope_scaling") && flat_rope_parameters(j)) {
      // transformers 5's layout: RoPE lives in rope_parameters, which wins over a top-level
      // rope_theta / rope_scaling; the override goes inside it, as transformers' rope_scaling
      // setter merges one (the dict replaced, its rope_theta kept unless given).
      json& rp = j["rope_parameters"];
      if (k == "rope_theta") {
        at = "rope_parameters.rope_theta";
        was = rp.contains("rope_theta") ? rp.at("rope_theta").dump() : "absent";
        rp["rope_theta"] = value;
      } else {
        at = "rope_parameters";
        was = rp.dump();
        json merged = value.is_object() ? value : json{{"rope_type", "default"}};
        if (!merged.contains("rope_theta") && rp.contains("rope_theta")) merged["rope_theta"] = rp.at("rope_theta");
        rp = merged;
        now = rp.dump();
      }
    } else {
      j[k] = value;
    }
    changed += (changed.empty() ? "" : ", ") + at + ": " + was + " -> " + now;
  }
  const model::ModelConfig overridden = model::parse_config(j, source + " with overrides_of_model_config");
  const auto diffs = weight_differences(written, overridden);
  if (!diffs.empty()) {
    std::string what;
    for (const auto& d : diffs) what += (what.empty() ? "" : ", ") + d;
    throw ModelOverrideError("overrides_of_model_config (" + changed + ") changes " + what + " of " + c.base_model +
                             "'s weights, which were made for config.json as written; override only values that leave "
                             "the tensors' shapes as they are (rope_scaling, rope_theta, max_position_embeddings, ...)");
  }
  if (notes) notes->push_back("overrides_of_model_config: " + c.base_model + "/config.json's " + changed + ", as axolotl sets them");
  return overridden;
}

}  // namespace eo
