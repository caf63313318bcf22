#include "runtime/config.h"

#include <unistd.h>

#include <charconv>

#include <nlohmann/json.hpp>
#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <regex>
#include <sstream>

#include "common/error.h"
#include "common/text.h"
#include "models/hf_config.h"
#include "models/module_names.h"
#include "runtime/config_paths.h"
#include "runtime/dataset_source.h"
#include "runtime/datasets_legacy.h"
#include "runtime/hub.h"
#include "runtime/key_aliases.h"
#include "runtime/model_overrides.h"
#include "runtime/yaml_values.h"

namespace eo {
namespace {

namespace fs = std::filesystem;
using Issues = std::vector<ConfigIssue>;

// ---------------------------------------------------------------------------------------
// The schema: one entry per key. `read` converts and range-checks the YAML value into the
// config, adding issues instead of throwing so that every problem is reported at once.
// ---------------------------------------------------------------------------------------
struct KeySpec {
  std::string key;  // dotted
  std::string type;
  std::string default_text;
  std::string doc;
  std::function<void(const YAML::Node&, TrainConfig&, Issues&)> read;
  // The resolved value for printing; an undefined node when the key is unset.
  std::function<YAML::Node(const TrainConfig&)> write;
};

// Values for the resolved-config printout. Doubles in their shortest form that reads back
// exactly (0.05, not yaml-cpp's 17-digit 0.050000000000000003).
template <typename T>
YAML::Node value_node(const T& v) {
  return YAML::Node(v);
}
YAML::Node value_node(double v) {
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  return YAML::Node(std::string(buf, r.ptr));
}

template <typename T>
std::function<YAML::Node(const TrainConfig&)> writer(T TrainConfig::*field) {
  return [field](const TrainConfig& c) { return value_node(c.*field); };
}

template <typename T>
std::function<YAML::Node(const TrainConfig&)> writer(std::optional<T> TrainConfig::*field) {
  return [field](const TrainConfig& c) { return (c.*field) ? value_node(*(c.*field)) : YAML::Node(); };
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

// A scalar or a list of scalars as strings; else an issue naming the key.
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

KeySpec integer(std::string key, int TrainConfig::*field, std::int64_t lo, std::int64_t hi, std::string doc) {
  TrainConfig defaults;
  return {key, "int", std::to_string(defaults.*field), std::move(doc),
          [=](const YAML::Node& n, TrainConfig& c, Issues& issues) {
            if (auto v = int_in_range(key, n, lo, hi, issues)) c.*field = static_cast<int>(*v);
          },
          writer(field)};
}

// Optional variants: unset (the default is derived from other keys) until the YAML sets them.
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

// How often, in optimizer steps: a whole number, or a fraction in (0, 1) of the run's steps (as
// axolotl and transformers read it; step_interval resolves it); 0 = never where zero_ok.
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

std::string fmt_double(double d) {
  std::ostringstream os;
  os << d;
  return os.str();
}

// Range check for reals: [lo, hi] or (lo, hi] when lo_open.
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

// axolotl's keys that eo-ddp's schema does not read, and what it does with each: one table
// (runtime/axolotl_keys.inc, from axolotl's schema), so a config written for axolotl runs or is
// refused for a stated reason, and a key in neither is a typo.
struct AxolotlKey {
  enum Class { Implemented, Noted, Rejected };
  const char* key;
  Class cls;
  const char* text;
};
const std::vector<AxolotlKey>& axolotl_table() {
  static const std::vector<AxolotlKey> t = {
#include "runtime/axolotl_keys.inc"
  };
  return t;
}
const AxolotlKey* axolotl_key(const std::string& key) {
  static const std::map<std::string, const AxolotlKey*> index = [] {
    std::map<std::string, const AxolotlKey*> m;
    for (const auto& k : axolotl_table()) m[k.key] = &k;
    return m;
  }();
  const auto it = index.find(key);
  return it == index.end() ? nullptr : it->second;
}
bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}
// A parallel size: 1 means off.
bool is_size_key(const std::string& key) {
  return ends_with(key, "parallel_size") || ends_with(key, "_degree") || key == "dp_shard_size" || key == "dp_replicate_size";
}
// A value that asks for nothing: null, false, empty, 0 (a size: 1).
bool is_off(const YAML::Node& n, bool size) {
  if (is_null(n) || as_bool(n) == false) return true;
  if ((n.IsSequence() || n.IsMap()) && n.size() == 0) return true;
  if (n.IsScalar() && n.Scalar().empty()) return true;
  if (const auto v = as_double(n)) return *v == 0 || (size && *v == 1);
  return false;
}

// A Noted or Rejected key (or datasets entry key): a log line, an issue, or nothing when off.
void apply_axolotl_key(const AxolotlKey& a, const std::string& where, const YAML::Node& node, std::vector<std::string>& warnings,
                       Issues& issues) {
  const bool size = is_size_key(a.key);
  if (size && !is_null(node) && (!as_int(node) || *as_int(node) < 1))
    return issues.push_back({where, "expected an integer >= 1"});
  if (is_off(node, size)) return;
  if (a.cls == AxolotlKey::Rejected)
    issues.push_back({where, std::string("not supported") + (size ? " (" + node.Scalar() + ")" : "") + ": " + a.text});
  else warnings.push_back("config key '" + where + "' is ignored by eo-ddp: " + a.text);
}

// chat_template values: eo-ddp's own, and axolotl's named templates, every one eo-ddp ships in
// tools/chat_templates (copied from axolotl; rendered on any model as axolotl does). The families
// a template is the own template of, for a note elsewhere.
const std::vector<std::string>& chat_templates() {
  static const std::vector<std::string> t = {"tokenizer_default", "tokenizer_default_fallback_chatml", "jinja"};
  return t;
}
const std::map<std::string, std::vector<std::string>>& shipped_templates() {  // tools/chat_templates/<name>.jinja
  static const std::map<std::string, std::vector<std::string>> m = {
      {"chatml", {}}, {"qwen3", {"qwen3_moe"}}, {"deepseek_v2", {"deepseek_v2"}}, {"deepseek_v3", {"deepseek_v3"}},
      {"gemma4", {"gemma4", "gemma4_text"}}, {"llama4", {"llama4", "llama4_text"}},
      {"alpaca", {}}, {"aya", {}}, {"cohere", {}}, {"command_a", {}}, {"command_a_rag", {}}, {"command_a_tool_use", {}},
      {"exaone", {}}, {"exaone4", {}}, {"falcon_h1", {}}, {"gemma", {}}, {"gemma3", {}}, {"gemma3n", {}},
      {"gemma4_unified", {}}, {"inst", {}}, {"jamba", {}}, {"llama3", {}}, {"llama3_2_vision", {}}, {"llava", {}},
      {"metharme", {}}, {"mistral_v1", {}}, {"mistral_v2v3", {}}, {"mistral_v3_tekken", {}}, {"mistral_v7_tekken", {}},
      {"nemotron_h", {}}, {"phi_3", {}}, {"phi_35", {}}, {"phi_4", {}}, {"pixtral", {}}, {"qwen2_vl", {}},
      {"qwen3_5", {}}, {"qwen_25", {}}};
  return m;
}
// What is wrong with chat_template value V, or nothing.
std::optional<std::string> template_problem(const std::string& v) {
  if (std::find(chat_templates().begin(), chat_templates().end(), v) != chat_templates().end() || shipped_templates().count(v))
    return std::nullopt;
  std::vector<std::string> all = chat_templates();
  for (const auto& [name, fams] : shipped_templates()) all.push_back(name);
  std::string msg = "unknown value '" + v + "'; eo-ddp knows " + join(chat_templates(), ", ") +
                    " and axolotl's named templates (" + join(std::vector<std::string>(all.begin() + 3, all.end()), ", ") +
                    "; another template: chat_template: jinja with chat_template_jinja)";
  if (auto m = closest_match(v, all)) msg += " (did you mean '" + *m + "'?)";
  return msg;
}

// One `datasets:` / `test_datasets:` list. Each entry's keys are checked against its type: a key
// that shapes tokens but does not apply to the type is an error, never silently dropped.
const std::vector<std::string> kPreTokenized = {"tokenized", "tokens"};
const std::vector<std::string> kFormatted = {"chat_template", "alpaca", "completion", "input_output"};

void read_datasets(const YAML::Node& n, const std::string& key, std::vector<DatasetSpec>& out, std::vector<std::string>& warnings,
                   Issues& issues) {
  if (!n.IsSequence() || n.size() == 0)
    return issues.push_back({key, "expected a non-empty list, e.g. " + key + ": [{path: data.jsonl, type: chat_template}]"});
  static const std::vector<std::string> common = {"path", "type", "ds_type", "split", "revision", "data_files", "shards",
                                                  "shards_idx"};
  static const std::vector<std::string> tokens_keys = {"dtype", "eos_token_id"};
  static const std::vector<std::string> chat_keys = {"field_messages", "message_field_role", "message_field_content",
                                                     "message_property_mappings",
                                                     "message_field_training", "roles_to_train", "train_on_eos", "roles",
                                                     "drop_system_message", "chat_template", "chat_template_jinja",
                                                     "train_on_eot", "field_thinking", "template_thinking_key"};
  std::vector<std::string> all = common;
  all.insert(all.end(), tokens_keys.begin(), tokens_keys.end());
  all.insert(all.end(), chat_keys.begin(), chat_keys.end());
  all.push_back("field");
  std::vector<std::string> types = kPreTokenized;
  types.insert(types.end(), kFormatted.begin(), kFormatted.end());
  out.clear();
  for (std::size_t i = 0; i < n.size(); ++i) {
    const std::string where = key + "." + std::to_string(i);
    std::vector<std::pair<std::string, std::string>> legacy;
    const YAML::Node d = upgrade_legacy_dataset(n[i], where, warnings, legacy);
    for (auto& [k, m] : legacy) issues.push_back({k, m});
    if (!d.IsMap()) {
      issues.push_back({where, "expected a map with path and type"});
      continue;
    }
    DatasetSpec s;
    if (!d["path"].IsDefined() || !d["path"].IsScalar() || d["path"].Scalar().empty())
      issues.push_back({where + ".path", "required: the data file, or a dataset named as on the Hub (org/name)"});
    else s.path = d["path"].Scalar();
    s.type = scalar_or_empty(d["type"]);  // upgrade_legacy_dataset gives an omitted type its meaning
    if (std::find(types.begin(), types.end(), s.type) == types.end()) {
      std::string msg = "unknown type '" + s.type + "'; eo-ddp reads " + join(kFormatted, ", ") +
                        " (tokenised through transformers) and the pre-tokenized tokenized (JSONL) and tokens (binary)";
      if (auto m = closest_match(s.type, types)) msg += " (did you mean '" + *m + "'?)";
      issues.push_back({where + ".type", msg});
    }
    if (d["split"].IsDefined() && !is_null(d["split"])) {
      // Hugging Face's split syntax on the one split a local file has (tools/prepare_data.py slices).
      static const std::regex slice(R"(^train(\[((-?\d+)(%)?)?:((-?\d+)(%)?)?\])?$)");
      s.split = scalar_or_empty(d["split"]);
      std::smatch m;
      const bool ok = std::regex_match(s.split, m, slice);
      const bool pct = ok && (m[4].matched || m[7].matched);
      auto over_100 = [&](int g) {
        const std::string v = m[g].str();
        return m[g].matched && (v.size() > 4 || std::abs(std::stoi(v)) > 100);
      };
      if (!ok)
        issues.push_back({where + ".split", "'" + yaml_text(d["split"]) + "': a local JSON lines file is the split train; "
                                            "eo-ddp takes train or one slice of it, e.g. train[:20%], train[10:50], train[-10%:]"});
      else if (pct && (over_100(3) || over_100(6)))
        issues.push_back({where + ".split", "'" + s.split + "': percentages must be between -100% and 100%"});
      else if (s.split != "train" && !s.formatted())
        issues.push_back({where + ".split", "a slice applies to the axolotl formats (chat_template, alpaca, completion, "
                                            "input_output); cut a pre-tokenized file itself"});
    }
    read_dataset_source(d, where, s, issues);
    // Which keys this type takes.
    std::vector<std::string> allowed = common;
    if (s.type == "tokens") allowed.insert(allowed.end(), tokens_keys.begin(), tokens_keys.end());
    if (s.type == "chat_template") allowed.insert(allowed.end(), chat_keys.begin(), chat_keys.end());
    if (s.type == "completion") allowed.push_back("field");
    for (const auto& kv : d) {
      const std::string kk = key_text(kv.first);
      if (std::find(allowed.begin(), allowed.end(), kk) != allowed.end()) continue;
      if (std::find(all.begin(), all.end(), kk) != all.end()) {
        issues.push_back({where + "." + kk, "does not apply to type: " + s.type + " (remove it, or change the type)"});
        continue;
      }
      if (const AxolotlKey* a = axolotl_key("datasets[]." + kk); a && a->cls != AxolotlKey::Implemented) {
        apply_axolotl_key(*a, where + "." + kk, kv.second, warnings, issues);
        continue;
      }
      std::string msg = "unknown key; type " + s.type + " takes " + join(allowed, ", ");
      if (auto m = closest_match(kk, all)) msg += " (did you mean '" + *m + "'?)";
      issues.push_back({where + "." + kk, msg});
    }
    if (s.type == "tokens") {
      s.dtype = d["dtype"].IsDefined() ? scalar_or_empty(d["dtype"]) : "uint16";
      if (s.dtype != "uint16" && s.dtype != "uint32")
        issues.push_back({where + ".dtype", "expected uint16 or uint32, got '" + s.dtype + "'"});
      if (d["eos_token_id"].IsDefined()) {
        auto v = as_int(d["eos_token_id"]);
        if (!v || *v < 0) issues.push_back({where + ".eos_token_id", "expected a token id >= 0"});
        else s.eos_token_id = *v;
      }
    }
    auto str = [&](const char* k, std::string& field) {
      if (!d[k].IsDefined() || is_null(d[k])) return;
      if (!d[k].IsScalar() || d[k].Scalar().empty()) issues.push_back({where + "." + k, "expected a non-empty string"});
      else field = d[k].Scalar();
    };
    if (s.type == "chat_template") {
      str("field_messages", s.field_messages);
      str("message_field_role", s.message_field_role);
      str("message_field_content", s.message_field_content);
      str("message_field_training", s.message_field_training);
      // Newer axolotl spells the two field names as one map.
      if (d["message_property_mappings"].IsDefined()) {
        const YAML::Node m = d["message_property_mappings"];
        if (!m.IsMap()) issues.push_back({where + ".message_property_mappings", "expected a map such as {role: from, content: value}"});
        else
          for (const auto& kv : m) {
            const std::string k2 = key_text(kv.first);
            std::string* field = k2 == "role" ? &s.message_field_role : k2 == "content" ? &s.message_field_content : nullptr;
            if (!field || !kv.second.IsScalar() || kv.second.Scalar().empty())
              issues.push_back({where + ".message_property_mappings." + k2,
                                field ? "expected the data's field name" : "eo-ddp maps role and content only"});
            else *field = kv.second.Scalar();
          }
      }
      str("chat_template", s.chat_template);
      str("chat_template_jinja", s.chat_template_jinja);
      str("train_on_eos", s.train_on_eos);
      str("train_on_eot", s.train_on_eot);
      str("field_thinking", s.field_thinking);
      str("template_thinking_key", s.template_thinking_key);
      s.fields_mapped = d["message_property_mappings"].IsDefined() || d["message_field_role"].IsDefined() ||
                        d["message_field_content"].IsDefined();
      if (!s.chat_template.empty())
        if (auto why = template_problem(s.chat_template)) issues.push_back({where + ".chat_template", *why});
      static const std::vector<std::string> eos = {"all", "turn", "last", "none"};
      if (!s.train_on_eos.empty() && std::find(eos.begin(), eos.end(), s.train_on_eos) == eos.end())
        issues.push_back({where + ".train_on_eos", "expected one of all, turn, last, none; got '" + s.train_on_eos + "'"});
      if (!s.train_on_eot.empty() && std::find(eos.begin(), eos.end(), s.train_on_eot) == eos.end())
        issues.push_back({where + ".train_on_eot", "expected one of all, turn, last, none; got '" + s.train_on_eot + "'"});
      if (d["roles_to_train"].IsDefined()) {
        std::vector<std::string> roles;
        bool ok = d["roles_to_train"].IsSequence();
        if (ok)
          for (const auto& r : d["roles_to_train"]) {
            if (!r.IsScalar()) ok = false;
            else roles.push_back(r.Scalar());
          }
        if (!ok) issues.push_back({where + ".roles_to_train", "expected a list of roles, e.g. [assistant]"});
        else s.roles_to_train = roles;
      }
      if (d["roles"].IsDefined()) {
        bool ok = d["roles"].IsMap();
        if (ok)
          for (const auto& kv : d["roles"]) {
            std::vector<std::string> sources;
            if (kv.second.IsScalar()) sources.push_back(kv.second.Scalar());
            else if (kv.second.IsSequence()) {
              for (const auto& x : kv.second) {
                if (!x.IsScalar()) ok = false;
                else sources.push_back(x.Scalar());
              }
            } else ok = false;
            s.roles.emplace_back(key_text(kv.first), sources);
          }
        if (!ok) issues.push_back({where + ".roles", "expected a map of role: [names in the data], e.g. {assistant: [gpt]}"});
      }
      if (d["drop_system_message"].IsDefined()) {
        if (auto v = as_bool(d["drop_system_message"])) s.drop_system_message = *v;
        else issues.push_back({where + ".drop_system_message", "expected true or false"});
      }
    }
    if (s.type == "completion") str("field", s.field);
    out.push_back(s);
  }
}

YAML::Node write_datasets(const std::vector<DatasetSpec>& list_in) {
  YAML::Node list(YAML::NodeType::Sequence);
  for (const auto& d : list_in) {
    YAML::Node e;
    e["path"] = d.path;
    e["type"] = d.type;
    if (!d.dtype.empty()) e["dtype"] = d.dtype;
    if (d.eos_token_id) e["eos_token_id"] = *d.eos_token_id;
    for (const auto& [k, v] : std::vector<std::pair<const char*, std::string>>{
             {"field_messages", d.field_messages}, {"message_field_role", d.message_field_role},
             {"message_field_content", d.message_field_content}, {"message_field_training", d.message_field_training},
             {"train_on_eos", d.train_on_eos}, {"chat_template", d.chat_template},
             {"chat_template_jinja", d.chat_template_jinja}, {"field", d.field}, {"split", d.split},
             {"train_on_eot", d.train_on_eot}, {"field_thinking", d.field_thinking},
             {"template_thinking_key", d.template_thinking_key}, {"revision", d.revision}})
      if (!v.empty()) e[k] = v;
    for (const auto& f : d.data_files) e["data_files"].push_back(f);
    if (d.shards > 0) {
      e["shards"] = d.shards;
      e["shards_idx"] = d.shards_idx;
    }
    if (d.roles_to_train) {
      YAML::Node r(YAML::NodeType::Sequence);
      for (const auto& x : *d.roles_to_train) r.push_back(x);
      e["roles_to_train"] = r;
    }
    if (!d.roles.empty())
      for (const auto& [role, sources] : d.roles) e["roles"][role] = sources;
    if (d.drop_system_message) e["drop_system_message"] = true;
    list.push_back(e);
  }
  return list;
}

const std::vector<KeySpec>& schema() {
  static const std::vector<KeySpec> keys = [] {
    std::vector<KeySpec> k;
    // --- model and adapter
    k.push_back(text("base_model", &TrainConfig::base_model,
                     "Hugging Face checkpoint folder (config.json + *.safetensors), or a model named as on the Hub "
                     "(org/name): read from the Hugging Face cache (HF_HUB_CACHE, else HF_HOME/hub), downloaded into it "
                     "when missing unless HF_HUB_OFFLINE=1. A local folder wins over a Hub name. Required."));
    k.push_back(text("revision_of_model", &TrainConfig::base_model_revision,
                     "The branch, tag or commit of a base_model named as on the Hub (default main)."));
    k.push_back(boolean("synthetic_weights", &TrainConfig::synthetic_weights,
                        "Initialise the frozen base model with seeded random weights (NF4 drawn directly on the device; MXFP4 "
                        "experts when they are held so, see expert_quant) from "
                        "base_model/config.json alone: for benchmarks and memory planning on real shapes without a download."));
    k.push_back(boolean("load_in_4bit", &TrainConfig::load_in_4bit,
                        "Quantise the decoder blocks' linear weights to NF4 (bitsandbytes layout). Required for adapter: qlora."));
    k.push_back(choice("adapter", &TrainConfig::adapter, {"qlora", "lora"},
                       "qlora: LoRA on an NF4 base (needs load_in_4bit: true); lora: LoRA on a bf16/fp32 base. Required."));
    k.push_back(integer("lora_r", &TrainConfig::lora_r, 1, 4096, "LoRA rank."));
    k.push_back(real("lora_alpha", &TrainConfig::lora_alpha, 0, true, INFINITY, "LoRA scaling numerator: scale = alpha / r (alpha / sqrt(r) with rsLoRA)."));
    k.push_back(real("lora_dropout", &TrainConfig::lora_dropout, 0, false, 0.99, "Dropout on the LoRA input."));
    k.push_back({"lora_target_modules", "list of strings", "[q_proj, k_proj, v_proj, o_proj]",
                 "Module names to adapt: attention q_proj/k_proj/v_proj/o_proj (DeepSeek latent attention: q_proj or "
                 "q_a_proj/q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj); experts gate_proj/up_proj/down_proj "
                 "(Mixtral: w1/w3/w2); dense MLP and shared experts use the same names. As in peft, a list may name "
                 "dotted suffixes (self_attn.q_proj) and one string is a regular expression matched against whole "
                 "module names (model.layers.N.self_attn.q_proj, model.layers.N.mlp.experts.E.gate_proj); either must "
                 "select a name in every layer and expert or in none (some layers: peft_layers_to_transform). Unset: the architecture's attention linears.",
                 [](const YAML::Node& n, TrainConfig& c, Issues& issues) {
                   // peft's forms: one string is a regular expression matched against whole module
                   // names; a list names modules or dotted suffixes of their names (check_targets).
                   if (n.IsScalar()) {
                     try {
                       std::regex re(n.Scalar());
                     } catch (const std::regex_error& e) {
                       return issues.push_back({"lora_target_modules", "'" + n.Scalar() + "' is not a regular expression "
                                                                       "eo-ddp reads (ECMAScript syntax): " + e.what()});
                     }
                     c.lora_target_modules = {n.Scalar()};
                     c.lora_target_regex = true;
                     return;
                   }
                   const auto parsed = string_list("lora_target_modules", n, "module names", issues);
                   if (!parsed) return;
                   const std::vector<std::string>& v = *parsed;
                   const std::vector<std::string>& known = model::all_linear_modules();
                   for (const auto& m : v) {
                     bool ok = m.find('.') != std::string::npos;  // a suffix: resolved against the architecture
                     for (const auto& kn : known) ok |= kn == m;
                     if (!ok) {
                       std::string msg = "unknown module '" + m + "'; eo-ddp can adapt " + join(known, ", ");
                       if (auto s = closest_match(m, known)) msg += " (did you mean '" + *s + "'?)";
                       issues.push_back({"lora_target_modules", msg});
                     }
                   }
                   c.lora_target_modules = v;
                 },
                 writer(&TrainConfig::lora_target_modules)});
    k.push_back(boolean("lora_target_linear", &TrainConfig::lora_target_linear,
                        "Adapt every linear layer of the decoder blocks, as base_model's architecture names them (attention q/k/v/o_proj; experts w1/w2/w3 in Mixtral, gate/up/down_proj elsewhere; dense MLPs); overrides lora_target_modules."));
    k.push_back({"lora_target_parameters", "list of strings", "[]",
                 "peft's target_parameters: LoRA on the fused expert parameters as peft's ParamWrapper defines it "
                 "(mlp.experts.gate_up_proj: gate and up share one A per expert; mlp.experts.down_proj; their dotted "
                 "suffixes experts.gate_up_proj, gate_up_proj, ... are the same parameters, as peft matches them; "
                 "Gemma 4's are experts.gate_up_proj / experts.down_proj, as the adapter says). The adapter loads in peft on transformers 5, whose "
                 "experts are fused. Beside it lora_target_modules names attention modules only (no expert names, no "
                 "lora_target_linear: peft would load those as the fused parameters at rank 2r; on Gemma 4 they are its "
                 "dense MLP, which peft keeps); needs lora_dropout: 0.",
                 [](const YAML::Node& n, TrainConfig& c, Issues& issues) {
                   const auto parsed = string_list("lora_target_parameters", n, "parameter names", issues);
                   if (!parsed) return;
                   const std::vector<std::string>& v = *parsed;
                   // Canonical names (peft's and axolotl's); the bare names are the same parameters.
                   // (Kept here rather than in models/lora.cpp: the config parser is fuzzed alone.)
                   static const std::vector<std::string> accepted = {"mlp.experts.gate_up_proj", "mlp.experts.down_proj",
                                                                     "gate_up_proj", "down_proj"};
                   std::vector<std::string> canonical;
                   // peft matches a parameter name by its dotted suffix: experts.gate_up_proj too.
                   auto suffix_of = [](const std::string& full, const std::string& m) {
                     return full == m || (full.size() > m.size() && ends_with(full, m) && full[full.size() - m.size() - 1] == '.');
                   };
                   for (const auto& m : v) {
                     std::string cm;
                     if (suffix_of(accepted[0], m)) cm = accepted[0];
                     else if (suffix_of(accepted[1], m)) cm = accepted[1];
                     if (cm.empty()) {
                       std::string msg = "unknown parameter '" + m + "'; eo-ddp can adapt the fused expert parameters " +
                                         join(accepted, ", ");
                       if (auto s = closest_match(m, accepted)) msg += " (did you mean '" + *s + "'?)";
                       issues.push_back({"lora_target_parameters", msg});
                     } else if (std::find(canonical.begin(), canonical.end(), cm) == canonical.end()) {
                       canonical.push_back(cm);
                     }
                   }
                   // One order (gate_up_proj, down_proj) whatever the user's: resume compares it.
                   std::sort(canonical.begin(), canonical.end(), [&](const std::string& a, const std::string& b) {
                     return (a == accepted[0]) > (b == accepted[0]);
                   });
                   c.lora_target_parameters = canonical;
                 },
                 writer(&TrainConfig::lora_target_parameters)});
    k.push_back({"peft_layers_to_transform", "list of integers", "[]",
                 "peft's layers_to_transform: only the decoder layers with these indices (model.layers.N) are adapted, "
                 "their lora_target_modules and lora_target_parameters alike; the adapter's adapter_config.json says "
                 "so, as peft writes it. Unset: every layer.",
                 [](const YAML::Node& n, TrainConfig& c, Issues& issues) {
                   std::vector<int> v;
                   auto one = [&](const YAML::Node& x) {
                     const auto i = x.IsScalar() ? as_int(x) : std::nullopt;
                     if (!i || *i < 0 || *i > (1 << 20)) return false;
                     v.push_back(static_cast<int>(*i));
                     return true;
                   };
                   bool ok = true;
                   if (n.IsSequence())
                     for (const auto& x : n) ok &= one(x);
                   else ok = one(n);
                   if (!ok)
                     return issues.push_back({"peft_layers_to_transform", "expected a layer index >= 0 or a list of them"});
                   std::sort(v.begin(), v.end());
                   v.erase(std::unique(v.begin(), v.end()), v.end());
                   c.peft_layers_to_transform = v;
                 },
                 [](const TrainConfig& c) {
                   YAML::Node n(YAML::NodeType::Sequence);
                   for (int i : c.peft_layers_to_transform) n.push_back(i);
                   return n;
                 }});
    k.push_back({"peft_layers_pattern", "list of strings", "[layers]",
                 "peft's layers_pattern, the name of the module list peft_layers_to_transform indexes: the decoder "
                 "layers are model.layers in every architecture eo-ddp trains, so only layers is accepted.",
                 [](const YAML::Node& n, TrainConfig&, Issues& issues) {
                   const bool ok = (n.IsScalar() && n.Scalar() == "layers") ||
                                   (n.IsSequence() && n.size() == 1 && n[0].IsScalar() && n[0].Scalar() == "layers");
                   if (!ok)
                     issues.push_back({"peft_layers_pattern", yaml_text(n) + " names no module list of eo-ddp's models; their "
                                                              "decoder layers are model.layers (peft_layers_pattern: [layers])"});
                 },
                 [](const TrainConfig&) { return YAML::Node(); }});
    k.push_back(boolean("peft_use_rslora", &TrainConfig::peft_use_rslora, "rsLoRA scaling alpha / sqrt(r)."));
    k.push_back(boolean("nvfp4_merge_aware", &TrainConfig::nvfp4_merge_aware,
                        "axolotl's merge-aware NVFP4 LoRA (with use_sonicmoe and adapter: lora on an NVFP4 base): every "
                        "LoRA-carrying NVFP4 weight (experts and linears) trains through Q(dequant(W) + scaling * B A), Q "
                        "torchao's NVFP4 quantiser (fresh E4M3 block scales on the weight's global scale), with "
                        "straight-through gradients, so that merging the adapter into an NVFP4 checkpoint keeps what "
                        "was trained. The adapter's adapter_config.json records it (nvfp4_merge_aware)."));
    k.push_back({"nvfp4_merge_aware_start_step", "int or float", "0",
                 "nvfp4_merge_aware from this optimizer step on (plain LoRA before): a whole number of completed "
                 "steps, or a fraction in (0, 1) of the run's steps (int(fraction * steps), as axolotl).",
                 [](const YAML::Node& n, TrainConfig& c, Issues& issues) {
                   // axolotl's check_nvfp4_merge_aware: an int >= 0 or a float in (0, 1); true/false
                   // and floats such as 2.0 are refused.
                   const auto i = n.IsScalar() && n.Scalar().find_first_of(".eE") == std::string::npos ? as_int(n) : std::nullopt;
                   const auto d = as_double(n);
                   if (i ? *i < 0 : !(d && *d > 0 && *d < 1))
                     return issues.push_back({"nvfp4_merge_aware_start_step", "must be an int >= 0 (absolute step) or a float in "
                                                                              "(0, 1) (fraction of max steps), got '" + yaml_text(n) + "'"});
                   c.nvfp4_merge_aware_start_step = i ? static_cast<double>(*i) : *d;
                 },
                 writer(&TrainConfig::nvfp4_merge_aware_start_step)});
    k.push_back(integer("bnb_4bit_blocksize", &TrainConfig::bnb_4bit_blocksize, 32, 4096,
                        "NF4 quantisation block size (a power of two, as bitsandbytes)."));
    k.push_back(boolean("bnb_4bit_use_double_quant", &TrainConfig::bnb_4bit_use_double_quant,
                        "Quantise the NF4 absmax statistics again (8-bit, blocks of 256), as bitsandbytes' compress_statistics."));
    k.push_back(choice("expert_quant", &TrainConfig::expert_quant, {"auto", "nf4", "mxfp4"},
                       "With load_in_4bit, the format the routed experts are held in (homes and device): auto keeps a "
                       "checkpoint's MXFP4 experts (gpt-oss as the Hub ships it: 4.25 bits per weight, lossless with "
                       "respect to the checkpoint, dequantised to bf16 on the fly) and quantises any other to NF4; nf4 "
                       "always NF4 (MXFP4 experts are dequantised first, as transformers' Mxfp4Config(dequantize=True)); "
                       "mxfp4 requires an MXFP4 checkpoint."));
    k.push_back(boolean("output_router_logits", &TrainConfig::output_router_logits,
                        "Add the router load-balancing auxiliary loss (coefficient from config.json or router_aux_loss_coef)."));
    k.push_back({"overrides_of_model_config", "map", "(none)",
                 "Values that replace base_model/config.json's top-level keys (rope_scaling, rope_theta, "
                 "max_position_embeddings, ...), as axolotl sets them; ones that change the weights' shapes are refused. "
                 "Older configs: model_config.",
                 [](const YAML::Node& n, TrainConfig& c, Issues& issues) {
                   read_model_config_overrides(n, "overrides_of_model_config", c, issues);
                 },
                 [](const TrainConfig& c) {
                   YAML::Node m;
                   for (const auto& [k, v] : c.model_config_overrides) m[k] = YAML::Load(v);  // JSON is YAML
                   return m;
                 }});
    k.push_back({"router_aux_loss_coef", "float", "(from config.json)", "Overrides the checkpoint's router auxiliary loss coefficient.",
                 [](const YAML::Node& n, TrainConfig& c, Issues& issues) {
                   auto v = as_double(n);
                   if (!v || *v < 0) return issues.push_back({"router_aux_loss_coef", "expected a number >= 0, got '" + yaml_text(n) + "'"});
                   c.router_aux_loss_coef = *v;
                 },
                 writer(&TrainConfig::router_aux_loss_coef)});
    // --- data
    k.push_back({"datasets", "list of datasets", "(required)",
                 "Training data, as axolotl writes it: `- path: F.jsonl` with `type:` chat_template (messages, "
                 "rendered with the chat template; keys field_messages, message_field_role, message_field_content "
                 "(or message_property_mappings), "
                 "message_field_training, roles_to_train, train_on_eos, roles, drop_system_message, chat_template, "
                 "chat_template_jinja), alpaca (instruction/input/output), completion (text; key field) or "
                 "input_output (segments of text/label) -- tokenised once with the model's tokenizer through "
                 "transformers into dataset_prepared_path -- or pre-tokenized: tokenized (JSONL with input_ids, "
                 "optional labels and attention_mask) or tokens (flat binary token file; dtype uint16 or uint32; "
                 "eos_token_id marks document ends), read with no Python.",
                 [](const YAML::Node& n, TrainConfig& c, Issues& issues) { read_datasets(n, "datasets", c.datasets, c.warnings, issues); },
                 [](const TrainConfig& c) { return write_datasets(c.datasets); }});
    k.push_back({"test_datasets", "list of datasets", "(none)",
                 "Evaluation data, entries as in datasets (exclusive with val_set_size).",
                 [](const YAML::Node& n, TrainConfig& c, Issues& issues) {
                   read_datasets(n, "test_datasets", c.test_datasets, c.warnings, issues);
                 },
                 [](const TrainConfig& c) { return c.test_datasets.empty() ? YAML::Node() : write_datasets(c.test_datasets); }});
    k.push_back(text("dataset_prepared_path", &TrainConfig::dataset_prepared_path,
                     "Cache of the tokenised axolotl-format datasets: one folder per dataset, named by a hash of the "
                     "data file, the tokenizer files and every key that shapes its tokens; a missing or stale one is "
                     "built by rank 0 at start (or by eo-ddp preprocess --config F). Relative to the working folder."));
    k.push_back(integer("dataset_prepare_timeout", &TrainConfig::dataset_prepare_timeout, 10, 1 << 24,
                        "Seconds the other ranks wait for rank 0 to tokenise the datasets before the run is ended."));
    k.push_back(boolean("train_on_inputs", &TrainConfig::train_on_inputs,
                        "Train on the prompt too (system/user turns, alpaca's prompt, input_output's unlabelled "
                        "segments). false: those tokens get label -100, as in axolotl. Pre-tokenized data keeps its labels."));
    k.push_back({"chat_template", "string", "tokenizer_default",
                 "Template for type: chat_template: tokenizer_default (the tokenizer's own), "
                 "tokenizer_default_fallback_chatml (the tokenizer's, else ChatML), jinja (chat_template_jinja), or "
                 "one of axolotl's named templates (every one axolotl 0.19.0 ships, and inst of older releases), "
                 "copied unchanged and rendered as axolotl does on any model: chatml, llama3, mistral_v2v3, qwen3, ...",
                 [](const YAML::Node& n, TrainConfig& c, Issues& issues) {
                   const std::string v = n.IsScalar() ? n.Scalar() : yaml_text(n);
                   if (auto why = template_problem(v)) issues.push_back({"chat_template", *why});
                   else c.chat_template = v;
                 },
                 writer(&TrainConfig::chat_template)});
    k.push_back(text("chat_template_jinja", &TrainConfig::chat_template_jinja, "The template text for chat_template: jinja."));
    k.push_back(text("tokenizer_config", &TrainConfig::tokenizer_config,
                     "Tokenizer folder for the axolotl formats (default: base_model)."));
    k.push_back(text("tokenizer_type", &TrainConfig::tokenizer_type, "transformers tokenizer class (default AutoTokenizer)."));
    k.push_back(boolean("trust_remote_code", &TrainConfig::trust_remote_code,
                        "Let transformers run the tokenizer's own code (the model itself runs no Python)."));
    k.push_back({"special_tokens", "map of token names", "(none)",
                 "pad_token / eos_token / bos_token / unk_token set on the tokenizer before tokenising; each must "
                 "already be in its vocabulary (eo-ddp does not add tokens: the embeddings are frozen).",
                 [](const YAML::Node& n, TrainConfig& c, Issues& issues) {
                   if (!n.IsMap()) return issues.push_back({"special_tokens", "expected a map such as {pad_token: \"<|endoftext|>\"}"});
                   static const std::vector<std::string> names = {"pad_token", "eos_token", "bos_token", "unk_token"};
                   c.special_tokens.clear();
                   for (const auto& kv : n) {
                     const std::string k2 = key_text(kv.first);
                     if (std::find(names.begin(), names.end(), k2) == names.end()) {
                       issues.push_back({"special_tokens." + k2, "unknown; eo-ddp sets " + join(names, ", ")});
                       continue;
                     }
                     if (!kv.second.IsScalar() || kv.second.Scalar().empty())
                       issues.push_back({"special_tokens." + k2, "expected a token string"});
                     else c.special_tokens.emplace_back(k2, kv.second.Scalar());
                   }
                 },
                 [](const TrainConfig& c) {
                   if (c.special_tokens.empty()) return YAML::Node();
                   YAML::Node m(YAML::NodeType::Map);
                   for (const auto& [k2, v] : c.special_tokens) m[k2] = v;
                   return m;
                 }});
    k.push_back({"eot_tokens", "list of strings", "[eos_token]",
                 "Tokens that end a turn in the chat template (e.g. gpt-oss <|end|>), labelled after a turn as "
                 "datasets[].train_on_eot says (default: its train_on_eos), as axolotl; each must be one token of the "
                 "tokenizer, and one the template never writes is dropped with a warning.",
                 [](const YAML::Node& n, TrainConfig& c, Issues& issues) {
                   if (const auto v = string_list("eot_tokens", n, "token strings", issues)) c.eot_tokens = *v;
                 },
                 [](const TrainConfig& c) { return c.eot_tokens.empty() ? YAML::Node() : YAML::Node(c.eot_tokens); }});
    k.push_back(integer("sequence_len", &TrainConfig::sequence_len, 2, 1 << 20, "Tokens per sequence. A longer pre-tokenized document is truncated (cut into pieces with sample_packing); as "
                        "axolotl, a longer chat_template / alpaca / input_output row is dropped (counted in the log) and a "
                        "completion text is cut into pieces."));
    k.push_back(boolean("sample_packing", &TrainConfig::sample_packing,
                        "Pack several documents into one sequence; attention never crosses a document boundary."));
    k.push_back(integer("micro_batch_size", &TrainConfig::micro_batch_size, 1, 1 << 16, "Sequences per rank per micro-step."));
    k.push_back(integer("gradient_accumulation_steps", &TrainConfig::gradient_accumulation_steps, 1, 1 << 16,
                        "Micro-steps per optimizer step."));
    k.push_back(real("num_epochs", &TrainConfig::num_epochs, 0, true, 1e6, "Passes over the data (used when max_steps is not set)."));
    k.push_back({"max_steps", "int", "(from num_epochs)", "Optimizer steps to run; overrides num_epochs.",
                 [](const YAML::Node& n, TrainConfig& c, Issues& issues) {
                   auto v = as_int(n);
                   if (!v || *v < 1) return issues.push_back({"max_steps", "expected an integer >= 1, got '" + yaml_text(n) + "'"});
                   c.max_steps = *v;
                 },
                 writer(&TrainConfig::max_steps)});
    // --- optimisation
    k.push_back(real("learning_rate", &TrainConfig::learning_rate, 0, true, 10, "Peak learning rate."));
    k.push_back(choice("lr_scheduler", &TrainConfig::lr_scheduler, {"constant", "constant_with_warmup", "linear", "cosine"},
                       "transformers' schedule: constant has no warm-up; constant_with_warmup, linear and cosine "
                       "warm up linearly from 0 over the warm-up steps."));
    k.push_back(integer("warmup_steps", &TrainConfig::warmup_steps, 0, 1 << 30, "Linear warmup steps."));
    k.push_back({"warmup_ratio", "float", "(none)", "Warmup as a fraction of the total steps; exclusive with warmup_steps.",
                 [](const YAML::Node& n, TrainConfig& c, Issues& issues) {
                   auto v = as_double(n);
                   if (!v || *v < 0 || *v >= 1) return issues.push_back({"warmup_ratio", "expected a number in [0, 1), got '" + yaml_text(n) + "'"});
                   c.warmup_ratio = *v;
                 },
                 writer(&TrainConfig::warmup_ratio)});
    k.push_back(real("weight_decay", &TrainConfig::weight_decay, 0, false, 10, "AdamW decoupled weight decay (not applied to biases and norms, as HF)."));
    k.push_back(real("max_grad_norm", &TrainConfig::max_grad_norm, 0, false, 1e9, "Clip the global gradient norm; 0 disables."));
    k.push_back(integer("max_nonfinite_steps", &TrainConfig::max_nonfinite_steps, 1, 1 << 30,
                        "A step whose loss or gradients are NaN/Inf (on any rank) is skipped: no optimizer update, counted as "
                        "skipped_nonfinite in metrics.jsonl. This many consecutive skipped steps stop the run with an error."));
    k.push_back({"optimizer", "string", "adamw_torch",
                 "AdamW (libtorch's) with fp32 state; adamw_torch_fused, adamw_hf and optimi_adamw are the same "
                 "optimizer. The 8-bit, 4-bit and paged AdamW names (adamw_bnb_8bit, adamw_8bit, paged_adamw_8bit, "
                 "paged_adamw_32bit, adamw_torch_8bit, adamw_torch_4bit, ao_adamw_8bit, ao_adamw_4bit) run it too, "
                 "with a note: the LoRA state is small (r 16 attention LoRA on Qwen3-30B-A3B: 13.4 M parameters, "
                 "107 MB of fp32 moments), so quantising it would save under 0.1 GB and change the update.",
                 [](const YAML::Node& n, TrainConfig& c, Issues& issues) {
                   static const std::vector<std::string> same = {"adamw_torch", "adamw_torch_fused", "adamw_hf", "optimi_adamw"};
                   static const std::vector<std::string> lowbit = {"adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit",
                                                                   "paged_adamw_32bit", "paged_adamw", "adamw_torch_8bit",
                                                                   "adamw_torch_4bit", "ao_adamw_8bit", "ao_adamw_4bit"};
                   const std::string v = n.IsScalar() ? n.Scalar() : yaml_text(n);
                   auto in = [&](const std::vector<std::string>& l) { return std::find(l.begin(), l.end(), v) != l.end(); };
                   if (in(same)) { c.optimizer = v; return; }
                   if (in(lowbit)) {
                     c.optimizer = v;
                     c.warnings.push_back("optimizer " + v + " runs as AdamW with fp32 state: the LoRA optimizer state is "
                                          "small (about 100 MB for r 16 attention LoRA on Qwen3-30B-A3B), so eo-ddp keeps it exact");
                     return;
                   }
                   std::vector<std::string> all = same;
                   all.insert(all.end(), lowbit.begin(), lowbit.end());
                   std::string msg = "unknown value '" + v + "'; eo-ddp's optimizer is AdamW: " + join(all, ", ");
                   if (auto m = closest_match(v, all)) msg += " (did you mean '" + *m + "'?)";
                   issues.push_back({"optimizer", msg});
                 },
                 writer(&TrainConfig::optimizer)});
    k.push_back(real("adam_beta1", &TrainConfig::adam_beta1, 0, false, 0.9999999, "AdamW beta1."));
    k.push_back(real("adam_beta2", &TrainConfig::adam_beta2, 0, false, 0.9999999, "AdamW beta2."));
    k.push_back(real("adam_epsilon", &TrainConfig::adam_epsilon, 0, true, 1, "AdamW epsilon."));
    k.push_back({"seed", "int", "42", "Seed for LoRA init, dropout and data shuffling.",
                 [](const YAML::Node& n, TrainConfig& c, Issues& issues) {
                   auto v = as_int(n);
                   if (!v || *v < 0) return issues.push_back({"seed", "expected an integer >= 0, got '" + yaml_text(n) + "'"});
                   c.seed = *v;
                 },
                 writer(&TrainConfig::seed)});
    // --- precision and memory
    k.push_back({"bf16", "true, false or auto", "auto", "bf16 compute (LoRA master weights and optimizer state stay fp32); auto = bf16 on a GPU with bf16 (compute capability 8.0 or newer), fp16 on one without (unless fp16: false), fp32 on the CPU.",
                 [](const YAML::Node& n, TrainConfig& c, Issues& issues) {
                   if (n.IsScalar() && n.Scalar() == "auto") { c.bf16 = "auto"; return; }
                   if (auto v = as_bool(n)) { c.bf16 = *v ? "true" : "false"; return; }
                   issues.push_back({"bf16", "expected true, false or auto, got '" + yaml_text(n) + "'"});
                 },
                 writer(&TrainConfig::bf16)});
    k.push_back(boolean("fp16", &TrainConfig::fp16,
                        "fp16 compute with dynamic loss scaling (torch's GradScaler: 2^16 at first, halved and the step "
                        "skipped on an overflow, doubled after loss_scale_growth_interval clean steps), for GPUs "
                        "without bf16 (T4, V100); LoRA master weights, optimizer state, router, norm statistics, "
                        "attention softmax, loss and gradient sums stay fp32. Needs bf16: false or auto. Unset: "
                        "bf16: auto picks fp16 on a GPU without bf16; false there means fp32."));
    k.push_back(integer("loss_scale_growth_interval", &TrainConfig::loss_scale_growth_interval, 1, 1 << 30,
                        "fp16 only: consecutive steps without an overflow after which the loss scale doubles "
                        "(GradScaler's growth_interval)."));
    k.push_back({"gradient_checkpointing", "bool or offload", "false",
                 "Recompute each decoder block in backward instead of keeping its activations. axolotl's offload "
                 "(and offload_disk, kept in host RAM) is gradient_checkpointing with activation_offloading.",
                 [](const YAML::Node& n, TrainConfig& c, Issues& issues) {
                   if (auto v = as_bool(n)) { c.gradient_checkpointing = *v; return; }
                   if (n.IsScalar() && (n.Scalar() == "offload" || n.Scalar() == "offload_disk")) {
                     c.gradient_checkpointing = c.activation_offloading = true;
                     if (n.Scalar() == "offload_disk")
                       c.warnings.push_back("gradient_checkpointing: offload_disk keeps the checkpointed block inputs in "
                                            "pinned host RAM, not on a disk (activation_offloading)");
                     return;
                   }
                   issues.push_back({"gradient_checkpointing", "expected true, false, offload or offload_disk, got '" + yaml_text(n) + "'"});
                 },
                 writer(&TrainConfig::gradient_checkpointing)});
    k.push_back({"gradient_checkpointing_kwargs.use_reentrant", "bool", "(unset)",
                 "Must be false: eo-ddp implements non-reentrant checkpointing only (and expert_offload requires it explicitly).",
                 [](const YAML::Node& n, TrainConfig& c, Issues& issues) {
                   if (auto v = as_bool(n)) c.use_reentrant = *v;
                   else issues.push_back({"gradient_checkpointing_kwargs.use_reentrant", "expected true or false, got '" + yaml_text(n) + "'"});
                 },
                 writer(&TrainConfig::use_reentrant)});
    k.push_back(boolean("expert_offload", &TrainConfig::expert_offload,
                        "Keep the frozen NF4 experts in pinned host RAM and stream one MoE block at a time to the device."));
    k.push_back(boolean("expert_offload_pin_memory", &TrainConfig::expert_offload_pin_memory,
                        "Pinned, NUMA-local homes (false: pageable host memory, much slower copies)."));
    k.push_back(choice("expert_offload_homes", &TrainConfig::expert_offload_homes, {"per_rank", "per_numa_node", "disk"},
                       "Where the offloaded experts live between uses: per_rank = every rank its own copy in host RAM "
                       "(host RAM = ranks per node x expert bytes); per_numa_node = one copy per NUMA node, filled by one "
                       "rank and mapped read-only by the node's other ranks (host RAM = NUMA nodes x expert bytes); disk "
                       "= one file per host in expert_offload_disk_path, written once from the checkpoint and reused by "
                       "later runs, read with O_DIRECT ahead of use into a ring of a few blocks per rank (host RAM = ranks "
                       "per node x ring; every step reads the streamed blocks from the drive)."));
    k.push_back(text("expert_offload_disk_path", &TrainConfig::expert_offload_disk_path,
                     "With expert_offload_homes: disk, the directory (on a local drive, ideally NVMe; created if missing) "
                     "of the homes file eo-ddp-expert-homes.bin. A file written for another model or quantisation "
                     "setting, or with a damaged header, is rebuilt; a block whose bytes changed on the drive stops "
                     "the run at its next read (exit 1), saying to delete the file, which the next run rebuilds; one "
                     "directory per model avoids rebuilding."));
    k.push_back(boolean("expert_offload_prefetch", &TrainConfig::expert_offload_prefetch,
                        "Stage the next blocks on a copy stream while the current one computes (1 + expert_offload_prefetch_depth slots)."));
    k.push_back(integer("expert_offload_prefetch_depth", &TrainConfig::expert_offload_prefetch_depth, 1, 8,
                        "Blocks staged ahead of the one computing (device slots = 1 + depth). Each extra block also "
                        "stays across the forward/backward turns (2 copies fewer per step) and lets copies run further "
                        "ahead, at the cost of one block of device memory."));
    k.push_back(real("expert_offload_copy_pace_gbps", &TrainConfig::expert_offload_copy_pace_gbps, 0, false, 1e4,
                     "For measurements: each expert copy into a device slot takes at least its bytes at this rate "
                     "(GB/s) on the device's clock, so a fast machine runs a slower card's host link (PCIe 4.0 x16: "
                     "about 24; eo-bench --card sets it). 0 (default): the link's own pace."));
    k.push_back(choice("expert_gemm", &TrainConfig::expert_gemm, {"auto", "torch", "portable"},
                       "The kernel of the experts' grouped GEMMs on a GPU. torch: PyTorch's at::_grouped_mm, "
                       "device-scheduled only on compute capability 9.x / 10.x (H100, H200, B200); on other cards it "
                       "reads the routing counts on the host and runs one GEMM per expert, and CUDA graphs cannot "
                       "capture it. portable: eo-ddp's CUTLASS grouped GEMM (sm_80 and newer: A100, RTX 30xx / 40xx "
                       "/ 50xx, A-series), sizes read on the device. auto = torch where it is device-scheduled, "
                       "portable elsewhere."));
    k.push_back(choice("cuda_graphs", &TrainConfig::cuda_graphs, {"auto", "true", "false"},
                       "On CUDA with gradient_checkpointing, replay each block's forward, its recompute + backward and "
                       "the loss as CUDA graphs (captured on their second use), so the step no longer waits on one host "
                       "thread launching kernels. Graphs keep a second working set of device memory (their own pool): "
                       "auto = on when the memory plan has room for it, offloaded or not (an offloaded step waits on "
                       "late launches too: each copy waits for its slot's last reader); false keeps the memory. Off "
                       "with lora_dropout > 0 (per-use dropout seeds are host state)."));
    k.push_back({"activation_offloading", "bool", "false",
                 "Keep the checkpointed block inputs (every block x micro-batch of a step) in pinned host RAM "
                 "until backward, copied on a copy stream ahead of use (needs gradient_checkpointing). axolotl's "
                 "legacy, hidden_states and disk are taken as true (disk: host RAM).",
                 [](const YAML::Node& n, TrainConfig& c, Issues& issues) {
                   if (auto v = as_bool(n)) { c.activation_offloading = *v; return; }
                   if (n.IsScalar() && (n.Scalar() == "legacy" || n.Scalar() == "hidden_states" || n.Scalar() == "disk")) {
                     c.activation_offloading = true;
                     if (n.Scalar() == "disk")
                       c.warnings.push_back("activation_offloading: disk keeps the checkpointed block inputs in pinned host RAM, not on a disk");
                     return;
                   }
                   issues.push_back({"activation_offloading", "expected true, false, legacy, hidden_states or disk, got '" + yaml_text(n) + "'"});
                 },
                 writer(&TrainConfig::activation_offloading)});
    k.push_back(choice("step_order", &TrainConfig::step_order, {"layer_major", "micro_batch_major"},
                       "Order of one optimizer step's block uses with gradient checkpointing: layer_major runs every "
                       "micro-batch through a block before the next (each block's experts are staged once in forward "
                       "and once in backward per step, whatever gradient_accumulation_steps is); micro_batch_major is "
                       "the classic order (forward and backward per micro-batch). Both give the same result."));
    k.push_back({"device_memory_limit", "bytes or 0", "0",
                 "Cap on the device memory eo-ddp may allocate (e.g. 8GiB makes a large GPU behave like a small card); "
                 "0 = the whole device. The start-up memory plan is checked against it.",
                 [](const YAML::Node& n, TrainConfig& c, Issues& issues) {
                   const std::string v = n.IsScalar() ? n.Scalar() : yaml_text(n);
                   if (auto b = parse_bytes(v)) { c.device_memory_limit = static_cast<std::int64_t>(*b); return; }
                   issues.push_back({"device_memory_limit", "expected a size such as 8GiB or 24GB, or 0; got '" + v + "'"});
                 },
                 [](const TrainConfig& c) { return YAML::Node(std::to_string(c.device_memory_limit)); }});
    k.push_back({"expert_offload_vram_budget", "bytes, auto or 0", "0",
                 "Device memory for blocks kept permanently resident (e.g. 8GiB); auto = what is free after the model and activations; 0 = stream all.",
                 [](const YAML::Node& n, TrainConfig& c, Issues& issues) {
                   const std::string v = n.IsScalar() ? n.Scalar() : yaml_text(n);
                   if (v == "auto" || parse_bytes(v)) { c.expert_offload_vram_budget = v; return; }
                   issues.push_back({"expert_offload_vram_budget", "expected a size such as 8GiB or 500MB, 0, or auto; got '" + v + "'"});
                 },
                 writer(&TrainConfig::expert_offload_vram_budget)});
    k.push_back({"expert_dequant_chunk", "bytes, auto or whole", "auto",
                 "Largest slice of a MoE block's experts dequantised at once for the grouped GEMMs (GPU); slices save memory and cost time (docs/benchmarks.md); auto = whole, or 64MiB when only that makes the plan fit the device.",
                 [](const YAML::Node& n, TrainConfig& c, Issues& issues) {
                   const std::string v = n.IsScalar() ? n.Scalar() : yaml_text(n);
                   if (v == "auto" || v == "whole") { c.expert_dequant_chunk = v; return; }
                   if (auto b = parse_bytes(v); b && *b >= (1 << 20)) { c.expert_dequant_chunk = v; return; }
                   issues.push_back({"expert_dequant_chunk", "expected auto, whole, or a size of at least 1MiB such as 64MiB; got '" + v + "'"});
                 },
                 writer(&TrainConfig::expert_dequant_chunk)});
    k.push_back(choice("expert_bank_reuse", &TrainConfig::expert_bank_reuse, {"auto", "all", "down", "none"},
                       "Dequantised expert banks (GPU, whole banks) a checkpointed block's recompute keeps for its "
                       "backward instead of dequantising them again: all = gate, up and down (two more banks at the "
                       "peak), down = the down projection's only (no more peak memory), none. auto = all, or down when "
                       "only that makes the memory plan fit."));
    // --- distributed
    k.push_back(integer("ddp_bucket_cap_mb", &TrainConfig::ddp_bucket_cap_mb, 1, 1 << 16, "Gradient bucket size for the all-reduce (MB)."));
    k.push_back(integer("ddp_timeout", &TrainConfig::ddp_timeout, 10, 1 << 24,
                        "Seconds a collective may take before every rank is aborted with a message naming the stuck rank."));
    // --- outputs
    k.push_back(text("output_dir", &TrainConfig::output_dir, "Where adapters, checkpoints and metrics.jsonl go."));
    k.push_back(steps_or_fraction("save_steps", &TrainConfig::save_steps, true,
                                  "Save an adapter + training state every N steps (>= 1), or every fraction of the run "
                                  "(< 1); 0 = only at the end."));
    k.push_back(integer("save_total_limit", &TrainConfig::save_total_limit, 1, 1 << 20,
                        "Training-state checkpoints of this run to keep (another run's are never deleted)."));
    k.push_back(boolean("overwrite_output_dir", &TrainConfig::overwrite_output_dir,
                        "Start a fresh run in an output_dir that holds another run's checkpoints (they are left in place, "
                        "never pruned or resumed); without it such a run is refused."));
    k.push_back(integer("logging_steps", &TrainConfig::logging_steps, 1, 1 << 30, "Log and write metrics every N steps."));
    k.push_back(integer("saves_per_epoch", &TrainConfig::saves_per_epoch, 1, 1 << 20,
                        "Save a checkpoint this many times per epoch, evenly (exclusive with save_steps)."));
    // --- evaluation
    k.push_back({"val_set_size", "float", "(none)",
                 "Hold out this fraction (< 1) or this many documents (>= 1) of the training data for evaluation: "
                 "a seeded shuffle of the documents, the last ones held out (exclusive with test_datasets).",
                 [](const YAML::Node& n, TrainConfig& c, Issues& issues) {
                   auto v = as_double(n);
                   if (!v || *v < 0 || (*v >= 1 && *v != std::floor(*v)))
                     return issues.push_back({"val_set_size", "expected a fraction in [0, 1) or a whole number of documents, got '" +
                                                                  yaml_text(n) + "'"});
                   if (*v > 0) c.val_set_size = *v;
                 },
                 writer(&TrainConfig::val_set_size)});
    k.push_back(steps_or_fraction("eval_steps", &TrainConfig::eval_steps, false,
                                  "Evaluate every N optimizer steps (>= 1), or every fraction of the run (< 1), and at the end."));
    k.push_back(integer("evals_per_epoch", &TrainConfig::evals_per_epoch, 1, 1 << 20,
                        "Evaluate this many times per epoch, evenly (exclusive with eval_steps). With eval data and "
                        "neither key, eo-ddp evaluates once at the end."));
    k.push_back(boolean("eval_sample_packing", &TrainConfig::eval_sample_packing, "Pack the evaluation sequences (default: sample_packing)."));
    k.push_back(integer("eval_batch_size", &TrainConfig::eval_batch_size, 1, 1 << 16,
                        "Sequences per rank per evaluation forward (default: micro_batch_size)."));
    k.push_back(text("lora_model_dir", &TrainConfig::lora_model_dir,
                     "A peft adapter folder (adapter_config.json + adapter_model.safetensors) to continue training "
                     "from, as axolotl: its weights replace the fresh LoRA init (a fresh optimizer state). Its r, "
                     "lora_alpha, rsLoRA and targets must equal the config's; resume_from_checkpoint, when it resumes, "
                     "takes precedence."));
    k.push_back(text("resume_from_checkpoint", &TrainConfig::resume_from_checkpoint,
                     "A checkpoint folder to continue from, or auto for the newest complete one of this run's lineage in output_dir."));
    return k;
  }();
  return keys;
}

// Flatten the document into dotted keys. Maps nest (gradient_checkpointing_kwargs.use_reentrant);
// a key whose schema type is a list or a map that the schema reads whole (datasets) stops the
// descent.
// Aliases make this walk exponential ("billion laughs": 24 lines of `b: &b {p: *a, q: *a}` give
// 2^24 keys), so the number of keys is capped far above any real config (axolotl's have < 100).
constexpr std::size_t kMaxConfigKeys = 1000;
// An alias may also point into itself (`b: &b {p: *b}`): a cycle, so the depth is capped too.
constexpr std::size_t kMaxConfigDepth = 16;

void flatten(const YAML::Node& node, const std::string& prefix, std::vector<std::pair<std::string, YAML::Node>>& out,
             const std::set<std::string>& leaf_keys, const std::string& source, std::size_t depth = 0) {
  if (depth > kMaxConfigDepth)
    throw UsageError("config " + source + ": '" + prefix.substr(0, 200) + "' nests maps more than " +
                     std::to_string(kMaxConfigDepth) + " levels deep (a YAML alias inside itself?); it is not a training config");
  for (const auto& kv : node) {
    if (out.size() >= kMaxConfigKeys)
      throw UsageError("config " + source + " has more than " + std::to_string(kMaxConfigKeys) +
                       " keys (counting nested maps; YAML aliases repeat what they point to); it is not a training config");
    const std::string k = key_text(kv.first);
    const std::string full = prefix.empty() ? k : prefix + "." + k;
    const AxolotlKey* a = axolotl_key(full);
    if (kv.second.IsMap() && !leaf_keys.count(full) && !(a && a->cls != AxolotlKey::Implemented))
      flatten(kv.second, full, out, leaf_keys, source, depth + 1);
    else
      out.emplace_back(full, kv.second);
  }
}

void place_override(YAML::Node& root, const std::string& key, const std::vector<std::string>& parts,
                    const YAML::Node& value, Issues& issues);

// Apply `key=value`: value parsed as YAML (so 1e-4, true, [a, b] work), placed at the dotted path.
void apply_override(YAML::Node& root, const std::string& assignment, Issues& issues) {
  const auto eq = assignment.find('=');
  if (eq == std::string::npos || eq == 0) {
    issues.push_back({"--set " + assignment, "expected key=value, e.g. --set learning_rate=1e-4"});
    return;
  }
  const std::string key = assignment.substr(0, eq);
  // YAML reads "" as null, which would silently restore the default: an empty value is a mistake.
  if (eq + 1 == assignment.size()) {
    issues.push_back({key, "--set " + assignment + " has an empty value; give one (e.g. --set " + key +
                               "=VALUE), write null explicitly to restore the default, or drop the --set"});
    return;
  }
  YAML::Node value;
  try {
    value = YAML::Load(assignment.substr(eq + 1));
  } catch (const YAML::Exception& e) {
    issues.push_back({key, "--set value is not valid YAML: " + std::string(e.what())});
    return;
  }
  if (!value.IsDefined()) value = YAML::Node(YAML::NodeType::Null);
  std::vector<std::string> parts;
  std::stringstream ss(key);
  for (std::string p; std::getline(ss, p, '.');) parts.push_back(p);
  // A scalar on the way (datasets.0.path=x with datasets: [x]) makes yaml-cpp throw BadSubscript.
  try {
    place_override(root, key, parts, value, issues);
  } catch (const YAML::Exception& e) {
    issues.push_back({key, "--set cannot place a value there: a part of '" + key + "' is a plain value in the config, "
                           "not a map or list (" + e.msg + ")"});
  }
}

void place_override(YAML::Node& root, const std::string& key, const std::vector<std::string>& parts,
                    const YAML::Node& value, Issues& issues) {
  // Walk with explicit node copies (yaml-cpp nodes are handles into the document).
  std::vector<YAML::Node> path{root};
  for (std::size_t i = 0; i + 1 < parts.size(); ++i) {
    YAML::Node cur = path.back();
    YAML::Node next;
    if (cur.IsSequence()) {
      std::size_t idx = 0;
      try {
        idx = std::stoul(parts[i]);
      } catch (...) {
        issues.push_back({key, "'" + parts[i] + "' is not an index into the list"});
        return;
      }
      if (idx >= cur.size()) {
        issues.push_back({key, "index " + parts[i] + " is past the end of the list"});
        return;
      }
      next = cur[idx];
    } else {
      if (!cur[parts[i]].IsDefined() || !cur[parts[i]].IsMap()) {
        if (cur[parts[i]].IsDefined() && cur[parts[i]].IsSequence()) {
          next = cur[parts[i]];
          path.push_back(next);
          continue;
        }
        cur[parts[i]] = YAML::Node(YAML::NodeType::Map);
      }
      next = cur[parts[i]];
    }
    path.push_back(next);
  }
  YAML::Node parent = path.back();
  if (parent.IsSequence()) {
    try {
      parent[std::stoul(parts.back())] = value;
    } catch (...) {
      issues.push_back({key, "'" + parts.back() + "' is not an index into the list"});
    }
  } else {
    parent[parts.back()] = value;
  }
}

// axolotl's check_nvfp4_merge_aware (integrations/kernels/args.py), the same refusals; and what
// eo-ddp's merge-aware path cannot do beside it.
void check_merge_aware(const TrainConfig& c, const std::set<std::string>& present, const std::map<std::string, YAML::Node>& noted,
                       Issues& issues) {
  if (!c.nvfp4_merge_aware) {
    if (c.nvfp4_merge_aware_start_step)
      issues.push_back({"nvfp4_merge_aware_start_step", "requires nvfp4_merge_aware: true"});
    return;
  }
  auto noted_true = [&](const char* k) {
    const auto it = noted.find(k);
    return it != noted.end() && as_bool(it->second) == true;
  };
  const auto backend = noted.find("expert_backend");
  const bool sonic = noted_true("use_sonicmoe") ||
                     (backend != noted.end() && backend->second.IsScalar() && backend->second.Scalar() == "sonicmoe");
  if (!sonic)
    issues.push_back({"nvfp4_merge_aware", "requires the sonicmoe expert backend in axolotl (use_sonicmoe: true, or "
                                           "expert_backend: sonicmoe); eo-ddp runs its own expert kernels either way, but "
                                           "refuses what axolotl refuses, so that the config trains the same in both"});
  if (present.count("adapter") && c.adapter != "lora")
    issues.push_back({"nvfp4_merge_aware", "requires a LoRA adapter (adapter: lora, without load_in_4bit); it snaps the "
                                           "LoRA delta to the NVFP4 grid of the frozen base, got adapter: " + c.adapter});
  std::vector<std::string> fused;
  for (const char* k : {"lora_mlp_kernel", "lora_qkv_kernel", "lora_o_kernel"})
    if (noted_true(k)) fused.push_back(k);
  if (!fused.empty())
    issues.push_back({fused.front(), "nvfp4_merge_aware is incompatible with " + join(fused, ", ") + " in axolotl (its fused "
                                     "LoRA kernels bypass the snapped forward, so the NVFP4 linears would train "
                                     "un-snapped); remove the lora_*_kernel keys"});
  if (c.cuda_graphs == "true")
    issues.push_back({"cuda_graphs", "cannot be combined with nvfp4_merge_aware: the snapped weights are formed anew in "
                                     "every forward and the switch at nvfp4_merge_aware_start_step changes the blocks' work; "
                                     "set cuda_graphs: auto or false"});
}

// Rules that involve several keys.
void check_rules(const TrainConfig& c, const std::set<std::string>& present, Issues& issues) {
  if (c.fp16.value_or(false) && c.bf16 == "true")
    issues.push_back({"fp16", "fp16: true and bf16: true contradict each other (one compute dtype per run): set "
                              "bf16: false (or auto) for fp16, or drop fp16 for bf16"});
  if (!present.count("base_model"))
    issues.push_back({"base_model", "required: the Hugging Face checkpoint folder to fine-tune"});
  if (!present.count("adapter"))
    issues.push_back({"adapter", "required: eo-ddp trains adapters only; set adapter: qlora (NF4 base) or adapter: lora"});
  if (!present.count("datasets"))
    issues.push_back({"datasets", "required: e.g. datasets: [{path: train.jsonl, type: chat_template}]"});
  if (!c.lora_target_parameters.empty() && c.lora_dropout > 0)
    issues.push_back({"lora_dropout", "must be 0 with lora_target_parameters: peft's ParamWrapper refuses dropout (it "
                                      "cannot be applied to the input of a fused parameter), got " + value_node(c.lora_dropout).Scalar()});
  if (c.adapter == "qlora" && !c.load_in_4bit)
    issues.push_back({"load_in_4bit", "adapter: qlora needs load_in_4bit: true (or use adapter: lora)"});
  if (c.adapter == "lora" && c.load_in_4bit)
    issues.push_back({"load_in_4bit", "load_in_4bit: true needs adapter: qlora"});
  if ((c.bnb_4bit_blocksize & (c.bnb_4bit_blocksize - 1)) != 0)
    issues.push_back({"bnb_4bit_blocksize", "must be a power of two (32 ... 4096), got " + std::to_string(c.bnb_4bit_blocksize)});
  if (c.expert_quant != "auto" && !c.load_in_4bit)
    issues.push_back({"expert_quant", c.expert_quant + " needs load_in_4bit: true (without it the experts are loaded "
                                      "unquantised); remove expert_quant or set load_in_4bit: true"});
  if (c.use_reentrant.value_or(false) && c.gradient_checkpointing)
    issues.push_back({"gradient_checkpointing_kwargs.use_reentrant",
                      "eo-ddp implements non-reentrant checkpointing only; set it to false"});
  if (c.activation_offloading && !c.gradient_checkpointing)
    issues.push_back({"activation_offloading", "activation_offloading: true parks the inputs that gradient checkpointing "
                                               "keeps; set gradient_checkpointing: true (or drop activation_offloading)"});
  // Evaluation and saving schedules: one way of saying each.
  const bool has_eval = c.val_set_size.has_value() || !c.test_datasets.empty();
  if (c.val_set_size && !c.test_datasets.empty())
    issues.push_back({"val_set_size", "set either val_set_size (held out from datasets) or test_datasets, not both"});
  if (c.eval_steps && c.evals_per_epoch)
    issues.push_back({"evals_per_epoch", "set either eval_steps or evals_per_epoch, not both"});
  if (c.saves_per_epoch && c.save_steps.value_or(0) > 0)
    issues.push_back({"saves_per_epoch", "set either save_steps or saves_per_epoch, not both"});
  if (c.chat_template == "jinja" && c.chat_template_jinja.empty())
    issues.push_back({"chat_template_jinja", "chat_template: jinja needs the template text in chat_template_jinja"});
  for (const auto* list : {&c.datasets, &c.test_datasets})
    for (std::size_t i = 0; i < list->size(); ++i) {
      const auto& d = (*list)[i];
      if (d.chat_template == "jinja" && d.chat_template_jinja.empty() && c.chat_template_jinja.empty())
        issues.push_back({std::string(list == &c.datasets ? "datasets." : "test_datasets.") + std::to_string(i) +
                              ".chat_template_jinja",
                          "chat_template: jinja needs the template text in chat_template_jinja"});
    }
  if (c.warmup_ratio && c.warmup_steps > 0)
    issues.push_back({"warmup_ratio", "set either warmup_steps or warmup_ratio, not both"});
  if (c.expert_offload_homes == "disk") {
    if (!c.expert_offload)
      issues.push_back({"expert_offload_homes", "disk keeps the offloaded experts on a drive: it needs expert_offload: true"});
    if (c.expert_offload_disk_path.empty())
      issues.push_back({"expert_offload_disk_path", "is required with expert_offload_homes: disk: a directory on a local "
                                                    "drive (ideally NVMe) for the homes file, e.g. /local/nvme/eo-homes"});
  }
  if (c.expert_offload) {
    const std::string why = " (expert_offload streams NF4 experts, re-staged by the non-reentrant recompute in backward)";
    if (!c.load_in_4bit) issues.push_back({"load_in_4bit", "expert_offload: true requires load_in_4bit: true" + why});
    if (c.adapter != "qlora" && present.count("adapter"))
      issues.push_back({"adapter", "expert_offload: true requires adapter: qlora" + why});
    if (!c.gradient_checkpointing)
      issues.push_back({"gradient_checkpointing", "expert_offload: true requires gradient_checkpointing: true: backward "
                                                  "recomputes each block, which is when its experts are staged again"});
    if (!c.use_reentrant.has_value())
      issues.push_back({"gradient_checkpointing_kwargs.use_reentrant",
                        "expert_offload: true requires it to be set explicitly to false: the non-reentrant recompute, inside "
                        "the normal backward pass, is what re-stages each block's experts. Add "
                        "'gradient_checkpointing_kwargs: {use_reentrant: false}'"});
  }
}

void check_files(const TrainConfig& c, const std::set<std::string>& present, Issues& issues) {
  if (present.count("base_model") && !c.base_model.empty()) {
    const fs::path p(c.base_model);
    if (!fs::is_directory(p) && hub::is_repo_id(c.base_model)) {
      // A Hub name: runtime/hub.h reported why it is not here, or resolves it once the others are fixed.
    } else if (!fs::is_directory(p))
      issues.push_back({"base_model", shown_path(c, c.base_model) + " is not a folder (a Hugging Face checkpoint folder, or a "
                                                           "model named as on the Hub: org/name)"});
    else if (!fs::exists(p / "config.json"))
      issues.push_back({"base_model", "'" + c.base_model + "' has no config.json"});
  }
  bool formatted = false;
  for (const auto* list : {&c.datasets, &c.test_datasets})
    for (std::size_t i = 0; i < list->size(); ++i) {
      const auto& d = (*list)[i];
      formatted |= d.formatted();
      if (!d.files.empty() || hub::is_repo_id(d.path)) continue;  // a Hub dataset or folder: runtime/hub.h checked it
      std::error_code ec;
      const auto kind = fs::status(d.path, ec).type();
      if (!d.path.empty() && kind != fs::file_type::regular && kind != fs::file_type::not_found)
        issues.push_back({std::string(list == &c.datasets ? "datasets." : "test_datasets.") + std::to_string(i) + ".path",
                          "'" + d.path + "' is " + (kind == fs::file_type::directory ? "a folder" : "not a regular file (a FIFO, socket or device)") +
                              "; give the data file itself"});
      else if (!d.path.empty() && !fs::is_regular_file(d.path))
        issues.push_back({std::string(list == &c.datasets ? "datasets." : "test_datasets.") + std::to_string(i) + ".path",
                          "file " + shown_path(c, d.path) + " not found" +
                              (d.formatted() ? std::string(" (a JSON lines, JSON or parquet file, or a dataset named as "
                                                           "on the Hub: org/name)")
                                             : std::string())});
    }
  // The axolotl formats are tokenised with the model's tokenizer: it must be there.
  if (formatted) {
    const std::string tok = c.tokenizer_config.empty() ? c.base_model : c.tokenizer_config;
    const std::string key = c.tokenizer_config.empty() ? "base_model" : "tokenizer_config";
    if (!tok.empty() && fs::is_directory(tok) && !fs::exists(fs::path(tok) / "tokenizer.json") &&
        !fs::exists(fs::path(tok) / "tokenizer_config.json"))
      issues.push_back({key, "'" + tok + "' has no tokenizer (tokenizer.json / tokenizer_config.json), which the chat_template, "
                             "alpaca, completion and input_output datasets are tokenised with; download the model's tokenizer "
                             "files into it or set tokenizer_config to a tokenizer folder"});
    else if (!c.tokenizer_config.empty() && !fs::is_directory(tok))
      issues.push_back({"tokenizer_config", shown_path(c, tok) + " is not a folder"});
  }
  // The disk homes' directory: one that exists, or that can be created (its nearest existing
  // ancestor is a writable directory). It is created when the homes are written.
  if (c.expert_offload_homes == "disk" && !c.expert_offload_disk_path.empty()) {
    const fs::path p = fs::absolute(c.expert_offload_disk_path);
    std::error_code ec;
    if (fs::exists(p, ec) && !fs::is_directory(p, ec)) {
      issues.push_back({"expert_offload_disk_path", "'" + c.expert_offload_disk_path + "' exists and is not a directory"});
    } else if (!fs::exists(p, ec)) {
      fs::path up = p.parent_path();
      while (!up.empty() && !fs::exists(up, ec) && up != up.parent_path()) up = up.parent_path();
      if (!fs::is_directory(up, ec) || ::access(up.c_str(), W_OK) != 0)
        issues.push_back({"expert_offload_disk_path", "'" + c.expert_offload_disk_path + "' does not exist and cannot be "
                                                      "created: '" + up.string() + "' is not a writable directory"});
    }
  }
  if (!c.resume_from_checkpoint.empty() && c.resume_from_checkpoint != "auto" &&
      !fs::is_directory(c.resume_from_checkpoint))
    issues.push_back({"resume_from_checkpoint", shown_path(c, c.resume_from_checkpoint) + " is not a folder (use a checkpoint folder or auto)"});
  // The run's adapter would become part of the base model's identity (and its weights folder).
  if (std::error_code ec1, ec2; !c.output_dir.empty() && fs::exists(c.base_model, ec1) && fs::exists(c.output_dir, ec2) &&
                                fs::equivalent(c.output_dir, c.base_model, ec1))
    issues.push_back({"output_dir", "'" + c.output_dir + "' is the base_model folder; the run's adapter and checkpoints "
                                    "would be written among the model's weights: choose another output_dir"});
}

// The families whose fused experts lora_target_parameters reaches, for messages ("a, b and c").
std::string fused_expert_lora_families() {
  std::vector<std::string> names;
  for (const auto& f : model::families())
    if (f.fused_expert_lora) names.push_back(f.model_type);
  std::string out;
  for (std::size_t i = 0; i < names.size(); ++i)
    out += (i == 0 ? "" : i + 1 == names.size() ? " and " : ", ") + names[i];
  return out;
}

// peft's lora_target_modules forms against the architecture's module names: a regular expression
// (one string) must match a whole name, a list entry equal the name or a dotted suffix of it.
// eo-ddp adapts a linear by its short name in every layer and expert, so the selection must take
// all the modules of a short name or none; it resolves to those short names.
void resolve_target_forms(TrainConfig& c, const model::ModelConfig& mc, const std::vector<std::string>& linears, Issues& issues) {
  bool forms = c.lora_target_regex;
  for (const auto& t : c.lora_target_modules) forms |= t.find('.') != std::string::npos;
  if (!forms) return;
  std::regex re;
  if (c.lora_target_regex) re = std::regex(c.lora_target_modules.at(0));
  auto selected = [&](const std::string& name) {
    if (c.lora_target_regex) return std::regex_match(name, re);
    for (const auto& t : c.lora_target_modules)
      if (name == t || ends_with(name, "." + t)) return true;
    return false;
  };
  const std::string what = c.lora_target_regex ? "'" + c.lora_target_modules[0] + "'" : "[" + join(c.lora_target_modules, ", ") + "]";
  std::map<std::string, std::pair<std::vector<std::string>, std::vector<std::string>>> by_short;  // selected, not
  std::vector<std::string> refused;
  for (const auto& [name, ok] : model::hf_linear_modules(mc)) {
    const std::string short_name = name.substr(name.rfind('.') + 1);
    const bool sel = selected(name);
    if (sel && !ok) refused.push_back(name);
    if (ok) (sel ? by_short[short_name].first : by_short[short_name].second).push_back(name);
  }
  if (!refused.empty())
    issues.push_back({"lora_target_modules", what + " selects " + refused[0] + (refused.size() > 1 ? " and others" : "") +
                                                 ", which eo-ddp does not adapt (its linears are " + join(linears, ", ") + ")"});
  std::vector<std::string> resolved;
  for (const auto& s : linears) {
    const auto it = by_short.find(s);
    if (it == by_short.end() || it->second.first.empty()) continue;
    if (!it->second.second.empty()) {
      issues.push_back({"lora_target_modules", what + " selects " + std::to_string(it->second.first.size()) + " of the " +
                                                   std::to_string(it->second.first.size() + it->second.second.size()) + " " +
                                                   s + " modules (" + it->second.first[0] + " but not " +
                                                   it->second.second[0] + "); eo-ddp adapts a module name in every layer "
                                                   "and expert or in none (some layers: peft_layers_to_transform)"});
      continue;
    }
    resolved.push_back(s);
  }
  if (resolved.empty() && refused.empty())
    issues.push_back({"lora_target_modules", what + " matches no linear of " + mc.model_type + " (" + c.base_model +
                                                 "/config.json); its module names are like model.layers.0.self_attn." +
                                                 linears[0] + " and its linears are " + join(linears, ", ")});
  c.lora_target_modules = resolved;
  c.lora_target_regex = false;
}

// lora_model_dir's adapter must be the adapter this config trains: the same r, alpha, rsLoRA and
// targets (peft's adapter_config.json, read here without the model code).
void check_lora_model_dir(const TrainConfig& c, Issues& issues) {
  if (c.lora_model_dir.empty()) return;
  const fs::path dir(c.lora_model_dir);
  const fs::path json_path = dir / "adapter_config.json";
  if (!fs::is_regular_file(json_path) || !fs::is_regular_file(dir / "adapter_model.safetensors"))
    return issues.push_back({"lora_model_dir", shown_path(c, c.lora_model_dir) + " is not a peft adapter folder (adapter_config.json and "
                                               "adapter_model.safetensors)"});
  nlohmann::json j;
  try {
    std::ifstream in(json_path);
    j = nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    return issues.push_back({"lora_model_dir", json_path.string() + ": not valid JSON (" + e.what() + ")"});
  }
  if (!j.is_object()) return issues.push_back({"lora_model_dir", json_path.string() + ": expected a JSON object"});
  const std::string from = " (" + json_path.string() + ")";
  auto number = [&](const char* k) { return j.contains(k) && j[k].is_number() ? j[k].get<double>() : NAN; };
  if (number("r") != c.lora_r)
    issues.push_back({"lora_r", std::to_string(c.lora_r) + ", but lora_model_dir's adapter has r " + j.value("r", nlohmann::json()).dump() + from});
  if (number("lora_alpha") != c.lora_alpha)
    issues.push_back({"lora_alpha", value_node(c.lora_alpha).Scalar() + ", but lora_model_dir's adapter has lora_alpha " +
                                        j.value("lora_alpha", nlohmann::json()).dump() + from});
  if (j.value("use_rslora", false) != c.peft_use_rslora)
    issues.push_back({"peft_use_rslora", std::string(c.peft_use_rslora ? "true" : "false") + ", but lora_model_dir's adapter has use_rslora " +
                                             (j.value("use_rslora", false) ? "true" : "false") + from});
  std::set<std::string> theirs, ours(c.lora_target_modules.begin(), c.lora_target_modules.end());
  const auto t = j.value("target_modules", nlohmann::json());
  if (t.is_array())
    for (const auto& x : t)
      if (x.is_string()) theirs.insert(x.get<std::string>());
  if (t.is_string()) theirs.insert("(regular expression) " + t.get<std::string>());
  if (theirs != ours)
    issues.push_back({"lora_target_modules", "[" + join(c.lora_target_modules, ", ") + "], but lora_model_dir's adapter targets [" +
                                                 join(std::vector<std::string>(theirs.begin(), theirs.end()), ", ") + "]" + from});
  std::set<std::string> their_params, our_params(c.lora_target_parameters.begin(), c.lora_target_parameters.end());
  const auto tp = j.value("target_parameters", nlohmann::json());
  if (tp.is_array())
    for (const auto& x : tp)
      if (x.is_string()) {
        const std::string n = x.get<std::string>();
        their_params.insert(ends_with("mlp.experts.gate_up_proj", n) ? "mlp.experts.gate_up_proj"
                            : ends_with("mlp.experts.down_proj", n)  ? "mlp.experts.down_proj"
                                                                     : n);
      }
  if (their_params != our_params)
    issues.push_back({"lora_target_parameters", "[" + join(c.lora_target_parameters, ", ") + "], but lora_model_dir's adapter has [" +
                                                    join(std::vector<std::string>(their_params.begin(), their_params.end()), ", ") + "]" + from});
  std::set<int> their_layers, our_layers(c.peft_layers_to_transform.begin(), c.peft_layers_to_transform.end());
  const auto lt = j.value("layers_to_transform", nlohmann::json());
  if (lt.is_number_integer()) their_layers.insert(lt.get<int>());
  if (lt.is_array())
    for (const auto& x : lt)
      if (x.is_number_integer()) their_layers.insert(x.get<int>());
  auto layers_text = [](const std::set<int>& l) {
    std::string t;
    for (int i : l) t += (t.empty() ? "" : ", ") + std::to_string(i);
    return l.empty() ? std::string("every layer") : "[" + t + "]";
  };
  if (their_layers != our_layers)
    issues.push_back({"peft_layers_to_transform", layers_text(our_layers) + ", but lora_model_dir's adapter adapts " +
                                                      layers_text(their_layers) + from});
}

// A named template eo-ddp ships renders on any model as in axolotl; on another family's model a
// note, since this tokenizer may split the template's special tokens into pieces.
void note_named_template(const std::string& value, const std::string& key, const model::ModelConfig& mc,
                         std::vector<std::string>& warnings) {
  const auto it = shipped_templates().find(value);
  if (it == shipped_templates().end() || it->second.empty()) return;
  const auto& fams = it->second;  // the family's model_types; the first names it
  if (std::find(fams.begin(), fams.end(), mc.model_type) == fams.end())
    warnings.push_back(key + ": " + value + " is axolotl's template for " + fams.front() + ", rendered on " +
                       mc.model_type + "'s tokenizer as axolotl does (tokens it lacks are split into pieces); its own "
                       "template is chat_template: tokenizer_default");
}

// Checks against base_model's config.json (skipped when it cannot be read; reported elsewhere).
// lora_target_linear resolves to the architecture's linears (ModelConfig::linear_modules); any
// target that matches none of them is a config error here, before a weight is read. So is asking
// for the router aux loss of a family transformers computes none for, and lora_target_parameters
// on a model without the fused [E, 2I, H] gate_up_proj experts it is built for.
void check_targets(TrainConfig& c, const std::set<std::string>& present, Issues& issues, model::ModelConfig* parsed) {
  if (!present.count("base_model") || c.base_model.empty()) return;
  model::ModelConfig mc;
  try {
    mc = load_model_config(c, &c.warnings);
    if (parsed) *parsed = mc;
  } catch (const ModelOverrideError& e) {
    issues.push_back({"overrides_of_model_config", e.what()});
    return;
  } catch (const std::exception& e) {
    // An unsupported or malformed config.json is listed with the key problems, so one --check
    // names them all; a missing folder or config.json is check_files' to report.
    if (fs::is_regular_file(fs::path(c.base_model) / "config.json")) issues.push_back({"base_model", e.what()});
    return;
  }
  note_named_template(c.chat_template, "chat_template", mc, c.warnings);
  for (auto* list : {&c.datasets, &c.test_datasets})
    for (std::size_t i = 0; i < list->size(); ++i)
      note_named_template((*list)[i].chat_template,
                          std::string(list == &c.datasets ? "datasets." : "test_datasets.") + std::to_string(i) + ".chat_template",
                          mc, c.warnings);
  for (int l : c.peft_layers_to_transform)
    if (l >= mc.layers) {
      issues.push_back({"peft_layers_to_transform", std::to_string(l) + " is no layer of " + mc.model_type + " (" + c.base_model +
                                                        "/config.json has layers 0 to " + std::to_string(mc.layers - 1) + ")"});
      break;
    }
  if (c.expert_quant == "mxfp4" && !mc.mxfp4_experts)
    issues.push_back({"expert_quant", "mxfp4 keeps experts in the MXFP4 a checkpoint stores them in, but " + c.base_model +
                                      "/config.json (" + mc.model_type + ") has no quantization_config with quant_method "
                                      "mxfp4; use expert_quant: nf4 or auto"});
  if (c.nvfp4_merge_aware && !mc.nvfp4)
    issues.push_back({"nvfp4_merge_aware", "snaps the LoRA delta onto an NVFP4 base's grid, but " + c.base_model +
                                           "/config.json (" + mc.model_type + ") is no NVFP4 checkpoint (quantization_config "
                                           "quant_method modelopt, quant_algo NVFP4); use an NVFP4 base_model or remove "
                                           "nvfp4_merge_aware"});
  else if (c.nvfp4_merge_aware && !c.lora_target_parameters.empty() && c.load_in_4bit && c.expert_quant == "nf4")
    issues.push_back({"expert_quant", "nf4 re-quantises the NVFP4 experts, so nvfp4_merge_aware has no NVFP4 grid to snap "
                                      "them to; use expert_quant: auto"});
  if (c.output_router_logits && !mc.has_aux_loss)
    issues.push_back({"output_router_logits", mc.model_type + " has no router auxiliary loss in transformers (it balances "
                                              "its experts with e_score_correction_bias, or not at all); set it to false"});
  if (!c.lora_target_parameters.empty()) {
    if (mc.moe_layer_count() == 0)
      issues.push_back({"lora_target_parameters", mc.model_type + " (" + c.base_model + "/config.json) has no MoE block, "
                                                  "so no fused expert parameter to adapt"});
    else if (!mc.fused_expert_lora_ok())
      issues.push_back({"lora_target_parameters", "implemented for " + fused_expert_lora_families() +
                                                  " (experts fused as gate_up_proj [E, 2I, H] and down_proj [E, H, I]); "
                                                  "not yet for " + mc.model_type + ": use lora_target_modules"});
  }
  if (!c.lora_target_parameters.empty() && !mc.dense_beside_experts()) {
    // peft 0.21 on transformers 5 rewrites expert names in target_modules (gate_proj, up_proj,
    // down_proj, w1, w2, w3) into target_parameters, gate_up_proj at rank 2r, when it loads an
    // adapter: beside lora_target_parameters the adapter would not load as trained. Not for
    // Gemma 4: its gate/up/down_proj are the dense MLP beside the experts, which peft keeps
    // (transformers maps gemma4 to no MoE conversion).
    static const char* kWhy = "peft 0.21 on transformers 5 maps these names onto the fused expert parameters "
                              "(gate_up_proj at rank 2r) when it loads the adapter, so together with "
                              "lora_target_parameters it would not load as trained";
    if (present.count("lora_target_linear") && c.lora_target_linear) {
      issues.push_back({"lora_target_linear", std::string("cannot be combined with lora_target_parameters: it adapts "
                                                          "gate_proj/up_proj/down_proj (w1/w2/w3), and ") + kWhy +
                                                  "; list the attention modules in lora_target_modules instead"});
    } else {
      std::vector<std::string> experts;
      for (const auto& t : c.lora_target_modules)
        for (const auto& n : model::expert_linear_names())
          if (t == n) experts.push_back(t);
      if (!experts.empty())
        issues.push_back({"lora_target_modules", "names " + join(experts, ", ") + " beside lora_target_parameters; " +
                                                     kWhy + "; keep the attention modules only"});
    }
  }
  const std::vector<std::string> linears = mc.linear_modules();
  if (c.lora_target_linear) {
    c.lora_target_modules = linears;
    return check_lora_model_dir(c, issues);
  }
  // Unset, the targets are the architecture's attention linears (DeepSeek's latent attention has
  // no k_proj or v_proj), as peft's per-model defaults are attention projections.
  if (!present.count("lora_target_modules")) {
    c.lora_target_modules = mc.attention_linears();
    return check_lora_model_dir(c, issues);
  }
  resolve_target_forms(c, mc, linears, issues);
  // As peft: a name that matches no module is no error while another name matches one (axolotl's
  // examples list q/k/v/o_proj also for latent attention, which has no k_proj); the list as a whole
  // matching nothing is. Either way the log names what is dropped.
  const std::vector<std::string>& known = model::all_linear_modules();  // other names: reported by the key's own check
  std::vector<std::string> kept, unmatched;
  for (const auto& t : c.lora_target_modules) {
    const bool is_linear = std::find(linears.begin(), linears.end(), t) != linears.end();
    if (!is_linear && std::find(known.begin(), known.end(), t) != known.end()) unmatched.push_back(t);
    else kept.push_back(t);
  }
  const bool any_match = std::any_of(kept.begin(), kept.end(), [&](const std::string& t) {
    return std::find(linears.begin(), linears.end(), t) != linears.end();
  });
  if (!unmatched.empty() && any_match) {
    std::vector<std::string> quoted;
    for (const auto& t : unmatched) quoted.push_back("'" + t + "'");
    c.warnings.push_back("lora_target_modules: " + join(quoted, ", ") + (unmatched.size() > 1 ? " match" : " matches") +
                         " no linear of " + mc.model_type + " (its linears are " + join(linears, ", ") +
                         "); as peft does, only the names that match are adapted: " + join(kept, ", "));
    c.lora_target_modules = kept;
  } else {
    for (const auto& t : unmatched)
      issues.push_back({"lora_target_modules", "'" + t + "' matches no linear of " + mc.model_type + " (" + c.base_model +
                                                   "/config.json); its linears are " + join(linears, ", ") +
                                                   " (or set lora_target_linear: true)"});
  }
  check_lora_model_dir(c, issues);
}

// axolotl keys whose values eo-ddp reads itself (the table's Implemented entries with a text).
bool read_axolotl_special(const std::string& key, const YAML::Node& n, TrainConfig& c, Issues& issues) {
  auto one_of = [&](std::initializer_list<const char*> allowed, const std::string& what) {
    if (is_null(n)) return std::string();
    const std::string v = n.IsScalar() ? n.Scalar() : yaml_text(n);
    for (const char* a : allowed)
      if (v == a) return v;
    issues.push_back({key, "'" + v + "': " + what});
    return std::string();
  };
  if (key == "plugins") {
    const auto list = string_list("plugins", n, "plugin class names", issues);
    if (!list) return true;
    // axolotl's bundled plugins, by their module under axolotl.integrations.
    static const std::map<std::string, std::pair<bool, std::string>> kinds = {
        {"liger", {true, "eo-ddp's own fused kernels and chunked loss do what Liger's kernels do"}},
        {"cut_cross_entropy", {true, "eo-ddp computes the loss in chunks without materialising the full logits"}},
        {"kernels", {true, "eo-ddp's own NF4/MXFP4 grouped expert GEMMs replace the hub kernels"}},
        {"swanlab", {true, "metrics go to output_dir/metrics.jsonl and the log"}},
        {"lm_eval", {true, "eo-ddp runs no benchmark; eo-ddp score computes an adapter's loss on a data file"}},
        {"expert_parallel", {false, "expert parallelism places different experts on different ranks, but every eo-ddp "
                                    "rank streams all experts itself"}},
        {"spectrum", {false, "it trains selected base weights; eo-ddp trains LoRA adapters only"}},
        {"kd", {false, "eo-ddp trains supervised LoRA/QLoRA only (no distillation)"}},
        {"diffusion", {false, "eo-ddp trains causal language models (no diffusion objective)"}},
        {"grokfast", {false, "gradient filtering is not implemented"}},
        {"densemixer", {false, "a dense router gradient is not implemented"}},
        {"mora", {false, "eo-ddp trains plain LoRA"}},
        {"llm_compressor", {false, "quantisation-aware training and compression are not implemented"}},
        {"hatchery", {false, "remote training backends are not eo-ddp"}},
        {"nemo_gym", {false, "eo-ddp trains supervised LoRA/QLoRA only (no RL environments)"}},
    };
    for (const auto& p : *list) {
      const std::string prefix = "axolotl.integrations.";
      const std::string module = p.rfind(prefix, 0) == 0 ? p.substr(prefix.size(), p.find('.', prefix.size()) - prefix.size()) : "";
      const auto it = kinds.find(module);
      if (it == kinds.end())
        issues.push_back({"plugins", "unknown plugin '" + p + "'; eo-ddp runs no Python plugins (axolotl's bundled ones "
                                     "are noted or refused by name, e.g. axolotl.integrations.liger.LigerPlugin)"});
      else if (!it->second.first) issues.push_back({"plugins", "'" + p + "' not supported: " + it->second.second});
      else c.warnings.push_back("config plugin '" + p + "' is ignored by eo-ddp: " + it->second.second);
    }
    return true;
  }
  if (key == "excess_length_strategy") {
    one_of({"drop"}, "eo-ddp drops a row longer than sequence_len, as axolotl's default drop (a completion text is cut "
                     "into pieces); truncate and raise are not implemented");
    return true;
  }
  if (key == "eval_strategy" || key == "evaluation_strategy") {
    if (one_of({"no", "steps", "epoch"}, "expected no, steps or epoch") == "no")
      c.warnings.push_back("config key '" + key + "': no is ignored by eo-ddp: it evaluates whenever there is evaluation "
                           "data (remove val_set_size / test_datasets to skip it)");
    return true;
  }
  if (key == "save_strategy") {
    if (one_of({"no", "steps", "epoch", "best"}, "expected no, steps, epoch or best") != "")
      c.warnings.push_back("config key 'save_strategy' is ignored by eo-ddp: checkpoints follow save_steps / "
                           "saves_per_epoch, and the adapter is always written at the end");
    return true;
  }
  return false;
}

// axolotl's older names of its keys, read as the current key.
const std::map<std::string, std::string>& older_key_names() {
  static const std::map<std::string, std::string> m = {{"model_revision", "revision_of_model"},
                                                       {"model_config", "overrides_of_model_config"}};
  return m;
}

// A message that echoes a huge value is cut in its middle (its start names the value, its end the fix).
std::string shorten(const std::string& m) {
  if (m.size() <= 1200) return m;
  return m.substr(0, 500) + " [... " + std::to_string(m.size() - 900) + " bytes cut ...] " + m.substr(m.size() - 400);
}

std::string format_issues(const std::string& source, const Issues& issues) {
  std::ostringstream os;
  os << "config " << source << " has " << issues.size() << (issues.size() == 1 ? " problem:" : " problems:");
  for (const auto& i : issues) os << "\n  - " << shorten(i.key) << ": " << shorten(i.message);
  return os.str();
}

// yaml-cpp keeps one of two equal keys of a mapping silently: each repeat is a config error.
// Aliases can make the document a cycle or exponentially wide (see kMaxConfigDepth / kMaxConfigKeys),
// so the walk stops at the same depth and after a bounded number of nodes; flatten() then names
// the problem.
struct DuplicateWalk {
  Issues& issues;
  std::size_t nodes_left = 10 * kMaxConfigKeys;

