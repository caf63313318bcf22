// The Hugging Face module paths of a model's linears, as its checkpoint and peft name them, read
// from the family's row (models/arch.h): what lora_target_modules' regular expressions and dotted
// suffixes are matched against.
#pragma once

#include <string>
#include <vector>

#include "models/hf_config.h"

namespace eo::model {

struct HfModule {
  std::string name;  // model.layers.0.self_attn.q_proj, ...experts.3.down_proj, lm_head
  bool adaptable;    // a linear eo-ddp adapts (not a router, lm_head or a shared expert's gate)
};

// Every layer's linears in model order (routed experts one module per expert, where peft has
// such modules), then lm_head.
std::vector<HfModule> hf_linear_modules(const ModelConfig& mc);

}  // namespace eo::model
