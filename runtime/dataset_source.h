// Where a dataset's rows come from, beyond its path and type: a Hub dataset's revision and
// data_files, the file format (ds_type), and axolotl's shards / shards_idx.
#pragma once

#include <yaml-cpp/yaml.h>

#include <string>
#include <vector>

#include "runtime/config.h"

namespace eo {

// Reads those keys of the datasets entry `d` (at `where`, e.g. datasets.0) into `s`, whose path and
// type are already read; what is wrong goes to `issues`.
void read_dataset_source(const YAML::Node& d, const std::string& where, DatasetSpec& s, std::vector<ConfigIssue>& issues);

}  // namespace eo
