// axolotl's keys that eo-ddp's schema does not read, and what it does with each: one table
// (runtime/axolotl_keys.inc, from axolotl's schema), so a config written for axolotl runs or is
// refused for a stated reason, and a key in neither is a typo. Also the few axolotl keys whose
// values eo-ddp reads itself.
#pragma once

#include <yaml-cpp/yaml.h>

#include <string>
#include <vector>

#include "runtime/config_schema.h"

namespace eo::config_detail {

struct AxolotlKey {
  enum Class { Implemented, Noted, Rejected };
  const char* key;  // a datasets entry's key as datasets[].KEY
  Class cls;
  const char* text;
};
const std::vector<AxolotlKey>& axolotl_table();
const AxolotlKey* axolotl_key(const std::string& key);  // nullptr when axolotl has no such key

// A value that asks for nothing: null, false, empty, 0 (a parallel size: 1).
bool is_off(const YAML::Node& n, bool size);

// A Noted or Rejected key (or datasets entry key) at `where`: a log line, an issue, or nothing
// when off.
void apply_axolotl_key(const AxolotlKey& a, const std::string& where, const YAML::Node& node, std::vector<std::string>& warnings,
                       Issues& issues);

// axolotl keys whose values eo-ddp reads itself (the table's Implemented entries with a text):
// true when `key` is one of them (read into `c`, or an issue).
bool read_axolotl_special(const std::string& key, const YAML::Node& n, TrainConfig& c, Issues& issues);

}  // namespace eo::config_detail
