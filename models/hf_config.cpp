// config.json parsing: strict about types, explicit about which keys each family uses.
#include "models/hf_config.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "common/files.h"
#include "common/json_depth.h"
#include "models/config_fields.h"
#include "models/family_config.h"

namespace eo::model {
namespace {

using nlohmann::json;

// yarn_get_mscale of transformers (DeepSeek and the YaRN attention factor).
double yarn_mscale(double scale, double mscale) { return scale <= 1 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0; }

// RoPE: rope_parameters (transformers 5 saves) or the Hub's rope_theta / rope_scaling /
// partial_rotary_factor, read the way transformers' standardize_rope_params merges them.
// `mscale_all_dim` (DeepSeek) is returned for the softmax scale.
void parse_rope(const ConfigFields& f, ModelConfig& c, const Family& fam, double default_partial, double& mscale_all_dim) {
  const bool scaling_ok = fam.rope_scaling;
  const std::string& source = f.source;
  const json* rp = nullptr;
  if (f.has("rope_parameters")) {
    rp = &f.j.at("rope_parameters");
    if (!rp->is_object()) throw UsageError(source + ": field 'rope_parameters' must be an object");
  } else if (f.has("rope_scaling")) {
    rp = &f.j.at("rope_scaling");
    if (!rp->is_object()) throw UsageError(source + ": field 'rope_scaling' must be an object or null");
  }
  const json empty = json::object();
  const ConfigFields r{rp ? *rp : empty, source};
  if (r.has("rope_theta")) c.rope_theta = r.number("rope_theta");
  else if (f.has("rope_theta")) c.rope_theta = f.number("rope_theta");
  else throw UsageError(source + ": neither 'rope_theta' nor 'rope_parameters.rope_theta' is present");
  const std::string type = text(r, "rope_type", text(r, "type", "default"));
  const std::string where = rp == nullptr ? "rope" : (f.has("rope_parameters") ? "rope_parameters" : "rope_scaling");
  if (fam.rope_ntk_alpha && type == "dynamic") {
    // A fixed alpha stretches the base once (transformers' "ntk_alpha"); without one, "dynamic" is
    // length-dependent NTK scaling, which eo-ddp does not implement.
    if (!r.has("alpha"))
      throw UsageError(source + ": " + where + ".rope_type 'dynamic' without 'alpha' is not supported for " + c.model_type +
                       " (only NTK-alpha RoPE: 'dynamic' with a fixed 'alpha', as its checkpoints ship)");
    if (c.head_dim <= 2) throw UsageError(source + ": NTK-alpha RoPE needs head_dim > 2");
    const double d = static_cast<double>(c.head_dim);
    c.rope_theta *= std::pow(r.number("alpha"), d / (d - 2));
    c.rope.dim = c.head_dim;  // its rotary embedding reads no partial_rotary_factor
    return;
  }
  if (type != "default" && !(scaling_ok && type == "yarn"))
    throw UsageError(source + ": " + where + ".rope_type '" + type + "' is not supported for " + c.model_type +
                     (scaling_ok ? " (only 'default' and 'yarn')" : " (only 'default' RoPE)"));
  const double partial = r.number("partial_rotary_factor", f.number("partial_rotary_factor", default_partial));
  if (!(partial > 0 && partial <= 1)) throw UsageError(source + ": partial_rotary_factor must be in (0, 1], got " + std::to_string(partial));
  // Latent attention rotates exactly its qk_rope_head_dim. transformers' DeepSeek rotary ignores the
  // factor; GLM-4.7-Flash's and Mistral 4's apply it to head_dim (qk_rope_head_dim; Mistral 4:
  // qk_nope + qk_rope), which must then give qk_rope_head_dim.
  if (c.mla) {
    const std::int64_t base = fam.rotary_over_qk_head ? c.mla->qk_dim() : c.mla->rope_dim;
    const auto dim = static_cast<std::int64_t>(static_cast<double>(base) * partial);  // int() as transformers
    if (dim != c.mla->rope_dim)
      throw UsageError(source + ": partial_rotary_factor is not supported for " + c.model_type + " (got " +
                       std::to_string(partial) + "): it rotates " + std::to_string(dim) + " dims of " + std::to_string(base) +
                       ", but the latent attention rotates qk_rope_head_dim (" + std::to_string(c.mla->rope_dim) + ")");
  } else {
    c.rope.dim = static_cast<std::int64_t>(static_cast<double>(c.head_dim) * partial);  // int() as transformers
  }
  if (c.rope.dim <= 0 || c.rope.dim % 2 != 0)
    throw UsageError(source + ": the rotary dimension (" + std::to_string(c.rope.dim) + ") must be positive and even");
  if (fam.query_position_scaling) {
    // Mistral4Attention reads both from rope_parameters (yarn: the pretraining length resolved below).
    if (!r.has("llama_4_scaling_beta"))
      throw UsageError(source + ": mistral4 needs " + where + ".llama_4_scaling_beta (transformers' Mistral4Attention "
                       "scales the queries with it; 0 turns the scaling off)");
    c.llama4_beta = r.number("llama_4_scaling_beta");
    // Its default RoPE rotates head_dim = qk_nope + qk_rope dims, which do not fit the rotated
    // qk_rope_head_dim part (transformers fails on it too).
    if (type != "yarn")
      throw UsageError(source + ": " + where + ".rope_type '" + type + "' is not supported for mistral4 (only 'yarn', "
                       "as Mistral Small 4 ships)");
  }
  if (type != "yarn") return;
  c.rope.yarn = true;
  const double max_pos = static_cast<double>(f.integer("max_position_embeddings", 2048));
  // transformers: a top-level original_max_position_embeddings wins, then the dict's, then max_position_embeddings.
  c.rope.original_max_positions = f.has("original_max_position_embeddings") ? f.number("original_max_position_embeddings")
                                                                            : r.number("original_max_position_embeddings", max_pos);
  c.rope.factor = r.has("factor") ? r.number("factor") : max_pos / c.rope.original_max_positions;
  if (!(c.rope.factor >= 1) || !(c.rope.original_max_positions > 0))
    throw UsageError(source + ": " + where + ": yarn needs factor >= 1 and original_max_position_embeddings > 0");
  // `x or default` in transformers: 0 and null both take the default.
  c.rope.beta_fast = r.number("beta_fast", 0) != 0 ? r.number("beta_fast") : 32.0;
  c.rope.beta_slow = r.number("beta_slow", 0) != 0 ? r.number("beta_slow") : 1.0;
  c.rope.truncate = r.boolean("truncate", true);
  const double mscale = r.number("mscale", 0);
  mscale_all_dim = r.number("mscale_all_dim", 0);
  if (r.has("attention_factor")) c.rope.attention_factor = r.number("attention_factor");
  else if (mscale != 0 && mscale_all_dim != 0)
    c.rope.attention_factor = yarn_mscale(c.rope.factor, mscale) / yarn_mscale(c.rope.factor, mscale_all_dim);
  else c.rope.attention_factor = yarn_mscale(c.rope.factor, 1.0);
  c.llama4_positions = c.rope.original_max_positions;  // transformers' standardised rope_parameters value
}

// DeepSeek's latent attention dims; head_dim becomes the RoPE dims (as transformers sets it).
void parse_mla(const ConfigFields& f, ModelConfig& c) {
  Mla m;
  if (!f.j.contains("q_lora_rank"))
    throw UsageError(f.source + ": required field 'q_lora_rank' is missing (null for a full q_proj)");
  m.q_lora_rank = f.integer("q_lora_rank", 0);
  if (f.has("q_lora_rank")) require_positive(m.q_lora_rank, "q_lora_rank", f.source);
  m.kv_lora_rank = f.integer("kv_lora_rank");
  m.nope_dim = f.integer("qk_nope_head_dim");
  m.rope_dim = f.integer("qk_rope_head_dim");
  m.v_dim = f.integer("v_head_dim");
  require_positive(m.kv_lora_rank, "kv_lora_rank", f.source);
  require_positive(m.nope_dim, "qk_nope_head_dim", f.source);
  require_positive(m.rope_dim, "qk_rope_head_dim", f.source);
  require_positive(m.v_dim, "v_head_dim", f.source);
  if (c.kv_heads != c.heads)
    throw UsageError(f.source + ": num_key_value_heads (" + std::to_string(c.kv_heads) + ") must equal num_attention_heads (" +
                     std::to_string(c.heads) + ") with latent attention (kv_b_proj gives every head its keys)");
  c.head_dim = m.rope_dim;
  c.rope.dim = m.rope_dim;
  c.mla = m;
}

}  // namespace

// Gemma 4's MoE text model (gemma4_text), read as transformers 5.24's Gemma4TextConfig reads it
// (its defaults where a key is absent). The options eo-ddp does not train (the dense Gemma 4
// models' per-layer embeddings, shared key/value layers and so on) are named in one error.
// `wrapper`: the multimodal model around it, if any (for that error's wording).
ModelConfig parse_gemma4(const json& j, const std::string& source, const MultimodalWrapper* wrapper) {
  ModelConfig c;
  c.arch = Arch::Gemma4;
  c.model_type = j.at("model_type").get<std::string>();
  const json* tj = &j;
  const std::string& where = source;
  const ConfigFields f{*tj, where};
  c.hidden = f.integer("hidden_size", 2304);
  c.layers = f.integer("num_hidden_layers", 30);
  c.heads = f.integer("num_attention_heads", 8);
  c.kv_heads = f.integer("num_key_value_heads", 4);
  c.head_dim = f.integer("head_dim", 256);
  c.vocab = f.integer("vocab_size", 262144);
  require_positive(c.hidden, "hidden_size", where);
  require_positive(c.vocab, "vocab_size", where);
  require_positive(c.layers, "num_hidden_layers", where);
  require_positive(c.heads, "num_attention_heads", where);
  require_positive(c.kv_heads, "num_key_value_heads", where);
  require_positive(c.head_dim, "head_dim", where);
  if (c.layers > (1 << 14)) throw UsageError(where + ": num_hidden_layers " + std::to_string(c.layers) + " is over eo-ddp's limit");
  std::vector<bool> full;  // per layer: full (global) attention, else sliding
  if (f.has("layer_types")) {
    const json& lt = tj->at("layer_types");
    if (!lt.is_array() || static_cast<std::int64_t>(lt.size()) != c.layers)
      throw UsageError(where + ": layer_types must be a list of num_hidden_layers (" + std::to_string(c.layers) + ") strings");
    for (const auto& t : lt) {
      if (t != "sliding_attention" && t != "full_attention")
        throw UsageError(where + ": layer_types entry " + t.dump() + " is not supported (sliding_attention, full_attention)");
      full.push_back(t == "full_attention");
    }
  } else {
    for (int l = 0; l < c.layers; ++l) full.push_back((l + 1) % 6 == 0);  // transformers: 5 sliding, then 1 full
  }
  full.back() = true;  // transformers forces the last layer to full attention
  for (bool x : full) c.sliding_layers.push_back(!x);
  c.sliding_window = f.integer("sliding_window", 512);
  require_positive(c.sliding_window, "sliding_window", where);

  // Full-attention layers' geometry: transformers 5 saves it as per_layer_config (layer index →
  // head_dim / num_key_value_heads); the Hub's files as global_head_dim / num_global_key_value_heads.
  Gemma4Block g;
  g.k_eq_v = f.boolean("attention_k_eq_v", false);
  g.full_head_dim = f.integer("global_head_dim", 512);
  g.full_kv_heads = g.k_eq_v ? f.integer("num_global_key_value_heads", c.kv_heads) : c.kv_heads;
  if (f.has("per_layer_config")) {
    const json& plc = tj->at("per_layer_config");
    if (!plc.is_object()) throw UsageError(where + ": field 'per_layer_config' must be an object");
    bool first = true;
    for (int l = 0; l < c.layers; ++l) {
      const std::string key = std::to_string(l);
      if (!plc.contains(key)) {
        if (full[l]) throw UsageError(where + ": per_layer_config has no entry for full-attention layer " + key);
        continue;
      }
      if (!plc.at(key).is_object()) throw UsageError(where + ": per_layer_config." + key + " must be an object");
      const ConfigFields lf{plc.at(key), where + " per_layer_config." + key};
      const std::int64_t d = lf.integer("head_dim", full[l] ? g.full_head_dim : c.head_dim);
      const std::int64_t kv = lf.integer("num_key_value_heads", full[l] ? g.full_kv_heads : c.kv_heads);
      if (!full[l]) {
        if (d != c.head_dim || kv != c.kv_heads)
          throw UsageError(where + ": per_layer_config." + key + " gives a sliding layer its own geometry; eo-ddp supports "
                           "one geometry for the sliding layers and one for the full-attention layers");
        continue;
      }
      if (!first && (d != g.full_head_dim || kv != g.full_kv_heads))
        throw UsageError(where + ": per_layer_config gives the full-attention layers different geometries; eo-ddp supports one");
      g.full_head_dim = d;
      g.full_kv_heads = kv;
      first = false;
    }
  }
  require_positive(g.full_head_dim, "global_head_dim", where);
  require_positive(g.full_kv_heads, "num_global_key_value_heads", where);
  if (c.heads % c.kv_heads != 0 || c.heads % g.full_kv_heads != 0)
    throw UsageError(where + ": num_attention_heads (" + std::to_string(c.heads) + ") must be a multiple of the key/value heads");
  if (c.head_dim % 2 != 0 || g.full_head_dim % 2 != 0) throw UsageError(where + ": head dims must be even for RoPE");

  std::vector<std::string> never;
  if (!f.boolean("enable_moe_block", false))
    never.push_back("enable_moe_block false: a dense Gemma 4 (E2B, E4B, 31B); eo-ddp trains MoE models (26B-A4B)");
  if (f.integer("hidden_size_per_layer_input", 256) > 0)
    never.push_back("hidden_size_per_layer_input > 0 (per-layer embeddings) is not supported; 0 in the MoE checkpoints");
  if (f.integer("num_kv_shared_layers", 0) != 0) never.push_back("num_kv_shared_layers > 0 (layers reusing another's keys/values)");
  if (f.boolean("use_double_wide_mlp", false)) never.push_back("use_double_wide_mlp true");
  if (text(f, "use_bidirectional_attention", "") == "all") never.push_back("use_bidirectional_attention 'all' (not causal)");
  if (f.boolean("attention_bias", false)) never.push_back("attention_bias true");
  if (const std::string act = text(f, "hidden_activation", "gelu_pytorch_tanh"); act != "gelu_pytorch_tanh")
    never.push_back("hidden_activation '" + act + "' (only gelu_pytorch_tanh)");
  // One RoPE per layer type; transformers' defaults when rope_parameters is absent.
  json rp = {{"sliding_attention", {{"rope_type", "default"}, {"rope_theta", 10000.0}}},
             {"full_attention", {{"rope_type", "proportional"}, {"partial_rotary_factor", 0.25}, {"rope_theta", 1000000.0}}}};
  if (f.has("rope_parameters")) {
    rp = tj->at("rope_parameters");
    if (!rp.is_object()) throw UsageError(where + ": field 'rope_parameters' must be an object");
  }
  auto rope_of = [&](const char* type, std::int64_t dim, Rope& rope, double& theta) {
    if (!rp.contains(type) || !rp.at(type).is_object())
      throw UsageError(where + ": rope_parameters." + type + " (an object) is missing");
    const std::string at_key = where + " rope_parameters." + type;
    const ConfigFields r{rp.at(type), at_key};
    theta = r.number("rope_theta");
    const std::string t = text(r, "rope_type", "default");
    rope.dim = dim;
    if (t == "proportional") {
      const double partial = r.number("partial_rotary_factor", 1.0), factor = r.number("factor", 1.0);
      if (!(partial > 0 && partial <= 1) || !(factor > 0))
        throw UsageError(at_key + ": partial_rotary_factor must be in (0, 1] and factor positive");
      // int(partial * head_dim // 2), as transformers' _compute_proportional_rope_parameters
      rope.proportional_pairs = static_cast<std::int64_t>(std::floor(partial * static_cast<double>(dim) / 2));
      rope.factor = factor;
      if (rope.proportional_pairs <= 0) throw UsageError(at_key + ": partial_rotary_factor rotates no dimension");
    } else if (t != "default") {
      never.push_back(std::string("rope_parameters.") + type + ".rope_type '" + t + "' (default, proportional)");
    }
  };
  rope_of("sliding_attention", c.head_dim, c.rope, c.rope_theta);
  rope_of("full_attention", g.full_head_dim, g.full_rope, g.full_rope_theta);
  if (!never.empty()) {
    std::string m = where + ": this gemma4 config is not supported (" +
                    (wrapper ? wrapper->class_name + " around a gemma4_text model" : std::string("Gemma4ForCausalLM")) +
                    "); options eo-ddp does not train:";
    for (const auto& s : never) m += "\n      " + s;
    throw UsageError(m);
  }

  c.gemma = g;
  c.experts = f.integer("num_experts");
  c.top_k = f.integer("top_k_experts");
  c.expert_width = f.integer("moe_intermediate_size");
  c.dense_width = f.integer("intermediate_size", 9216);
  require_positive(c.dense_width, "intermediate_size", where);
  c.norm_topk_prob = true;  // Gemma4TextRouter renormalises the top-k
  c.router.score = RouterScore::Softmax;
  c.has_aux_loss = false;  // Gemma4ForCausalLM returns no router aux loss
  c.qk_norm = QkNorm::PerHead;
  c.attn_scale = 1.0;  // Gemma4TextAttention.scaling (q and k are RMS-normed)
  c.act = Activation::GeluTanh;
  c.embed_scaled = true;
  c.rms_eps = f.number("rms_norm_eps", 1e-6);
  c.final_logit_softcap = f.number("final_logit_softcapping", 0.0);  // null: off
  if (c.final_logit_softcap < 0) throw UsageError(where + ": final_logit_softcapping must be positive or null");
  c.tie_word_embeddings = f.boolean("tie_word_embeddings", true);
  c.initializer_range = f.number("initializer_range", 0.02);
  return c;
}

// Llama 4's text model (llama4_text, Llama4ForCausalLM; llama4 is Llama4ForConditionalGeneration
// around it, whose decoder is language_model.model.*), read as transformers 5.24's
// Llama4TextConfig reads it (its defaults where a key is absent, its derived per-layer lists
// where config.json has none). Options eo-ddp does not train are named in one error.
ModelConfig parse_llama4(const json& j, const std::string& source, const MultimodalWrapper* wrapper) {
  ModelConfig c;
  c.arch = Arch::Llama4;
  c.model_type = j.at("model_type").get<std::string>();
  const json* tj = &j;
  const std::string& where = source;
  const json empty = json::object();
  const ConfigFields f{*tj, where};
  c.hidden = f.integer("hidden_size", 5120);
  c.layers = f.integer("num_hidden_layers", 48);
  c.heads = f.integer("num_attention_heads", 40);
  c.kv_heads = f.integer("num_key_value_heads", f.j.contains("num_key_value_heads") ? c.heads : 8);  // null: heads
  c.vocab = f.integer("vocab_size", 202048);
  require_positive(c.hidden, "hidden_size", where);
  require_positive(c.layers, "num_hidden_layers", where);
  require_positive(c.heads, "num_attention_heads", where);
  require_positive(c.kv_heads, "num_key_value_heads", where);
  require_positive(c.vocab, "vocab_size", where);
  if (c.layers > (1 << 14)) throw UsageError(where + ": num_hidden_layers " + std::to_string(c.layers) + " is over eo-ddp's limit");
  if (c.heads % c.kv_heads != 0)
    throw UsageError(where + ": num_attention_heads (" + std::to_string(c.heads) + ") must be a multiple of num_key_value_heads (" +
                     std::to_string(c.kv_heads) + ")");
  if (f.has("head_dim")) {
    c.head_dim = f.integer("head_dim");
  } else if (f.j.contains("head_dim")) {  // null: hidden_size / heads, as Llama4TextConfig
    c.head_dim = c.hidden / c.heads;
  } else {
    c.head_dim = 128;
  }
  require_positive(c.head_dim, "head_dim", where);
  if (c.head_dim % 2 != 0) throw UsageError(where + ": head_dim must be even for RoPE");
  c.rms_eps = f.number("rms_norm_eps", 1e-5);
  c.tie_word_embeddings = f.boolean("tie_word_embeddings", false);
  c.initializer_range = f.number("initializer_range", 0.02);
  c.experts = f.integer("num_local_experts", 16);
  c.top_k = f.integer("num_experts_per_tok", 1);
  c.expert_width = f.integer("intermediate_size", 8192);
  c.shared_expert_width = c.expert_width;  // Llama4TextMoe.shared_expert: Llama4TextMLP(intermediate_size)
  c.dense_width = f.integer("intermediate_size_mlp", 16384);
  require_positive(c.dense_width, "intermediate_size_mlp", where);
  c.qkv_bias = c.o_bias = f.boolean("attention_bias", false);
  c.attn_scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
  c.router.score = RouterScore::Sigmoid;  // sigmoid of the top-k logits (the same experts as top-k of the sigmoids)
  c.has_aux_loss = false;                 // Llama4ForCausalLM returns no router aux loss
  c.rope.interleaved = true;              // apply_rotary_emb: complex pairs (x0, x1), (x2, x3), ...
  c.rope.dim = c.head_dim;

  std::vector<std::string> never;
  if (const std::string act = text(f, "hidden_act", "silu"); act != "silu") never.push_back("hidden_act '" + act + "' (only silu)");
  if (f.number("attention_dropout", 0.0) != 0) never.push_back("attention_dropout > 0 (eo-ddp trains without attention dropout)");

  // Which layers are MoE: moe_layers, else every interleave_moe_layer_step-th (from step - 1).
  if (f.has("moe_layers")) {
    const std::vector<int> moe = f.int_list("moe_layers");
    for (int l : moe)
      if (l < 0 || l >= c.layers) throw UsageError(where + ": moe_layers entry " + std::to_string(l) + " is not a layer index");
    for (int l = 0; l < c.layers; ++l)
      if (std::find(moe.begin(), moe.end(), l) == moe.end()) c.mlp_only_layers.push_back(l);
  } else {
    c.decoder_sparse_step = f.small_integer("interleave_moe_layer_step", 1);
    require_positive(c.decoder_sparse_step, "interleave_moe_layer_step", where);
  }

  Llama4Block b;
  // no_rope_layers: 1 = RoPE, 0 = NoPE, at least one entry per layer; absent or empty: a NoPE
  // layer every no_rope_layer_interval layers.
  const std::vector<int> nrl = f.int_list("no_rope_layers");
  if (!nrl.empty()) {
    if (static_cast<std::int64_t>(nrl.size()) < c.layers)
      throw UsageError(where + ": no_rope_layers has " + std::to_string(nrl.size()) + " entries for " + std::to_string(c.layers) +
                       " layers (one 0 or 1 per layer)");
    for (int l = 0; l < c.layers; ++l) {
      if (nrl[l] != 0 && nrl[l] != 1) throw UsageError(where + ": no_rope_layers entries must be 0 (NoPE) or 1 (RoPE)");
      b.rope_layers.push_back(nrl[l] == 1);
    }
  } else {
    const int interval = f.small_integer("no_rope_layer_interval", 4);
    require_positive(interval, "no_rope_layer_interval", where);
    for (int l = 0; l < c.layers; ++l) b.rope_layers.push_back((l + 1) % interval != 0);
  }
  // attention_chunk_size null: no chunked layers (transformers' default 8192).
  b.chunk = f.has("attention_chunk_size") ? f.integer("attention_chunk_size") : (f.j.contains("attention_chunk_size") ? 0 : 8192);
  if (f.has("attention_chunk_size")) require_positive(b.chunk, "attention_chunk_size", where);
  if (f.has("layer_types")) {
    const json& lt = tj->at("layer_types");
    if (!lt.is_array() || static_cast<std::int64_t>(lt.size()) != c.layers)
      throw UsageError(where + ": layer_types must be a list of num_hidden_layers (" + std::to_string(c.layers) + ") strings");
    for (const auto& t : lt) {
      if (t != "chunked_attention" && t != "full_attention")
        throw UsageError(where + ": layer_types entry " + t.dump() + " is not supported (chunked_attention, full_attention)");
      if (t == "chunked_attention" && b.chunk == 0)
        throw UsageError(where + ": layer_types has chunked_attention layers but attention_chunk_size is null");
      b.chunked_layers.push_back(t == "chunked_attention");
    }
  } else {
    for (int l = 0; l < c.layers; ++l) b.chunked_layers.push_back(b.rope_layers[l] && b.chunk > 0);
  }
  // The Hub's Scout / Maverick files say 4 (transformers 4.51 read it as true; 5.24's strict
  // config refuses it): an integer is taken as Python's truth value.
  if (f.has("attn_temperature_tuning") && tj->at("attn_temperature_tuning").is_number_integer())
    b.temperature_tuning = tj->at("attn_temperature_tuning").get<std::int64_t>() != 0;
  else
    b.temperature_tuning = f.boolean("attn_temperature_tuning", true);
  b.floor_scale = f.number("floor_scale", 8192);
  b.attn_scale = f.number("attn_scale", 0.1);
  if (b.temperature_tuning && !(b.floor_scale > 0)) throw UsageError(where + ": floor_scale must be positive");
  if (f.boolean("use_qk_norm", true)) c.qk_norm = QkNorm::L2;

  // RoPE: rope_parameters (transformers 5) or rope_theta / rope_scaling (the Hub's files).
  const json* rp = nullptr;
  if (f.has("rope_parameters")) rp = &tj->at("rope_parameters");
  else if (f.has("rope_scaling")) rp = &tj->at("rope_scaling");
  if (rp && !rp->is_object()) throw UsageError(where + ": field '" + std::string(f.has("rope_parameters") ? "rope_parameters" : "rope_scaling") + "' must be an object");
  const std::string rwhere = where + (f.has("rope_parameters") ? " rope_parameters" : " rope_scaling");
  const ConfigFields r{rp ? *rp : empty, rwhere};
  c.rope_theta = r.has("rope_theta") ? r.number("rope_theta") : f.number("rope_theta", 500000.0);
  const std::string type = text(r, "rope_type", text(r, "type", "default"));
  if (r.number("partial_rotary_factor", f.number("partial_rotary_factor", 1.0)) != 1.0)
    never.push_back("partial_rotary_factor other than 1");
  if (type == "llama3") {
    c.rope.llama3 = true;
    c.rope.factor = r.number("factor");
    c.rope.low_freq_factor = r.number("low_freq_factor");
    c.rope.high_freq_factor = r.number("high_freq_factor");
    c.rope.original_max_positions = r.number("original_max_position_embeddings", f.number("max_position_embeddings", 131072));
    if (!(c.rope.factor > 0) || !(c.rope.low_freq_factor > 0) || !(c.rope.high_freq_factor > 0) || !(c.rope.original_max_positions > 0))
      throw UsageError(rwhere + ": llama3 RoPE needs positive factor, low_freq_factor, high_freq_factor and original_max_position_embeddings");
  } else if (type != "default") {
    never.push_back("rope_type '" + type + "' (default, llama3)");
  }
  if (!never.empty()) {
    std::string m = where + ": this llama4 config is not supported (" +
                    (wrapper ? wrapper->class_name + " around a llama4_text model" : std::string("Llama4ForCausalLM")) +
                    "); options eo-ddp does not train:";
    for (const auto& s : never) m += "\n      " + s;
    throw UsageError(m);
  }
  c.llama4 = b;
  return c;
}

const std::string& supported_model_types() {
  // Each family's model_type; a text model that a wrapper holds under its own name is listed as
  // the wrapper's name (gemma4 (gemma4_text)); a wrapper around another family's model after it.
  static const std::string names = [] {
    std::string out;
    auto add = [&](const std::string& s) { out += (out.empty() ? "" : ", ") + s; };
    for (const auto& f : families()) {
      std::string name = f.model_type;
      for (const auto& w : multimodal_wrappers())
        if (w.text_model_type == name && w.model_type + "_text" == name) name = w.model_type + " (" + name + ")";
      add(name);
    }
    for (const auto& w : multimodal_wrappers())
      if (w.model_type + "_text" != w.text_model_type) add(w.model_type + " (around " + w.text_model_type + ")");
    return out;
  }();
  return names;
}

std::vector<int> ModelConfig::moe_layer_ids() const {
  std::vector<int> ids;
  for (int i = 0; i < layers; ++i)
    if (is_moe_layer(i)) ids.push_back(i);
  return ids;
}

bool ModelConfig::is_moe_layer(int layer) const {
  if (experts <= 0 || layer < first_k_dense) return false;
  for (int l : mlp_only_layers)
    if (l == layer) return false;
  return (layer + 1) % decoder_sparse_step == 0;
}

std::vector<ModelConfig::Linear> ModelConfig::attention_shapes(int layer) const {
  const std::int64_t H = hidden;
  if (is_linear_attention_layer(layer)) {  // peft's names under linear_attn
    const LinearAttention& a = *linear_attn;
    const std::int64_t kd = a.key_width(), vd = a.value_width();
    if (a.split_projections)
      return {{"in_proj_qkv", H, 2 * kd + vd, "linear_attn"}, {"in_proj_z", H, vd, "linear_attn"},
              {"in_proj_b", H, a.v_heads, "linear_attn"}, {"in_proj_a", H, a.v_heads, "linear_attn"},
              {"out_proj", vd, H, "linear_attn"}};
    return {{"in_proj_qkvz", H, 2 * kd + 2 * vd, "linear_attn"}, {"in_proj_ba", H, 2 * a.v_heads, "linear_attn"},
            {"out_proj", vd, H, "linear_attn"}};
  }
  if (!mla) {
    const std::int64_t D = head_dim_at(layer), kv = kv_heads_at(layer);
    std::vector<Linear> out{{"q_proj", H, heads * D * (attn_output_gate ? 2 : 1)}, {"k_proj", H, kv * D}};
    if (has_v_proj(layer)) out.push_back({"v_proj", H, kv * D});
    out.push_back({"o_proj", heads * D, H});
    return out;
  }
  const Mla& a = *mla;
  std::vector<Linear> out;
  if (a.q_lora_rank > 0) out = {{"q_a_proj", H, a.q_lora_rank}, {"q_b_proj", a.q_lora_rank, heads * a.qk_dim()}};
  else out = {{"q_proj", H, heads * a.qk_dim()}};
  out.push_back({"kv_a_proj_with_mqa", H, a.kv_lora_rank + a.rope_dim});
  out.push_back({"kv_b_proj", a.kv_lora_rank, heads * (a.nope_dim + a.v_dim)});
  out.push_back({"o_proj", heads * a.v_dim, H});
  return out;
}

std::vector<std::string> ModelConfig::attention_linears() const {
  std::vector<std::string> out;
  if (linear_attn) {  // the full-attention layers' linears, then the delta-rule layers'
    for (int pass = 0; pass < 2; ++pass)
      for (int i = 0; i < layers; ++i)
        if (is_linear_attention_layer(i) == (pass == 1))
          for (const auto& l : attention_shapes(i))
            if (std::find(out.begin(), out.end(), l.name) == out.end()) out.push_back(l.name);
    return out;
  }
  for (const auto& l : attention_shapes()) out.push_back(l.name);
  if (gemma) {  // v_proj where some layer has one (attention_k_eq_v: the sliding layers)
    bool v = false;
    for (int i = 0; i < layers; ++i) v = v || has_v_proj(i);
    out = {"q_proj", "k_proj"};
    if (v) out.push_back("v_proj");
    out.push_back("o_proj");
  }
  return out;
}

const std::vector<std::string>& all_linear_modules() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out = {"q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
                                    "kv_b_proj", "in_proj_qkvz", "in_proj_ba", "in_proj_qkv", "in_proj_z", "in_proj_b",
                                    "in_proj_a", "out_proj", "shared_expert_gate"};
    for (const auto& n : expert_linear_names()) out.push_back(n);  // the families' own (models/arch.cpp)
    return out;
  }();
  return names;
}

