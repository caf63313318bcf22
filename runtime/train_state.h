// What a run writes to disk: peft adapters and resumable training-state checkpoints.
//
// A checkpoint is a folder output_dir/checkpoint-<step>/ holding the adapter (peft format, so
// any checkpoint can be loaded in Python), optimizer.safetensors, rng.safetensors and
// trainer_state.json (step, data cursor, schedule, world size). It is written into a temporary
// sibling folder, every file fsynced, then renamed into place and the parent fsynced: a crash
// at any moment leaves either the previous complete checkpoint or the new one, never a torn one.
#pragma once

#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace eo {

struct TrainConfig;
using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// adapter_model.safetensors + adapter_config.json in `dir` (created), as peft writes them.
// `lora` holds peft-named tensors (base_model.model.....lora_A.weight).
void write_adapter(const std::string& dir, const NamedTensors& lora, const TrainConfig& cfg);

struct TrainingState {
  std::int64_t step = 0;         // optimizer steps completed
  nlohmann::json data_cursor;    // the batcher's state
  nlohmann::json extra;          // anything else the trainer wants back (e.g. counters)
  int world_size = 1;
  NamedTensors lora;             // peft names
  NamedTensors optimizer;        // Optimizer::state()
  NamedTensors rng;              // generator states as uint8 tensors
};

// Writes output_dir/checkpoint-<step>/ atomically and keeps the newest `keep` checkpoints.
// Returns the folder written.
std::string save_checkpoint(const std::string& output_dir, const TrainingState& state, const TrainConfig& cfg, int keep);

// The newest complete checkpoint folder in output_dir (for resume_from_checkpoint: auto).
std::optional<std::string> latest_checkpoint(const std::string& output_dir);

TrainingState load_checkpoint(const std::string& folder);

// Durable file helpers (used by the above; also for metrics and adapters).
void fsync_path(const std::string& path);  // a file or a folder
void write_file_atomic(const std::string& path, const std::string& contents);

}  // namespace eo
