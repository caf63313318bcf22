// YAML values read by shape. See yaml_values.h.
#include "runtime/yaml_values.h"

#include <cmath>

namespace eo {

std::string yaml_text(const YAML::Node& n) {
  YAML::Emitter out;
  out << YAML::Flow << n;
  return out.c_str();
}

bool is_null(const YAML::Node& n) { return !n.IsDefined() || n.IsNull(); }

std::string key_text(const YAML::Node& k) { return k.IsScalar() ? k.Scalar() : yaml_text(k); }

std::optional<bool> as_bool(const YAML::Node& n) {
  if (!n.IsScalar()) return std::nullopt;
  const std::string s = n.Scalar();
  if (s == "true" || s == "True" || s == "TRUE") return true;
  if (s == "false" || s == "False" || s == "FALSE") return false;
  return std::nullopt;
}

std::optional<std::int64_t> as_int(const YAML::Node& n) {
  if (!n.IsScalar()) return std::nullopt;
  const std::string s = n.Scalar();
  try {
    std::size_t pos = 0;
    const long long v = std::stoll(s, &pos, 10);
    if (pos == s.size()) return v;
  } catch (...) {
  }
  // Accept integral floats written as 1e3.
  try {
    std::size_t pos = 0;
    const double d = std::stod(s, &pos);
    if (pos == s.size() && std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9e18)
      return static_cast<std::int64_t>(d);
  } catch (...) {
  }
  return std::nullopt;
}

std::optional<double> as_double(const YAML::Node& n) {
  if (!n.IsScalar()) return std::nullopt;
  const std::string s = n.Scalar();
  try {
    std::size_t pos = 0;
    const double d = std::stod(s, &pos);
    if (pos == s.size() && std::isfinite(d)) return d;
  } catch (...) {
  }
  return std::nullopt;
}

std::string scalar_or_empty(const YAML::Node& n) { return n.IsDefined() && n.IsScalar() ? n.Scalar() : ""; }

}  // namespace eo
