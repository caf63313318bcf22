// The config schema's builders and shared value helpers (runtime/config_schema.h).
#include "runtime/config_schema.h"

#include <charconv>
#include <cmath>
#include <sstream>

#include "common/text.h"
#include "runtime/yaml_values.h"

namespace eo::config_detail {
namespace {

// The YAML integer of `key` if it lies in [lo, hi]; else an issue naming the key.
std::optional<std::int64_t> int_in_range(const std::string& key, const YAML::Node& n, std::int64_t lo, std::int64_t hi,
                                         Issues& issues) {
  auto v = as_int(n);
  if (!v) {
    issues.push_back({key, "expected an integer, got '" + yaml_text(n) + "'"});
    return std::nullopt;
  }
  if (*v < lo || *v > hi) {
    issues.push_back({key, "must be between " + std::to_string(lo) + " and " + std::to_string(hi) + ", got " + std::to_string(*v)});
    return std::nullopt;
  }
  return v;
}

std::string fmt_double(double d) {
  std::ostringstream os;
  os << d;
  return os.str();
}

}  // namespace

YAML::Node value_node(double v) {
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  return YAML::Node(std::string(buf, r.ptr));
}

KeySpec boolean(std::string key, bool TrainConfig::*field, std::string doc) {
  TrainConfig defaults;
  return {key, "bool", defaults.*field ? "true" : "false", std::move(doc),
          [key, field](const YAML::Node& n, TrainConfig& c, Issues& issues) {
            if (auto v = as_bool(n)) c.*field = *v;
            else issues.push_back({key, "expected true or false, got '" + yaml_text(n) + "'"});
          },
          writer(field)};
}

std::optional<std::vector<std::string>> string_list(const std::string& key, const YAML::Node& n, const std::string& what,
                                                    Issues& issues) {
  std::vector<std::string> v;
  if (n.IsScalar()) {
    v.push_back(n.Scalar());
    return v;
  }
  if (n.IsSequence())
    for (const auto& e : n) {
      if (!e.IsScalar()) break;
      v.push_back(e.Scalar());
    }
  if (!n.IsSequence() || v.size() != n.size()) {
    issues.push_back({key, "expected a list of " + what});
    return std::nullopt;
  }
  return v;
}

KeySpec integer(std::string key, int TrainConfig::*field, std::int64_t lo, std::int64_t hi, std::string doc) {
  TrainConfig defaults;
  return {key, "int", std::to_string(defaults.*field), std::move(doc),
          [=](const YAML::Node& n, TrainConfig& c, Issues& issues) {
            if (auto v = int_in_range(key, n, lo, hi, issues)) c.*field = static_cast<int>(*v);
          },
          writer(field)};
}

KeySpec boolean(std::string key, std::optional<bool> TrainConfig::*field, std::string doc) {
  return {key, "bool", "(derived)", std::move(doc),
          [key, field](const YAML::Node& n, TrainConfig& c, Issues& issues) {
            if (auto v = as_bool(n)) c.*field = *v;
            else issues.push_back({key, "expected true or false, got '" + yaml_text(n) + "'"});
          },
          writer(field)};
}

KeySpec integer(std::string key, std::optional<int> TrainConfig::*field, std::int64_t lo, std::int64_t hi, std::string doc) {
  return {key, "int", "(none)", std::move(doc),
          [=](const YAML::Node& n, TrainConfig& c, Issues& issues) {
            if (auto v = int_in_range(key, n, lo, hi, issues)) c.*field = static_cast<int>(*v);
          },
          writer(field)};
}

KeySpec steps_or_fraction(std::string key, std::optional<double> TrainConfig::*field, bool zero_ok, std::string doc) {
  return {key, "float", zero_ok ? "0" : "(none)", std::move(doc),
          [=](const YAML::Node& n, TrainConfig& c, Issues& issues) {
            const auto v = as_double(n);
            if (!v || *v < 0 || (*v == 0 && !zero_ok) || (*v >= 1 && *v != std::floor(*v)) || *v > (1 << 30))
              return issues.push_back({key, std::string("expected a whole number of steps or a fraction in (0, 1)") +
                                                (zero_ok ? " (0: never)" : "") + ", got '" + yaml_text(n) + "'"});
            c.*field = *v;
          },
          writer(field)};
}

KeySpec real(std::string key, double TrainConfig::*field, double lo, bool lo_open, double hi, std::string doc) {
  TrainConfig defaults;
  return {key, "float", fmt_double(defaults.*field), std::move(doc),
          [=](const YAML::Node& n, TrainConfig& c, Issues& issues) {
            auto v = as_double(n);
            if (!v) return issues.push_back({key, "expected a number, got '" + yaml_text(n) + "'"});
            const bool low_ok = lo_open ? *v > lo : *v >= lo;
            if (!low_ok || *v > hi) {
              std::string range = (lo_open ? "greater than " : "at least ") + fmt_double(lo);
              if (std::isfinite(hi)) range += " and at most " + fmt_double(hi);
              return issues.push_back({key, "must be " + range + ", got " + fmt_double(*v)});
            }
            c.*field = *v;
          },
          writer(field)};
}

KeySpec choice(std::string key, std::string TrainConfig::*field, std::vector<std::string> allowed, std::string doc) {
  TrainConfig defaults;
  const std::string def = (defaults.*field).empty() ? "(required)" : defaults.*field;
  return {key, "one of " + join(allowed, ", "), def, std::move(doc),
          [=](const YAML::Node& n, TrainConfig& c, Issues& issues) {
            const std::string v = n.IsScalar() ? n.Scalar() : yaml_text(n);
            for (const auto& a : allowed)
              if (a == v) {
                c.*field = v;
                return;
              }
            std::string msg = "unknown value '" + v + "'; expected one of " + join(allowed, ", ");
            if (auto m = closest_match(v, allowed)) msg += " (did you mean '" + *m + "'?)";
            issues.push_back({key, msg});
          },
          writer(field)};
}

KeySpec text(std::string key, std::string TrainConfig::*field, std::string doc) {
  TrainConfig defaults;
  const std::string def = (defaults.*field).empty() ? "(none)" : defaults.*field;
  return {key, "string", def, std::move(doc),
          [=](const YAML::Node& n, TrainConfig& c, Issues& issues) {
            if (!n.IsScalar() || n.Scalar().empty())
              return issues.push_back({key, "expected a non-empty string, got '" + yaml_text(n) + "'"});
            c.*field = n.Scalar();
          },
          [field](const TrainConfig& c) { return (c.*field).empty() ? YAML::Node() : YAML::Node(c.*field); }};
}

}  // namespace eo::config_detail