  void visit(const YAML::Node& node, const std::string& where, std::size_t depth) {
    if (depth > kMaxConfigDepth || nodes_left == 0) return;
    --nodes_left;
    if (node.IsMap()) {
      std::set<std::string> seen;
      for (const auto& kv : node) {
        const std::string k = kv.first.IsScalar() ? kv.first.Scalar() : "?";
        const std::string path = where.empty() ? k : where + "." + k;
        if (kv.first.IsScalar() && !seen.insert(k).second)
          issues.push_back({path, "appears more than once; keep one (YAML would silently use one of them)"});
        visit(kv.second, path, depth + 1);
      }
    } else if (node.IsSequence()) {
      for (std::size_t i = 0; i < node.size(); ++i) visit(node[i], where + "." + std::to_string(i), depth + 1);
    }
  }
};

void find_duplicate_keys(const YAML::Node& root, Issues& issues) { DuplicateWalk{issues}.visit(root, "", 0); }

// Counts the nodes of one document that are not null (a document separator alone gives none).
struct ContentCounter : YAML::EventHandler {
  std::size_t nodes = 0;
  void OnDocumentStart(const YAML::Mark&) override {}
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark&, YAML::anchor_t) override {}
  void OnAlias(const YAML::Mark&, YAML::anchor_t) override { ++nodes; }
  void OnScalar(const YAML::Mark&, const std::string&, YAML::anchor_t, const std::string&) override { ++nodes; }
  void OnSequenceStart(const YAML::Mark&, const std::string&, YAML::anchor_t, YAML::EmitterStyle::value) override {
    ++nodes;
  }
  void OnSequenceEnd() override {}
  void OnMapStart(const YAML::Mark&, const std::string&, YAML::anchor_t, YAML::EmitterStyle::value) override {
    ++nodes;
  }
  void OnMapEnd() override {}
};

// The config's one YAML document. YAML::LoadAll is not used: yaml-cpp before 0.8.1 loops forever
// in it on some malformed input (`,` alone; jbeder/yaml-cpp PR 1319), so only the first two
// documents are ever parsed, and a second one with content is an error.
YAML::Node load_one_document(const std::string& text, const std::string& source) {
  const YAML::Node root = YAML::Load(text);
  std::istringstream in(text);
  YAML::Parser parser(in);
  ContentCounter first, second;
  if (parser.HandleNextDocument(first) && parser.HandleNextDocument(second) && second.nodes > 0)
    throw UsageError("config " + source + " holds more than one YAML document (separated by ---); "
                     "eo-ddp reads one config: keep one document");
  return root;
}

}  // namespace