std::vector<std::string> ModelConfig::linear_modules() const {
  std::vector<std::string> out = attention_linears();
  bool dense = false, moe = false;
  for (int i = 0; i < layers; ++i) (is_moe_layer(i) ? moe : dense) = true;
  // The routed experts' linears where they have names of their own (Mixtral's w1, w2, w3, in name order).
  const std::array<std::string, 3> expert = expert_linears();
  const bool own_names = expert[0] != "gate_proj";
  if (moe && own_names && experts_lora_ok()) {
    std::vector<std::string> names(expert.begin(), expert.end());
    std::sort(names.begin(), names.end());
    out.insert(out.end(), names.begin(), names.end());
  }
  // The shared expert's linears (where the routed experts exist only fused, the only ones of these names).
  const bool shared = moe && shared_expert_width > 0;
  if (dense || dense_beside_experts() || shared || (moe && !own_names && experts_lora_ok())) out.insert(out.end(), {"gate_proj", "up_proj", "down_proj"});
  // The shared expert's sigmoid gate, a linear of one output (peft's all-linear adapts it too).
  if (moe && shared_expert_gated) out.push_back("shared_expert_gate");
  return out;
}

const std::vector<MultimodalWrapper>& multimodal_wrappers() {
  // transformers 5.24: Gemma4ForConditionalGeneration and Mistral3ForConditionalGeneration both
  // hold the text model as model.language_model and lm_head at the top. Mistral Small 4 ships as
  // the latter around a mistral4 text model (Mistral3Config's own default text model is a dense
  // mistral, which eo-ddp does not train); its save_pretrained writes llava's layout
  // (language_model.model.*, language_model.lm_head.weight: conversion_mapping.py "llava"), and
  // from_pretrained reads that or its own module names.
  static const std::vector<MultimodalWrapper> w = {
      {"gemma4", "gemma4_text", "gemma4_text", "Gemma4ForConditionalGeneration", "model.language_model.",
       {{"model.language_model.", "lm_head.weight"}}, /*tie_default=*/true, "vision and audio towers"},
      {"mistral3", "mistral4", "mistral", "Mistral3ForConditionalGeneration", "model.language_model.",
       {{"language_model.model.", "language_model.lm_head.weight"}, {"model.language_model.", "lm_head.weight"}}},
      // Llama4ForConditionalGeneration holds a Llama4ForCausalLM as language_model; unlike the two
      // above, its config ties nothing by default.
      {"llama4", "llama4_text", "llama4_text", "Llama4ForConditionalGeneration", "language_model.model.",
       {{"language_model.model.", "language_model.lm_head.weight"}}, /*tie_default=*/false},
      // Qwen3.5-MoE ships only as Qwen3_5MoeForConditionalGeneration (model.visual beside
      // model.language_model); its config ties nothing by default.
      {"qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5_moe_text", "Qwen3_5MoeForConditionalGeneration", "model.language_model.",
       {{"model.language_model.", "lm_head.weight"}}, /*tie_default=*/false},
  };
  return w;
}

