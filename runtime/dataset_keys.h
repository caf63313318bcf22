// The keys of a `datasets` / `test_datasets` entry, one table (runtime/config_datasets.cpp): which
// type takes each key, its value, default and meaning. The parser, the resolved-config printout,
// `--help-config` and docs/configuration.md all read it.
#pragma once

#include <vector>

#include "runtime/config.h"

namespace eo {

// The rows as ConfigKeyDoc, each key named datasets[].KEY (test_datasets' entries take the same).
std::vector<ConfigKeyDoc> dataset_key_docs();

}  // namespace eo
