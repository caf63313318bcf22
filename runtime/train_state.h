// What a run writes to disk: peft adapters and resumable training-state checkpoints, and the
// output_dir that one run owns.
//
// A checkpoint is a folder output_dir/checkpoint-<step>/ holding the adapter (peft format, so
// any checkpoint can be loaded in Python), optimizer.safetensors, rng.safetensors and
// trainer_state.json (step, data cursor, world size, the run's identity and the config keys a
// resume must agree with), then checksums.txt: every other file's size and hash, and a hash of
// itself. It is written into a temporary sibling folder, every file fsynced, trainer_state.json
// and checksums.txt last; then renamed into place and the parent fsynced: a crash at any moment
// leaves either the previous complete checkpoint or the new one, never a torn one. Replacing a
// checkpoint of the same step moves the old one aside first (see save_checkpoint). A checkpoint
// whose bytes changed after the save (a flipped bit, an edit) is never loaded: `auto` falls back
// to the previous intact one with a warning. No checkpoint or adapter holds NaN/Inf values.
//
// Ownership. output_dir/run.json names the run that owns the folder (run_id, kept across resumes)
// and its lineage: one segment per start of the program, each with the step it started from. A
// checkpoint records the lineage that wrote it, so after a resume from checkpoint-2 the abandoned
// checkpoint-6 of the first segment is no longer part of the run: `auto` never picks it and
// pruning never counts it. A run never deletes checkpoints of another run.
#pragma once

#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/files.h"  // write_file_atomic, fsync_path: the one atomic writer

namespace eo {

struct TrainConfig;
namespace model {
struct LoraSpec;
}
using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;


struct TrainingState {
  std::int64_t step = 0;         // optimizer steps completed
  nlohmann::json data_cursor;    // the batcher's state
  nlohmann::json extra;          // anything else the trainer wants back (e.g. counters)
  int world_size = 1;
  NamedTensors lora;             // peft names
  NamedTensors optimizer;        // Optimizer::state()
  NamedTensors rng;              // generator states as uint8 tensors
  // Filled by save_checkpoint / load_checkpoint (callers need not set them):
  std::string run_id;            // empty: a checkpoint of an eo-ddp without run ids
  nlohmann::json lineage;        // [{"segment": id, "start_step": n}, ...], oldest first
  nlohmann::json recorded;       // the config keys check_resume_compatible compares
};

// Writes output_dir/checkpoint-<step>/ atomically and keeps the newest `keep` checkpoints of this
// run's lineage (never another run's), and also the newest one with a step below
// keep_newest_before (the trainer passes its first step skipped for NaN/Inf). Returns the folder
// written. Refuses (eo::Error) a state whose LoRA or optimizer tensors hold NaN/Inf.
std::string save_checkpoint(const std::string& output_dir, const TrainingState& state, const TrainConfig& cfg, int keep,
                            std::int64_t keep_newest_before = -1);

// The newest complete, intact checkpoint folder in output_dir (for resume_from_checkpoint: auto):
// of the lineage in output_dir/run.json when there is one, else of any run. A damaged one
// (checkpoint_damage) is passed over with a warning naming it and the one taken instead. Folder
// names that are not checkpoint-<step> with a step eo-ddp can write are ignored with a warning.
std::optional<std::string> latest_checkpoint(const std::string& output_dir);

// The checkpoint a run continues from: resume_from_checkpoint's folder, with `auto` the newest
// complete one in output_dir (logged when there is none); empty: a fresh start.
std::string resume_folder(const TrainConfig& cfg);
// Loads checkpoint `folder` and copies its LoRA tensors into `lora`, which must match them all by
// name and shape (eo::Error naming the first that does not: a different model, lora_target_modules
// or lora_r). Returns the rest (optimizer, RNG, data cursor, step, extra) for the caller to restore.
TrainingState resume_lora(const std::string& folder, const NamedTensors& lora);

// Why the files of checkpoint `folder` are not those saved (a file changed, missing, or the
// checksum file itself damaged), or "" when they all match (or the checkpoint predates checksums).
std::string checkpoint_damage(const std::string& folder);

// The name of the first tensor holding NaN/Inf, or "".
std::string first_nonfinite(const NamedTensors& tensors);

// Checks every file against its checksum first (UsageError naming the file if damaged);
// with_tensors = false then reads trainer_state.json only (for checks before loading). Tensors
// with NaN/Inf are refused (eo::Error).
TrainingState load_checkpoint(const std::string& folder, bool with_tensors = true);

// Probes that output_dir (or another folder the run writes, named `key` in messages) can be created and written (a file created and removed in it), without
// loading anything. Throws UsageError naming the folder and the reason (read-only file system,
// permission, not a folder).
void check_output_dir_writable(const std::string& output_dir, const std::string& key = "output_dir");

// What claim_output_dir decided.
struct RunClaim {
  std::string run_id;
  std::string resume;  // the checkpoint folder to resume from ("" = start fresh); `auto` resolved
  std::vector<std::string> notes;     // for the log
  std::vector<std::string> warnings;  // e.g. keys changed since the resumed checkpoint
  std::shared_ptr<void> lock;      // the flock on output_dir; released when the last copy goes
};

// Takes output_dir for this run, before any weight is loaded (rank 0 only; the folder is written
// by rank 0): creates it, probes that it is writable, takes exclusive flocks on the folder itself
// and on output_dir/.eo-ddp.lock, held until the process exits (a second run refuses naming the
// holder's pid and host, also when the lock file was deleted; where a folder cannot be locked,
// every save checks that the lock file is still the one held), finishes or rolls back a checkpoint replacement that a crash interrupted,
// resolves resume_from_checkpoint (auto = newest checkpoint of the lineage in run.json), checks the
// resume with check_resume_compatible (its warnings go to notes), refuses a
// fresh run in a folder holding another run's checkpoints (unless overwrite_output_dir: true),
// then records this segment in output_dir/run.json.
// `world_size` > 0: this run's ranks, for check_resume_compatible. A fresh run moves another run's
// checkpoints to output_dir/other-runs/ with overwrite_output_dir: true.
RunClaim claim_output_dir(const TrainConfig& cfg, int world_size = 0);

}  // namespace eo