TrainConfig load_config_text(const std::string& yaml_text_in, const std::string& source,
                             const std::vector<std::string>& overrides, const ConfigLoadOptions& options) {
  Issues issues;
  YAML::Node root;
  try {
    root = load_one_document(yaml_text_in, source);
  } catch (const YAML::Exception& e) {
    throw UsageError("config " + source + " is not valid YAML: " + e.what());
  }
  find_duplicate_keys(root, issues);
  if (!root.IsDefined() || root.IsNull()) root = YAML::Node(YAML::NodeType::Map);
  if (!root.IsMap()) throw UsageError("config " + source + " must be a YAML mapping of key: value");
  for (const auto& o : overrides) apply_override(root, o, issues);

  std::set<std::string> leaf_keys;
  std::vector<std::string> known;
  for (const auto& s : schema()) {
    leaf_keys.insert(s.key);
    known.push_back(s.key);
  }
  for (const auto& [older, key] : older_key_names())
    if (leaf_keys.count(key)) leaf_keys.insert(older);
  std::vector<std::pair<std::string, YAML::Node>> entries;
  flatten(root, "", entries, leaf_keys, source);

  TrainConfig cfg;
  cfg.source = source;
  std::set<std::string> present;
  std::map<std::string, YAML::Node> noted;  // the Noted / Rejected keys set, as written
  std::vector<std::string> candidates;  // for "did you mean": the schema's keys and axolotl's
  int suggested = 0;
  for (const auto& [key_in, node] : entries) {
    std::string key = key_in;
    if (const auto older = older_key_names().find(key); older != older_key_names().end()) key = older->second;
    if (read_axolotl_special(key, node, cfg, issues)) continue;
    const AxolotlKey* axo = axolotl_key(key);
    if (axo && axo->cls != AxolotlKey::Implemented) {
      apply_axolotl_key(*axo, key, node, cfg.warnings, issues);
      noted[key] = node;  // a few rules read them (check_merge_aware)
      continue;
    }
    const KeySpec* spec = nullptr;
    for (const auto& s : schema())
      if (s.key == key) spec = &s;
    if (!spec && axo && is_off(node, false)) continue;  // model_config: or gradient_checkpointing_kwargs: left empty
    if (!spec) {
      std::string msg = "unknown key";
      // A config with hundreds of unknown keys (YAML aliases repeat maps) is no typo: past the
      // first few, the suggestion search, the costly part, is skipped.
      constexpr int kSuggestedKeys = 32;
      if (candidates.empty()) {
        candidates = known;
        for (const auto& a : axolotl_table())
          if (std::string(a.key).rfind("datasets[].", 0) != 0) candidates.push_back(a.key);
      }
      std::optional<std::string> m;
      const std::optional<KeyAlias> alias = key_alias(key);
      if (!alias && suggested++ < kSuggestedKeys) m = closest_match(key, candidates);
      if (alias) msg += "; " + spelled_here(*alias);
      else if (m) msg += "; did you mean '" + *m + "'?";
      else msg += "; `eo-ddp --help-config` lists every key";
      issues.push_back({key, msg});
      continue;
    }
    if (is_null(node)) continue;  // "key:" with no value keeps the default, as in axolotl
    present.insert(key);
    spec->read(node, cfg, issues);
  }
  resolve_config_paths(cfg, options.config_dir, present, overrides);
  if (cfg.lora_target_linear)
    cfg.lora_target_modules = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
  check_rules(cfg, present, issues);
  check_merge_aware(cfg, present, noted, issues);
  // As axolotl: evaluation settings without evaluation data (val_set_size 0) mean no evaluation.
  if (!cfg.val_set_size && cfg.test_datasets.empty())
    for (const char* k : {"eval_steps", "evals_per_epoch", "eval_sample_packing", "eval_batch_size"})
      if (present.count(k))
        cfg.warnings.push_back(std::string("config key '") + k + "' has no effect: there is no evaluation data "
                               "(val_set_size is 0 and there are no test_datasets), so no evaluation runs, as in axolotl");
  // Names as on the Hub become their cache folders before anything reads them (downloaded only
  // when the config has no other problem).
  if (options.check_files || options.check_architecture) {
    std::vector<std::pair<std::string, std::string>> hub_problems;
    hub::resolve_config(cfg, options.check_files ? hub::Need::Everything : hub::Need::Config, issues.empty(), hub_problems);
    for (auto& [k, m] : hub_problems) issues.push_back({k, m});
  }
  if (options.check_files) check_files(cfg, present, issues);
  // Needs base_model's config.json only: training and `eo-ddp plan` (check_architecture) check it.
  model::ModelConfig parsed;  // config.json, when the checks read it
  if (options.check_files || options.check_architecture) check_targets(cfg, present, issues, &parsed);
  if (!issues.empty()) throw UsageError(format_issues(source, issues));
  if (options.model_out)
    *options.model_out = !parsed.model_type.empty() ? std::move(parsed) : load_model_config(cfg);
  // A depth other than the default with staging that never prefetches is most likely a mistake.
  if (cfg.expert_offload_prefetch_depth != 1 && !(cfg.expert_offload && cfg.expert_offload_prefetch))
    cfg.warnings.push_back("expert_offload_prefetch_depth is ignored: it needs expert_offload: true and "
                           "expert_offload_prefetch: true (synchronous staging uses one slot)");
  if (!cfg.expert_offload_disk_path.empty() && cfg.expert_offload_homes != "disk")
    cfg.warnings.push_back("expert_offload_disk_path is ignored: expert_offload_homes is " + cfg.expert_offload_homes +
                           ", not disk");
  if (cfg.expert_offload && !cfg.expert_offload_pin_memory)
    cfg.warnings.push_back("expert_offload_pin_memory: false gives pageable homes; host-to-device copies are far slower "
                           "(about 18x on the H200 machine)");
  return cfg;
}

