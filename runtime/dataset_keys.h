// The keys of a `datasets` / `test_datasets` entry, one table (runtime/config_datasets.cpp): which
// type takes each key, its value, default and meaning. The parser, the resolved-config printout,
// `--help-config`, docs/configuration.md, axolotl's key list and tools/prepare_data.py all read it.
#pragma once

#include <nlohmann/json.hpp>

#include <vector>

#include "runtime/config.h"

namespace eo {

// The rows as ConfigKeyDoc, each key named datasets[].KEY (test_datasets' entries take the same).
std::vector<ConfigKeyDoc> dataset_key_docs();

// The keys' defaults as values ({"field_messages": "messages", "roles_to_train": ["assistant"], ...}),
// which tools/prepare_data.py reads from its spec instead of keeping its own. A default written in
// parentheses describes what happens (required, none, another key's value) and is left out.
nlohmann::json dataset_key_defaults();

}  // namespace eo
