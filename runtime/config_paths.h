// The one rule for relative paths in a config:
//   a relative path written in the config file is resolved against the folder the file is in;
//   one given with --set, against the current folder (where the shell that typed it is).
// So a config and the model, data and outputs beside it work from any folder. For configs written
// for the folder they are run from: an input (base_model, datasets, tokenizer_config,
// lora_model_dir, resume_from_checkpoint) that is not under the config's folder but is under the
// current one is taken from there, with a warning. An input found nowhere is left as written (a
// Hub name such as Qwen/Qwen3-30B-A3B is no path); errors about it say what it was resolved against.
#pragma once

#include <set>
#include <string>
#include <vector>

namespace eo {

struct TrainConfig;

// `config_dir`: the config file's folder (empty: no file, every path as written); `written`: the
// keys set in the file or with --set (a default such as output_dir's ./model-out stays relative to
// the current folder, as in axolotl); `overrides`: the --set key=value assignments.
void resolve_config_paths(TrainConfig& cfg, const std::string& config_dir, const std::set<std::string>& written,
                          const std::vector<std::string>& overrides);

// A path for an error message: "'fixtures/x' (resolved against /abs/dir)" for a relative one.
std::string shown_path(const TrainConfig& cfg, const std::string& path);

}  // namespace eo