TrainConfig load_config_file(const std::string& path, const std::vector<std::string>& overrides,
                             const ConfigLoadOptions& options) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) throw UsageError("--config " + path + " is a folder; give the YAML config file in it");
  std::ifstream in(path);
  if (!in) throw UsageError("cannot read config file '" + path + "'");
  std::stringstream ss;
  ss << in.rdbuf();
  ConfigLoadOptions with_dir = options;
  with_dir.config_dir = fs::absolute(path).parent_path().string();
  return load_config_text(ss.str(), path, overrides, with_dir);
}

std::vector<std::string> config_known_keys() {
  std::vector<std::string> k;
  for (const auto& s : schema()) k.push_back(s.key);
  return k;
}

std::vector<ConfigKeyDoc> config_key_docs() {
  std::vector<ConfigKeyDoc> out;
  for (const auto& s : schema()) out.push_back({s.key, s.type, s.default_text, s.doc});
  return out;
}

std::string config_reference_markdown() {
  std::ostringstream os;
  os << "| key | type | default | meaning |\n|---|---|---|---|\n";
  for (const auto& s : schema())
    os << "| `" << s.key << "` | " << s.type << " | " << s.default_text << " | " << s.doc << " |\n";
  os << "\nEvery other key of axolotl's schema is accepted with a note in the log or refused with a reason: "
        "docs/axolotl-keys.md (`eo-ddp --help-axolotl-keys`). Any other key is an error.\n";
  return os.str();
}