namespace {
ModelConfig checked(ModelConfig c, const std::string& source);
ModelConfig parse_text(const json& j, const std::string& source, const MultimodalWrapper* wrapper);

// A multimodal wrapper's config.json: its text_config parsed as the text model's own, the decoder
// under the wrapper's prefix. lm_head tying is the wrapper's: transformers 5.24 ties by the
// top-level tie_word_embeddings (True by default in both wrappers' configs), not text_config's.
ModelConfig parse_wrapped(const json& j, const std::string& source, const MultimodalWrapper& w) {
  if (j.contains("text_config") && !j.at("text_config").is_null() && !j.at("text_config").is_object())
    throw UsageError(source + ": field 'text_config' must be an object");
  json tj = j.contains("text_config") && j.at("text_config").is_object() ? j.at("text_config") : json::object();
  const std::string where = source + " text_config";
  const std::string inner = text(ConfigFields{tj, where}, "model_type", w.text_type_default);
  if (inner != w.text_model_type)
    throw UsageError(where + ": model_type '" + inner + "' is not supported (eo-ddp trains " + w.model_type + " around a " +
                     w.text_model_type + " text model: " + w.class_name + " with text_config.model_type '" +
                     w.text_model_type + "')");
  tj["model_type"] = inner;
  ModelConfig c = parse_text(tj, where, &w);
  c.model_type = w.model_type;
  c.multimodal = w;
  std::vector<std::string> towers;
  for (const char* t : {"vision", "audio"})
    if (j.contains(std::string(t) + "_config") && !j.at(std::string(t) + "_config").is_null()) towers.push_back(t);
  c.other_towers = towers.empty()     ? "non-text parts are"
                   : towers.size() == 1 ? towers[0] + " tower is"
                                        : towers[0] + " and " + towers[1] + " towers are";
  c.tie_word_embeddings = ConfigFields{j, source}.boolean("tie_word_embeddings", w.tie_default);
  return c;
}
}  // namespace

