// axolotl's overrides_of_model_config (older configs: model_config): values that replace
// config.json's top-level keys before the model is planned or built, as axolotl's setattr on the
// loaded transformers config does (e.g. rope_scaling, rope_theta, max_position_embeddings).
// output_router_logits is eo-ddp's own key and is read as that key. An override that would change
// a tensor's shape, or which tensors the checkpoint must hold, is refused: the checkpoint's weights
// were made for config.json as written.
#pragma once

#include <yaml-cpp/yaml.h>

#include <string>
#include <vector>

#include "common/error.h"
#include "models/hf_config.h"
#include "runtime/config.h"

namespace eo {

// An override that changes the weights' shapes (a config error of overrides_of_model_config).
class ModelOverrideError : public UsageError {
 public:
  using UsageError::UsageError;
};

// Reads the map `n` written under `key` into c.model_config_overrides (and output_router_logits);
// what is wrong goes to `problems`.
void read_model_config_overrides(const YAML::Node& n, const std::string& key, TrainConfig& c,
                                 std::vector<ConfigIssue>& problems);

// base_model's config.json with c.model_config_overrides applied, parsed. Each applied override is
// noted in `notes` when given; one that changes the weights' shapes is a ModelOverrideError naming it.
model::ModelConfig load_model_config(const TrainConfig& c, std::vector<std::string>* notes = nullptr);

}  // namespace eo
