// What a run leaves beside its adapter: the peft adapter folder itself (adapter_model.safetensors,
// adapter_config.json), the base it was trained on (kAdapterBaseFile) and the base model's
// tokenizer files, as axolotl leaves them; and nvfp4_merge_aware's start step, which the adapter
// records.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "models/lora.h"

namespace eo {

struct TrainConfig;
using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// What an adapter folder records beside its tensors, decided once from the config (adapter_record):
// peft's adapter_config.json (the LoRA, the base's name), the base it was trained on
// (kAdapterBaseFile) and nvfp4_merge_aware's start step as the config gives it.
struct AdapterRecord {
  model::LoraSpec lora;
  std::string base_name;     // adapter_config.json's base_model_name_or_path (hub::adapter_base_name)
  std::string base_model;    // the base_model folder, as configured
  bool load_in_4bit = false;
  int blocksize = 64;
  bool double_quant = false;
  std::string expert_quant;
  bool expert_offload = false;  // `eo-ddp generate --adapter` streams the experts likewise
  std::optional<double> merge_aware_start;  // nvfp4_merge_aware_start_step
};
AdapterRecord adapter_record(const TrainConfig& cfg);

// adapter_model.safetensors + adapter_config.json in `dir` (created), as peft writes them.
// `lora` holds peft-named tensors (base_model.model.....lora_A.weight).
// Writes a peft adapter folder (adapter_model.safetensors, adapter_config.json) and kAdapterBaseFile,
// which records the base the adapter was trained on (NF4 or not, blocksize, double quantisation).
// `merge_aware_trained`: the adapter trained through nvfp4_merge_aware's snapped forward; its
// adapter_config.json then records the quantiser as axolotl's merge_aware_callback.py does
// (nvfp4_merge_aware: {scale_mode fresh, pts_policy base_fused_max, encoder, start_step}), which
// axolotl merge-lora reads to merge onto fresh block scales.
void write_adapter(const std::string& dir, const NamedTensors& lora, const AdapterRecord& record, bool merge_aware_trained = false);
// nvfp4_merge_aware_start_step as the optimizer step from which the snapped forward runs (axolotl's
// MergeAwareScheduleCallback: a fraction f in (0, 1) is int(f * total_steps)); 0 when unset.
std::int64_t merge_aware_first_step(const TrainConfig& cfg, std::int64_t total_steps);
std::string merge_aware_start_text(const TrainConfig& cfg);  // for the log: "0", "5", "0.25"
// TrainingState::extra's key for "the snapped forward was on" (a checkpoint's adapter is stamped).
inline constexpr const char* kMergeAwareOnKey = "nvfp4_merge_aware_on";
inline constexpr const char* kAdapterBaseFile = "eo_ddp_base.json";
// What an adapter folder's kAdapterBaseFile records: the base it trained on, which `eo-ddp score`
// and `generate` load unless told otherwise.
struct AdapterBase {
  std::string file;  // the file read
  bool load_in_4bit = false;
  int blocksize = 64;
  bool double_quant = false;
  std::string expert_quant = "auto";
  bool expert_offload = false;  // the experts streamed from host homes (older adapters: false)
};
// nullopt when adapter_dir is empty or has no such file; a UsageError starting with `command` when
// the file is not readable JSON.
std::optional<AdapterBase> read_adapter_base(const std::string& adapter_dir, const std::string& command);
// Copies the base model's tokenizer files (tokenizer.json, tokenizer_config.json with its chat
// template, chat_template.jinja, special_tokens_map.json, vocabularies ...) beside the adapter, as
// axolotl does, so the output folder stands alone. Returns the names copied.
std::vector<std::string> copy_tokenizer_files(const std::string& base_model, const std::string& dir);

}  // namespace eo
