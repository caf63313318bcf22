// Which linears an adapter reaches: the one rule the model's LoRA sites (moe_model_lora.cpp), the
// memory plan (models/block_memory.cpp), the run's resolution (runtime/runspec.cpp) and the
// step-time estimate read.
#pragma once

#include <string>

#include "models/lora.h"

namespace eo::model {

// Whether `spec` adapts the linears of short name `name` (q_proj, w1, shared_expert_gate, ...):
// every linear with `all_linear` (lora_target_linear before the config resolves it to the model's
// names), else those spec.targets names; with `layer` >= 0, only where layers_to_transform takes it.
inline bool adapts_module(const LoraSpec& spec, bool all_linear, const std::string& name, int layer = -1) {
  return (all_linear || spec.targets_module(name)) && (layer < 0 || spec.targets_layer(layer));
}

}  // namespace eo::model