std::vector<AxolotlKeyInfo> axolotl_keys() {
  std::vector<AxolotlKeyInfo> out;
  for (const auto& a : axolotl_table())
    out.push_back({a.key, a.cls == AxolotlKey::Implemented ? "implemented" : a.cls == AxolotlKey::Noted ? "noted" : "rejected",
                   a.text});
  return out;
}

std::string axolotl_keys_markdown() {
  std::ostringstream os;
  os << "# axolotl's config keys in eo-ddp\n\n"
        "Every key of axolotl 0.19.0's config schema (with its bundled plugins' keys, and a `datasets` entry's keys "
        "as `datasets[].KEY`), and the older axolotl / transformers' Trainer keys configs still carry, as eo-ddp takes it: **implemented** (read; see docs/configuration.md), "
        "**noted** (accepted; when set, the log says what eo-ddp does instead) or **rejected** (an error naming the "
        "reason unless the value is off: null, false, empty, 0, or 1 for a parallel size). A key in neither this "
        "table nor the config reference is an error with a \"did you mean\". Printed by `eo-ddp --help-axolotl-keys` "
        "from `runtime/axolotl_keys.inc`.\n\n| key | class | what eo-ddp does |\n|---|---|---|\n";
  for (const auto& a : axolotl_keys())
    os << "| `" << a.key << "` | " << a.cls << " | " << (a.text.empty() ? "read as axolotl does" : a.text) << " |\n";
  return os.str();
}