ModelConfig parse_config(const json& j, const std::string& source) {
  if (!j.is_object()) throw UsageError(source + ": expected a JSON object");
  if (!j.contains("model_type") || !j.at("model_type").is_string())
    throw UsageError(source + ": field 'model_type' (string) is missing; supported: " + supported_model_types());
  for (const auto& w : multimodal_wrappers())
    if (j.at("model_type") == w.model_type) return parse_wrapped(j, source, w);
  return parse_text(j, source, nullptr);
}

namespace {
ModelConfig parse_text(const json& j, const std::string& source, const MultimodalWrapper* wrapper) {
  ConfigFields f{j, source};
  ModelConfig c;
  c.model_type = j.at("model_type").get<std::string>();
  const Family* fam = find_family(c.model_type);
  if (fam && fam->parse_whole) return checked(fam->parse_whole(j, source, wrapper), source);
  if (!fam)
    throw UsageError(source + ": model_type '" + c.model_type + "' is not supported; supported model types: " +
                     supported_model_types());
  c.arch = fam->arch;
  // The latent-attention families: DeepSeek's and the two built on it.
  const bool deepseek = fam->latent_attention;
  // gpt-oss ships its experts as MXFP4 (quantization_config.quant_method "mxfp4"): the loader
  // keeps them so or dequantises them (models/mxfp4.h). Other families' checkpoints are float or
  // bitsandbytes.
  if (f.has("quantization_config") && j.at("quantization_config").is_object()) {
    const ConfigFields q{j.at("quantization_config"), source};
    const std::string method = text(q, "quant_method", "");
    if (method == "mxfp4" && fam->expert_storage != ExpertStorage::GptOss)
      throw UsageError(source + ": quantization_config.quant_method 'mxfp4' is supported for gpt_oss experts only, not for " +
                       c.model_type);
    c.mxfp4_experts = method == "mxfp4";
    if (method == "modelopt") {  // NVIDIA modelopt's export (models/nvfp4.h)
      const std::string algo = text(q, "quant_algo", "");
      if (algo != "NVFP4")
        throw UsageError(source + ": quantization_config.quant_algo '" + algo + "' (modelopt) is not supported; eo-ddp reads "
                         "modelopt's NVFP4 checkpoints (quant_algo NVFP4) only");
      if (const auto g = q.integer("group_size", 16); g != 16)
        throw UsageError(source + ": quantization_config.group_size " + std::to_string(g) + " is not NVFP4's 16");
      c.nvfp4 = true;
    }
  }

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
  if (deepseek) {
    parse_mla(f, c);
  } else if (f.has("head_dim")) {
    c.head_dim = f.integer("head_dim");
  } else if (fam->head_dim > 0) {
    c.head_dim = fam->head_dim;
  } else {
    if (c.hidden % c.heads != 0) throw UsageError(source + ": hidden_size must be divisible by num_attention_heads when head_dim is absent");
    c.head_dim = c.hidden / c.heads;
  }
  require_positive(c.head_dim, "head_dim", source);
  if (c.head_dim % 2 != 0) throw UsageError(source + ": head_dim must be even for RoPE");
  c.rms_eps = f.number("rms_norm_eps", fam->rms_eps);
  if (fam->reads_hidden_act) {
    const std::string act = text(f, "hidden_act", "silu");
    if (act != "silu") throw UsageError(source + ": hidden_act '" + act + "' is not supported (only silu)");
  }

  double mscale_all_dim = 0;
  // Mistral4Config fills in its own YaRN parameters when none are given; eo-ddp reads them only.
  if (fam->query_position_scaling && !f.has("rope_parameters") && !f.has("rope_scaling"))
    throw UsageError(source + ": " + c.model_type + " needs 'rope_parameters' (transformers' Mistral4Config would substitute its "
                     "own YaRN defaults); copy them from the model's config.json");
  // Mistral4Config's default rotates the qk_rope_head_dim of each (nope + rope) head.
  const double default_partial = fam->rotary_over_qk_head ? static_cast<double>(c.mla->rope_dim) / static_cast<double>(c.mla->qk_dim())
                                                          : fam->partial_rotary;
  parse_rope(f, c, *fam, default_partial, mscale_all_dim);
  if (!fam->rope_scaling && c.rope.dim != c.head_dim)
    throw UsageError(source + ": partial_rotary_factor is not supported for " + c.model_type);
  c.rope.interleaved = fam->rope_pairs == RopePairs::Interleaved ||
                       (fam->rope_pairs == RopePairs::InterleavedByDefault && f.boolean("rope_interleave", true));
  c.attn_scale = 1.0 / std::sqrt(static_cast<double>(c.mla ? c.mla->qk_dim() : c.head_dim));
  // DeepSeek's softmax scale carries YaRN's mscale twice (q and k), as yarn_apply_mscale does.
  if (deepseek && c.rope.yarn && mscale_all_dim != 0) c.attn_scale *= std::pow(yarn_mscale(c.rope.factor, mscale_all_dim), 2);

  c.tie_word_embeddings = f.boolean("tie_word_embeddings", false);
  c.initializer_range = f.number("initializer_range", 0.02);
  c.router_aux_loss_coef = f.number("router_aux_loss_coef", fam->router_aux_loss_coef);

  fam->read_moe(f, c);
  return checked(std::move(c), source);
}

// The checks every family's config passes last.
ModelConfig checked(ModelConfig c, const std::string& source) {
  require_positive(c.experts, "number of experts", source);
  require_positive(c.top_k, "num_experts_per_tok", source);
  require_positive(c.expert_width, "expert intermediate size", source);
  require_positive(c.decoder_sparse_step, "decoder_sparse_step", source);
  // Bounds on what planning and building loop over (a few hundred experts and layers exist; these
  // are far above): a damaged or hostile config.json is refused at once, not planned for minutes.
  if (c.experts > (1 << 16))
    throw UsageError(source + ": " + std::to_string(c.experts) + " experts is over eo-ddp's limit of 65536; the file is damaged");
  if (c.layers > (1 << 14))
    throw UsageError(source + ": num_hidden_layers " + std::to_string(c.layers) + " is over eo-ddp's limit of 16384; the file is damaged");
  if (c.shared_expert_width < 0) throw UsageError(source + ": the shared expert width must not be negative");
  if (c.top_k > c.experts)
    throw UsageError(source + ": num_experts_per_tok (" + std::to_string(c.top_k) + ") exceeds the number of experts (" +
                     std::to_string(c.experts) + ")");
  if (c.router.group != GroupScore::None && c.top_k > c.router.topk_group * (c.experts / c.router.n_group))
    throw UsageError(source + ": num_experts_per_tok (" + std::to_string(c.top_k) + ") exceeds the experts of the " +
                     std::to_string(c.router.topk_group) + " groups a token may use");
  for (int l : c.mlp_only_layers)
    if (l < 0 || l >= c.layers) throw UsageError(source + ": mlp_only_layers entry " + std::to_string(l) + " is not a layer index");
  for (int l = 0; l < c.layers; ++l)
    if (!c.is_moe_layer(l) && c.dense_width <= 0)
      throw UsageError(source + ": layer " + std::to_string(l) + " is dense but 'intermediate_size' is missing or zero");
  return c;
}

}  // namespace

