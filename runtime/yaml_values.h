// A config's YAML values read by shape: yaml-cpp converts leniently ("1.0" as int fails, "yes" as
// bool works), so the config readers check each scalar's shape themselves for a precise message.
#pragma once

#include <yaml-cpp/yaml.h>

#include <cstdint>
#include <optional>
#include <string>

namespace eo {

std::string yaml_text(const YAML::Node& n);  // the value as flow YAML, for messages
bool is_null(const YAML::Node& n);           // undefined or null
// A mapping key as text. A sequence or map used as a key ("? [a, b]: 1") is shown as YAML, so it
// is reported as an unknown key instead of escaping as yaml-cpp's BadConversion.
std::string key_text(const YAML::Node& k);
std::optional<bool> as_bool(const YAML::Node& n);           // true / True / TRUE, false / ...
std::optional<std::int64_t> as_int(const YAML::Node& n);    // 12, or an integral float (1e3)
std::optional<double> as_double(const YAML::Node& n);       // finite numbers
std::string scalar_or_empty(const YAML::Node& n);           // a scalar's text, else ""

}  // namespace eo
