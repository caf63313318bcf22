// The `datasets:` / `test_datasets:` lists (runtime/config_datasets.h).
#include "runtime/config_datasets.h"

#include <algorithm>
#include <optional>
#include <regex>

#include "common/text.h"
#include "runtime/config_axolotl.h"
#include "runtime/config_chat_templates.h"
#include "runtime/dataset_keys.h"
#include "runtime/dataset_source.h"
#include "runtime/datasets_legacy.h"
#include "runtime/yaml_values.h"

namespace eo::config_detail {
namespace {

// The types a datasets entry may have: pre-tokenized, and the axolotl formats (tokenised through transformers).
const std::vector<std::string> kPreTokenized = {"tokenized", "tokens"};
const std::vector<std::string> kFormatted = {"chat_template", "alpaca", "completion", "input_output"};

// One row per key of a datasets entry: the type that takes it (every type where empty), its value and
// default for the help, its meaning, and for a plain string the DatasetSpec field the table itself reads
// and writes back. Keys whose values need more (split's slices, the Hub source's keys, lists and maps)
// are read by their own code below; their row still decides where they apply and documents them.
struct DatasetKey {
  const char* key;
  const char* takes;
  const char* value;
  const char* default_text;
  const char* doc;
  std::string DatasetSpec::*text = nullptr;
  bool own_reader = false;  // a string read by its own code, written back by the table
};

const std::vector<DatasetKey>& dataset_keys() {
  static const std::vector<DatasetKey> k = {
      {"path", "", "string", "(required)", "The data file (JSON lines, JSON or parquet), or a dataset named as on the "
       "Hub (org/name), read from the Hugging Face cache."},
      {"type", "", "string", "(required)", "chat_template, alpaca, completion or input_output (tokenised through "
       "transformers), or the pre-tokenized tokenized (JSONL) and tokens (binary)."},
      {"ds_type", "", "string", "(from the file)", "json or parquet, as axolotl writes it; left out, the file's extension "
       "decides (a parquet file must be named .parquet)."},
      {"split", "", "string", "train", "The split of a local file (train) or one slice of it as Hugging Face's datasets "
       "cut it: train[:20%], train[10:50], train[-10%:] (the axolotl formats only).", &DatasetSpec::split, true},
      {"revision", "", "string", "main", "The branch, tag or commit of a dataset named as on the Hub.",
       &DatasetSpec::revision, true},
      {"data_files", "", "string or list", "(every data file)", "The files of a Hub dataset to read."},
      {"shards", "", "int", "(none)", "Train on one of this many shards of the rows, after a shuffle seeded by seed, "
       "as axolotl."},
      {"shards_idx", "", "int", "0", "Which shard (with shards)."},
      {"dtype", "tokens", "string", "uint16", "The token file's element type: uint16 or uint32."},
      {"eos_token_id", "tokens", "int", "(none)", "The token that ends each document in the token file."},
      {"field_messages", "chat_template", "string", "messages", "The row's field holding the list of messages.",
       &DatasetSpec::field_messages},
      {"message_field_role", "chat_template", "string", "role", "Each message's field holding its role.",
       &DatasetSpec::message_field_role},
      {"message_field_content", "chat_template", "string", "content", "Each message's field holding its text.",
       &DatasetSpec::message_field_content},
      {"message_property_mappings", "chat_template", "map", "(none)", "Newer axolotl's spelling of the two above: "
       "{role: FIELD, content: FIELD}."},
      {"message_field_training", "chat_template", "string", "(none)", "Each message's field that says whether it is "
       "trained (overrides roles_to_train for that message).", &DatasetSpec::message_field_training},
      {"roles_to_train", "chat_template", "list", "[assistant]", "The roles whose turns are trained."},
      {"train_on_eos", "chat_template", "string", "turn", "Which end-of-sequence tokens are trained: all, turn (of "
       "trained turns), last or none.", &DatasetSpec::train_on_eos},
      {"roles", "chat_template", "map", "(none)", "The data's role names for each role, e.g. {assistant: [gpt], user: "
       "[human]}."},
      {"drop_system_message", "chat_template", "bool", "false", "Drop a leading system message."},
      {"chat_template", "chat_template", "string", "(the top-level key)", "This dataset's chat template (as the "
       "top-level chat_template).", &DatasetSpec::chat_template},
      {"chat_template_jinja", "chat_template", "string", "(the top-level key)", "This dataset's Jinja template (with "
       "chat_template: jinja).", &DatasetSpec::chat_template_jinja},
      {"train_on_eot", "chat_template", "string", "(train_on_eos)", "Which end-of-turn tokens are trained: all, turn, "
       "last or none.", &DatasetSpec::train_on_eot},
      {"field_thinking", "chat_template", "string", "reasoning_content", "The message field holding its reasoning, "
       "rendered as template_thinking_key.", &DatasetSpec::field_thinking},
      {"template_thinking_key", "chat_template", "string", "reasoning_content", "The name the chat template reads a "
       "message's reasoning under.", &DatasetSpec::template_thinking_key},
      {"field", "completion", "string", "text", "The row's field holding the text.", &DatasetSpec::field},
  };
  return k;
}

bool takes(const DatasetKey& k, const std::string& type) { return !*k.takes || type == k.takes; }

std::vector<std::string> keys_taken_by(const std::optional<std::string>& type) {
  std::vector<std::string> out;
  for (const auto& k : dataset_keys())
    if (!type || takes(k, *type)) out.push_back(k.key);
  return out;
}

}  // namespace

void read_datasets(const YAML::Node& n, const std::string& key, std::vector<DatasetSpec>& out, std::vector<std::string>& warnings,
                   Issues& issues) {
  if (!n.IsSequence() || n.size() == 0)
    return issues.push_back({key, "expected a non-empty list, e.g. " + key + ": [{path: data.jsonl, type: chat_template}]"});
  const std::vector<std::string> all = keys_taken_by(std::nullopt);
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
    const std::vector<std::string> allowed = keys_taken_by(s.type);
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
    for (const auto& k : dataset_keys()) {
      if (!k.text || k.own_reader || !takes(k, s.type) || !d[k.key].IsDefined() || is_null(d[k.key])) continue;
      if (!d[k.key].IsScalar() || d[k.key].Scalar().empty())
        issues.push_back({where + "." + k.key, "expected a non-empty string"});
      else s.*k.text = d[k.key].Scalar();
    }
    if (s.type == "chat_template") {
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
    for (const auto& k : dataset_keys())
      if (k.text && !(d.*k.text).empty()) e[k.key] = d.*k.text;
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

namespace eo {

std::vector<ConfigKeyDoc> dataset_key_docs() {
  std::vector<ConfigKeyDoc> out;
  for (const auto& k : config_detail::dataset_keys()) {
    std::string value = k.value;
    if (*k.takes) value += " (type " + std::string(k.takes) + ")";
    out.push_back({std::string("datasets[].") + k.key, value, k.default_text, k.doc});
  }
  return out;
}

nlohmann::json dataset_key_defaults() {
  nlohmann::json out = nlohmann::json::object();
  for (const auto& k : config_detail::dataset_keys()) {
    const std::string v = k.default_text, type = k.value;
    if (v.empty() || v.front() == '(') continue;
    if (type == "list") {  // "[a, b]"
      nlohmann::json items = nlohmann::json::array();
      std::string item;
      for (const char c : v.substr(1, v.size() - 2) + ",") {
        if (c == ',' && !item.empty()) items.push_back(item), item.clear();
        else if (c != ',' && c != ' ') item += c;
      }
      out[k.key] = items;
    } else if (type == "bool") {
      out[k.key] = v == "true";
    } else if (type == "int") {
      out[k.key] = std::stoll(v);
    } else {
      out[k.key] = v;
    }
  }
  return out;
}

}  // namespace eo
