// config.json's fields read with their types checked, every error naming the key and the file:
// what models/hf_config.cpp and each family's own reading (models/family_config.cpp) share.
#pragma once

#include <climits>
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/error.h"

namespace eo::model {

// Typed field access with errors naming the key and file.
struct ConfigFields {
  const nlohmann::json& j;
  const std::string& source;

  bool has(const char* key) const { return j.contains(key) && !j.at(key).is_null(); }
  std::int64_t integer(const char* key) const {
    if (!has(key)) throw UsageError(source + ": required field '" + key + "' is missing");
    const nlohmann::json& v = j.at(key);
    if (!v.is_number_integer()) throw UsageError(source + ": field '" + key + "' must be an integer, got " + v.dump());
    if (v.is_number_unsigned() && v.get<std::uint64_t>() > static_cast<std::uint64_t>(INT64_MAX))
      throw UsageError(source + ": field '" + key + "' is too large, got " + v.dump());
    return v.get<std::int64_t>();
  }
  // An integer that must fit in an int (layer indices and counts used as int).
  int small_integer(const char* key, std::int64_t fallback) const {
    const std::int64_t v = integer(key, fallback);
    if (v < INT_MIN || v > INT_MAX) throw UsageError(source + ": field '" + key + "' is out of range, got " + std::to_string(v));
    return static_cast<int>(v);
  }
  std::int64_t integer(const char* key, std::int64_t fallback) const { return has(key) ? integer(key) : fallback; }
  double number(const char* key) const {
    if (!has(key)) throw UsageError(source + ": required field '" + key + "' is missing");
    const nlohmann::json& v = j.at(key);
    if (!v.is_number()) throw UsageError(source + ": field '" + key + "' must be a number, got " + v.dump());
    return v.get<double>();
  }
  double number(const char* key, double fallback) const { return has(key) ? number(key) : fallback; }
  bool boolean(const char* key, bool fallback) const {
    if (!has(key)) return fallback;
    const nlohmann::json& v = j.at(key);
    if (!v.is_boolean()) throw UsageError(source + ": field '" + key + "' must be true or false, got " + v.dump());
    return v.get<bool>();
  }
  std::vector<int> int_list(const char* key) const {
    std::vector<int> out;
    if (!has(key)) return out;
    const nlohmann::json& v = j.at(key);
    if (!v.is_array()) throw UsageError(source + ": field '" + key + "' must be a list of integers, got " + v.dump());
    for (const auto& x : v) {
      if (!x.is_number_integer()) throw UsageError(source + ": field '" + key + "' must be a list of integers, got " + v.dump());
      // Out-of-int values would wrap into valid-looking indices; report them as they are.
      if (x.is_number_unsigned() ? x.get<std::uint64_t>() > static_cast<std::uint64_t>(INT_MAX)
                                 : (x.get<std::int64_t>() < INT_MIN || x.get<std::int64_t>() > INT_MAX))
        throw UsageError(source + ": field '" + key + "' entry " + x.dump() + " is out of range");
      out.push_back(x.get<int>());
    }
    return out;
  }
};

inline void require_positive(std::int64_t v, const char* what, const std::string& source) {
  if (v <= 0) throw UsageError(source + ": '" + what + "' must be positive, got " + std::to_string(v));
  // Products of two sizes (vocab x hidden, heads x head_dim, ...) must not overflow int64 in the
  // model builder; no real dimension comes near 2^31.
  if (v > INT32_MAX)
    throw UsageError(source + ": '" + what + "' is " + std::to_string(v) + ", over 2^31 - 1; the file is damaged");
}

// String field: absent/null → fallback; anything but a string is an error naming the key.
inline std::string text(const ConfigFields& f, const char* key, const std::string& fallback) {
  if (!f.has(key)) return fallback;
  const nlohmann::json& v = f.j.at(key);
  if (!v.is_string()) throw UsageError(f.source + ": field '" + key + "' must be a string, got " + v.dump());
  return v.get<std::string>();
}

// A key whose only supported value is `want`, as JSON text (absent is fine): anything else is named
// in the error.
inline void require_value(const ConfigFields& f, const char* key, const std::string& want, const std::string& why) {
  if (!f.has(key)) return;
  const nlohmann::json& v = f.j.at(key);
  if (v.dump() == want) return;
  throw UsageError(f.source + ": " + key + " " + v.dump() + " is not supported (only " + want + "): " + why);
}

}  // namespace eo::model
