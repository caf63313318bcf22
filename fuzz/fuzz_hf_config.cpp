// libFuzzer: a Hugging Face config.json through eo::model::load_config (the folder loader the
// trainer and `eo-ddp score` use). Integer fields of a config that loads must equal the numbers
// written in the file exactly (no truncation to int, no wrap-around).
#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <string>

#include "common/error.h"
#include "fuzz/fuzz_common.h"
#include "models/hf_config.h"

namespace {

bool same_number(const nlohmann::json& v, std::int64_t x) {
  if (v.is_number_unsigned()) return x >= 0 && v.get<std::uint64_t>() == static_cast<std::uint64_t>(x);
  return v.is_number_integer() && v.get<std::int64_t>() == x;
}

// A field the file wrote must be the number parsed; an absent or null one took its family's
// default (Gemma 4 and Llama 4 default hidden_size, layers and vocab as transformers does).
bool written_or_default(const nlohmann::json& o, const char* key, std::int64_t x) {
  const auto it = o.find(key);
  return it == o.end() || it->is_null() || same_number(*it, x);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const std::string dir = [] {
    const std::string d = eo::fuzz::scratch_dir() + "/hf";
    std::filesystem::create_directories(d);
    return d;
  }();
  eo::fuzz::write_file(dir + "/config.json", data, size);
  try {
    const eo::model::ModelConfig c = eo::model::load_config(dir);
    // What the model builder relies on after a successful parse.
    EO_FUZZ_ASSERT(c.hidden > 0 && c.layers > 0 && c.heads > 0 && c.kv_heads > 0 && c.vocab > 0);
    EO_FUZZ_ASSERT(c.heads % c.kv_heads == 0 && c.head_dim > 0 && c.head_dim % 2 == 0);
    EO_FUZZ_ASSERT(c.experts > 0 && c.top_k > 0 && c.top_k <= c.experts && c.expert_width > 0);
    EO_FUZZ_ASSERT(c.decoder_sparse_step > 0);
    for (std::int64_t l = 0; l < c.layers; ++l)
      EO_FUZZ_ASSERT(c.is_moe_layer(static_cast<int>(l)) || c.dense_width > 0);
    EO_FUZZ_ASSERT(!c.moe_prefix().empty());
    // RoPE and latent attention shapes the attention code slices by.
    EO_FUZZ_ASSERT(c.rope.dim > 0 && c.rope.dim % 2 == 0 && c.rope.dim <= c.head_dim && c.attn_scale > 0);
    if (c.mla)
      EO_FUZZ_ASSERT(c.mla->kv_lora_rank > 0 && c.mla->nope_dim > 0 && c.mla->v_dim > 0 && c.mla->rope_dim == c.head_dim &&
                     c.kv_heads == c.heads && c.mla->q_lora_rank >= 0);
    if (c.router.group != eo::model::GroupScore::None)
      EO_FUZZ_ASSERT(c.router.n_group > 1 && c.experts % c.router.n_group == 0 && c.router.topk_group <= c.router.n_group &&
                     c.top_k <= c.router.topk_group * (c.experts / c.router.n_group));
    const auto file = nlohmann::json::parse(data, data + size, nullptr, false);
    EO_FUZZ_ASSERT(file.is_object());
    // A multimodal wrapper's numbers are its text_config's (an absent one defaults every field).
    static const nlohmann::json no_fields = nlohmann::json::object();
    const nlohmann::json& j = !c.multimodal ? file : file.contains("text_config") ? file.at("text_config") : no_fields;
    EO_FUZZ_ASSERT(j.is_object());
    EO_FUZZ_ASSERT(written_or_default(j, "hidden_size", c.hidden) && written_or_default(j, "num_hidden_layers", c.layers));
    EO_FUZZ_ASSERT(written_or_default(j, "vocab_size", c.vocab));
    // Only the Qwen families read decoder_sparse_step and mlp_only_layers (Llama 4 and GLM-4.7-Flash
    // derive their dense layers from their own keys).
    const bool qwen = c.arch == eo::model::Arch::Qwen3Moe || c.arch == eo::model::Arch::Qwen2Moe;
    if (qwen) EO_FUZZ_ASSERT(written_or_default(j, "decoder_sparse_step", c.decoder_sparse_step));
    if (qwen && j.contains("mlp_only_layers") && j.at("mlp_only_layers").is_array() && !c.mlp_only_layers.empty()) {
      const auto& written = j.at("mlp_only_layers");
      EO_FUZZ_ASSERT(written.size() >= c.mlp_only_layers.size());
      for (std::size_t i = 0; i < c.mlp_only_layers.size(); ++i) EO_FUZZ_ASSERT(same_number(written.at(i), c.mlp_only_layers[i]));
    }
  } catch (const eo::Error&) {
  }
  return 0;
}
