// The `datasets:` / `test_datasets:` lists (runtime/config_datasets.h).
#include "runtime/config_datasets.h"

#include <algorithm>
#include <regex>

#include "common/text.h"
#include "runtime/config_axolotl.h"
#include "runtime/config_chat_templates.h"
#include "runtime/dataset_source.h"
#include "runtime/datasets_legacy.h"
#include "runtime/yaml_values.h"

namespace eo::config_detail {
namespace {

// The types a datasets entry may have: pre-tokenized, and the axolotl formats (tokenised through transformers).
const std::vector<std::string> kPreTokenized = {"tokenized", "tokens"};
const std::vector<std::string> kFormatted = {"chat_template", "alpaca", "completion", "input_output"};

}  // namespace

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

}  // namespace eo::config_detail
