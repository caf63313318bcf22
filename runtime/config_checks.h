// The config's rules that involve several keys, the files it names, and base_model's config.json:
// run after every key is read, each adding issues so that one --check names every problem.
#pragma once

#include <yaml-cpp/yaml.h>

#include <map>
#include <set>
#include <string>

#include "models/hf_config.h"
#include "runtime/config_schema.h"

namespace eo::config_detail {

// `present`: the keys the config (or --set) gave a value.
void check_rules(const TrainConfig& c, const std::set<std::string>& present, Issues& issues);

// axolotl's check_nvfp4_merge_aware (integrations/kernels/args.py), the same refusals; and what
// eo-ddp's merge-aware path cannot do beside it. `noted`: the Noted / Rejected keys set, as written.
void check_merge_aware(const TrainConfig& c, const std::set<std::string>& present, const std::map<std::string, YAML::Node>& noted,
                       Issues& issues);

// The folders and files the config names exist and are of the right kind.
void check_files(const TrainConfig& c, const std::set<std::string>& present, Issues& issues);

// Checks against base_model's config.json (skipped when it cannot be read; reported elsewhere).
// lora_target_linear resolves to the architecture's linears (ModelConfig::linear_modules); any
// target that matches none of them is a config error here, before a weight is read. So is asking
// for the router aux loss of a family transformers computes none for, and lora_target_parameters
// on a model without the fused [E, 2I, H] gate_up_proj experts it is built for. `parsed` receives
// the config.json read.
void check_targets(TrainConfig& c, const std::set<std::string>& present, Issues& issues, model::ModelConfig* parsed);

}  // namespace eo::config_detail
