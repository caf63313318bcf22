// Whether a checkpoint may be resumed with this config: the keys a checkpoint records, compared
// with the config's on resume.
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "runtime/train_state.h"

namespace eo {

// The config keys a checkpoint records, and the comparison on resume: a changed base model
// (base_model_identity, runtime/model_identity.h: every byte of its weights), lora_r, lora_alpha, peft_use_rslora,
// target modules, sequence_len, sample_packing, NF4 settings or datasets are refused (one
// UsageError listing every key, what the checkpoint has and what the config has); changes that
// only alter the rest of the run (learning rate, schedule, dropout, a moved base_model folder
// with the same contents, ...) return warnings. A checkpoint that recorded nothing (older
// eo-ddp) gives one warning.
nlohmann::json recorded_config(const TrainConfig& cfg);
// `world_size` > 0: the ranks of this run, compared with the checkpoint's (a warning).
std::vector<std::string> check_resume_compatible(const TrainingState& checkpoint, const TrainConfig& cfg,
                                                 int world_size = 0);

}  // namespace eo