ModelConfig load_config(const std::string& model_dir) { return parse_config(read_config_json(model_dir), model_dir + "/config.json"); }

json read_config_json(const std::string& model_dir) {
  const std::string path = model_dir + "/config.json";
  std::string text;
  if (!read_input_file(path, text, "config.json", kMaxTextFileBytes))
    throw UsageError(path + ": cannot open (is --model a Hugging Face checkpoint folder?)");
  json j;
  try {
    j = json::parse(text, json_depth_limit([&] {
      throw UsageError(path + ": JSON nested deeper than " + std::to_string(kMaxJsonDepth) + " levels; not a config.json");
    }));
  } catch (const json::exception& e) {
    throw UsageError(path + ": invalid JSON: " + e.what());
  }
  // modelopt's exports without quantization_config in config.json say it in hf_quant_config.json
  // ({"quantization": {"quant_algo": ..., "group_size": ..., "exclude_modules": [...]}}), as vLLM reads it.
  if (j.is_object()) {
    std::string hq;
    if (read_input_file(model_dir + "/hf_quant_config.json", hq, "hf_quant_config.json", kMaxTextFileBytes)) {
      const json h = json::parse(hq, json_depth_limit([&] {
        throw UsageError(model_dir + "/hf_quant_config.json: JSON nested deeper than " + std::to_string(kMaxJsonDepth) +
                         " levels");
      }), false);
      if (!h.is_object() || !h.contains("quantization") || !h.at("quantization").is_object())
        throw UsageError(model_dir + "/hf_quant_config.json: expected an object with a 'quantization' object (modelopt's export)");
      json q = h.at("quantization");
      q["quant_method"] = "modelopt";
      if (!j.contains("quantization_config")) {
        j["quantization_config"] = q;
      } else {
        // Both describe the checkpoint: they must agree on the format, or which one was meant is a guess.
        const json& c = j.at("quantization_config");
        const auto algo = [](const json& o) {
          return o.is_object() && o.contains("quant_algo") && o.at("quant_algo").is_string() ? o.at("quant_algo").get<std::string>()
                                                                                                : std::string();
        };
        if (!algo(q).empty() && algo(c) != algo(q))
          throw UsageError(model_dir + ": config.json's quantization_config says quant_algo '" + algo(c) +
                           "' (quant_method '" + (c.is_object() ? c.value("quant_method", std::string()) : std::string()) +
                           "'), hf_quant_config.json says '" + algo(q) + "': the checkpoint's two descriptions of its "
                           "format disagree; correct or remove one");
      }
    }
  }
  return j;
}

}  // namespace eo::model
