// The `datasets:` / `test_datasets:` lists: each entry's keys checked against its type (a key that
// shapes tokens but does not apply to the type is an error, never silently dropped), and written
// back for the resolved-config printout.
#pragma once

#include <yaml-cpp/yaml.h>

#include <string>
#include <vector>

#include "runtime/config_schema.h"

namespace eo::config_detail {

// Reads the list `n` of key `key` (datasets or test_datasets) into `out`; older axolotl forms are
// rewritten first (runtime/datasets_legacy.h), noted in `warnings`.
void read_datasets(const YAML::Node& n, const std::string& key, std::vector<DatasetSpec>& out, std::vector<std::string>& warnings,
                   Issues& issues);
YAML::Node write_datasets(const std::vector<DatasetSpec>& list);

}  // namespace eo::config_detail
