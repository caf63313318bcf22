#include "runtime/adapter_files.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <sstream>

#include "common/error.h"
#include "common/files.h"
#include "models/lora.h"
#include "models/safetensors.h"
#include "runtime/config.h"
#include "runtime/hub.h"
#include "runtime/runspec.h"
#include "runtime/train_state.h"

namespace eo {
namespace fs = std::filesystem;
using json = nlohmann::json;

std::int64_t merge_aware_first_step(const TrainConfig& cfg, std::int64_t total_steps) {
  const double v = cfg.nvfp4_merge_aware_start_step.value_or(0);
  return v > 0 && v < 1 ? static_cast<std::int64_t>(v * static_cast<double>(total_steps)) : static_cast<std::int64_t>(v);
}

std::string merge_aware_start_text(const TrainConfig& cfg) {
  std::ostringstream o;
  o << cfg.nvfp4_merge_aware_start_step.value_or(0);
  return o.str();
}

AdapterRecord adapter_record(const TrainConfig& cfg) {
  AdapterRecord r;
  r.lora = lora_spec(cfg);
  r.base_name = hub::adapter_base_name(cfg);
  r.base_model = cfg.base_model;
  r.load_in_4bit = cfg.load_in_4bit;
  r.blocksize = cfg.bnb_4bit_blocksize;
  r.double_quant = cfg.bnb_4bit_use_double_quant;
  r.expert_quant = cfg.expert_quant;
  r.expert_offload = cfg.expert_offload;
  r.merge_aware_start = cfg.nvfp4_merge_aware_start_step;
  return r;
}

void write_adapter(const std::string& dir, const NamedTensors& lora, const AdapterRecord& record, bool merge_aware_trained) {
  // An adapter with NaN/Inf would load and generate garbage: never written.
  if (const std::string bad = first_nonfinite(lora); !bad.empty())
    EO_FAIL("not writing the adapter to ", dir, ": ", bad, " holds NaN/Inf values");
  fs::create_directories(dir);
  // peft's names and shapes: a stacked expert LoRA is written as its per-expert slices (cut on
  // the host, after one device copy per stacked tensor).
  NamedTensors stacked, cpu;
  for (const auto& [n, t] : lora) stacked.emplace_back(n, t.detach().to(at::kCPU));
  for (const auto& [n, t] : model::peft_lora_tensors(stacked)) cpu.emplace_back(n, t.contiguous());
  st::save((fs::path(dir) / "adapter_model.safetensors").string(), cpu);
  model::write_adapter_config(dir, record.lora, record.base_name, model::lora_decoder_prefix(cpu),
                              model::lora_fused_experts_path(cpu));
  if (merge_aware_trained) {
    // axolotl's write_merge_aware_metadata; peft ignores the key. encoder null: eo-ddp's quantiser is
    // torchao's algorithm (tests/ref/nvfp4_merge_ref.py) but not torchao, whose version axolotl
    // merge-lora would otherwise compare with its own.
    const std::string path = (fs::path(dir) / "adapter_config.json").string();
    std::string text;
    EO_CHECK(read_file_nofollow(path, text), "cannot read ", path, " to record nvfp4_merge_aware in it");
    json j = json::parse(text);
    json start = nullptr;
    if (const auto& v = record.merge_aware_start) start = *v >= 1 || *v == 0 ? json(static_cast<std::int64_t>(*v)) : json(*v);
    j["nvfp4_merge_aware"] = {{"scale_mode", "fresh"}, {"pts_policy", "base_fused_max"}, {"encoder", nullptr}, {"start_step", start}};
    write_file_atomic(path, j.dump(2) + "\n");
  }
  // What the adapter was trained on top of (peft's config has no place for it): `eo-ddp score
  // --adapter` evaluates on the same base unless told otherwise.
  nlohmann::json base;
  base["base_model"] = record.base_model;
  base["load_in_4bit"] = record.load_in_4bit;
  base["bnb_4bit_blocksize"] = record.blocksize;
  base["bnb_4bit_use_double_quant"] = record.double_quant;
  base["expert_quant"] = record.expert_quant;
  base["expert_offload"] = record.expert_offload;
  write_file_atomic((fs::path(dir) / kAdapterBaseFile).string(), base.dump(2) + "\n");
}

std::optional<AdapterBase> read_adapter_base(const std::string& adapter_dir, const std::string& command) {
  const fs::path file = fs::path(adapter_dir) / kAdapterBaseFile;
  if (adapter_dir.empty() || !fs::exists(file)) return std::nullopt;
  AdapterBase base;
  base.file = file.string();
  try {
    std::string text;
    read_file_nofollow(base.file, text);
    const auto j = nlohmann::json::parse(text);
    base.load_in_4bit = j.value("load_in_4bit", false);
    base.blocksize = j.value("bnb_4bit_blocksize", 64);
    base.double_quant = j.value("bnb_4bit_use_double_quant", false);
    base.expert_quant = j.value("expert_quant", std::string("auto"));
    base.expert_offload = j.value("expert_offload", false);
  } catch (const std::exception& e) {
    throw UsageError(command + ": " + base.file + " is not readable JSON (" + e.what() +
                     "); pass --load-in-4bit or --no-load-in-4bit to say which base to use");
  }
  return base;
}

std::vector<std::string> copy_tokenizer_files(const std::string& base_model, const std::string& dir) {
  static const char* const kNames[] = {"tokenizer.json",     "tokenizer_config.json", "special_tokens_map.json",
                                       "added_tokens.json",  "chat_template.jinja",   "chat_template.json",
                                       "tokenizer.model",    "vocab.json",            "merges.txt",
                                       "vocab.txt",          "spiece.model"};
  std::vector<std::string> copied;
  for (const char* name : kNames) {
    const fs::path from = fs::path(base_model) / name;
    if (!fs::is_regular_file(from)) continue;
    std::string bytes;
    EO_CHECK(read_model_file(from.string(), bytes), "cannot read ", from.string(), " to copy it beside the adapter");
    write_file_atomic((fs::path(dir) / name).string(), bytes);
    copied.push_back(name);
  }
  return copied;
}

}  // namespace eo
