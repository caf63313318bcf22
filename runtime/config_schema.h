// The config schema, internal to the config reader (runtime/config*.cpp): one KeySpec per key, the
// builders for the common kinds of key, and the value helpers the readers share. The public API
// is runtime/config.h.
#pragma once

#include <yaml-cpp/yaml.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "runtime/config.h"

namespace eo::config_detail {

// Problems are collected, not thrown, so that one run reports every one of them.
using Issues = std::vector<ConfigIssue>;

// One key. `read` converts and range-checks the YAML value into the config, adding issues instead
// of throwing.
struct KeySpec {
  std::string key;  // dotted
  std::string type;
  std::string default_text;
  std::string doc;
  std::function<void(const YAML::Node&, TrainConfig&, Issues&)> read;
  // The resolved value for printing; an undefined node when the key is unset.
  std::function<YAML::Node(const TrainConfig&)> write;
};

// Every key eo-ddp reads, in the order of the reference (runtime/config_keys.cpp).
const std::vector<KeySpec>& schema();

// Values for the resolved-config printout. Doubles in their shortest form that reads back
// exactly (0.05, not yaml-cpp's 17-digit 0.050000000000000003).
template <typename T>
YAML::Node value_node(const T& v) {
  return YAML::Node(v);
}
YAML::Node value_node(double v);

template <typename T>
std::function<YAML::Node(const TrainConfig&)> writer(T TrainConfig::*field) {
  return [field](const TrainConfig& c) { return value_node(c.*field); };
}

template <typename T>
std::function<YAML::Node(const TrainConfig&)> writer(std::optional<T> TrainConfig::*field) {
  return [field](const TrainConfig& c) { return (c.*field) ? value_node(*(c.*field)) : YAML::Node(); };
}

// The builders: a key of that kind read into `field`, its default taken from TrainConfig's.
KeySpec boolean(std::string key, bool TrainConfig::*field, std::string doc);
KeySpec integer(std::string key, int TrainConfig::*field, std::int64_t lo, std::int64_t hi, std::string doc);
// Optional variants: unset (the default is derived from other keys) until the YAML sets them.
KeySpec boolean(std::string key, std::optional<bool> TrainConfig::*field, std::string doc);
KeySpec integer(std::string key, std::optional<int> TrainConfig::*field, std::int64_t lo, std::int64_t hi, std::string doc);
// Range check for reals: [lo, hi] or (lo, hi] when lo_open.
KeySpec real(std::string key, double TrainConfig::*field, double lo, bool lo_open, double hi, std::string doc);
KeySpec choice(std::string key, std::string TrainConfig::*field, std::vector<std::string> allowed, std::string doc);
KeySpec text(std::string key, std::string TrainConfig::*field, std::string doc);
// How often, in optimizer steps: a whole number, or a fraction in (0, 1) of the run's steps (as
// axolotl and transformers read it; step_interval resolves it); 0 = never where zero_ok.
KeySpec steps_or_fraction(std::string key, std::optional<double> TrainConfig::*field, bool zero_ok, std::string doc);

// A scalar or a list of scalars as strings; else an issue naming the key.
std::optional<std::vector<std::string>> string_list(const std::string& key, const YAML::Node& n, const std::string& what,
                                                    Issues& issues);
inline bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

}  // namespace eo::config_detail