std::string config_to_yaml(const TrainConfig& c) {
  // Built from the schema so the printout always shows every key the loader knows.
  YAML::Node root(YAML::NodeType::Map);
  for (const auto& spec : schema()) {
    YAML::Node value = spec.write(c);
    if (!value.IsDefined()) continue;
    const auto dot = spec.key.find('.');
    if (dot == std::string::npos) root[spec.key] = value;
    else root[spec.key.substr(0, dot)][spec.key.substr(dot + 1)] = value;
  }
  YAML::Emitter out;
  out << root;
  return out.c_str();
}

ComputeChoice resolve_compute(const TrainConfig& cfg, bool on_cuda, bool cuda_has_bf16) {
  if (cfg.fp16.value_or(false)) return {Compute::Fp16, "fp16: true"};
  if (cfg.bf16 == "true") return {Compute::Bf16, "bf16: true"};
  if (cfg.bf16 == "false") return {Compute::Fp32, "bf16: false"};
  if (!on_cuda) return {Compute::Fp32, "bf16: auto on the CPU"};
  if (cuda_has_bf16) return {Compute::Bf16, "bf16: auto on a GPU with bf16"};
  if (cfg.fp16.has_value())
    return {Compute::Fp32, "bf16: auto on a GPU without bf16 (compute capability below 8.0), and fp16: false"};
  return {Compute::Fp16, "bf16: auto on a GPU without bf16 (compute capability below 8.0): fp16 with loss scaling"};
}

const char* compute_name(Compute c) { return c == Compute::Fp16 ? "fp16" : c == Compute::Bf16 ? "bf16" : "fp32"; }

bool experts_in_mxfp4(const TrainConfig& cfg, const model::ModelConfig& mc) {
  return cfg.load_in_4bit && (cfg.expert_quant == "mxfp4" || (cfg.expert_quant == "auto" && mc.mxfp4_experts));
}

std::optional<QuantFormat> expert_format(const TrainConfig& cfg, const model::ModelConfig& mc) {
  if (experts_in_mxfp4(cfg, mc)) return QuantFormat::Mxfp4;
  if (mc.nvfp4 && !(cfg.load_in_4bit && cfg.expert_quant == "nf4")) return QuantFormat::Nvfp4;
  if (cfg.load_in_4bit) return QuantFormat::Nf4;
  return std::nullopt;
}

}  // namespace eo
