// The older axolotl dataset forms. See datasets_legacy.h.
#include "runtime/datasets_legacy.h"

#include <map>

#include "runtime/yaml_values.h"

namespace eo {
namespace {

// FastChat's conversation names (axolotl's sharegpt `conversation:`), as axolotl's named chat
// templates: the ones whose turns those templates write.
const std::map<std::string, std::string>& fastchat_templates() {
  static const std::map<std::string, std::string> m = {
      {"chatml", "chatml"}, {"llama3", "llama3"}, {"llama-3", "llama3"}, {"mistral", "mistral_v1"},
      {"gemma", "gemma"},   {"phi3", "phi_3"},    {"cohere", "cohere"}};
  return m;
}

std::string names(const std::map<std::string, std::string>& m) {
  std::string s;
  for (const auto& [k, v] : m) s += (s.empty() ? "" : ", ") + k;
  return s;
}

}  // namespace

YAML::Node upgrade_legacy_dataset(const YAML::Node& d, const std::string& where, std::vector<std::string>& notes,
                                  std::vector<std::pair<std::string, std::string>>& problems) {
  if (!d.IsMap()) return d;
  const std::string type = scalar_or_empty(d["type"]);
  const bool sharegpt = type.rfind("sharegpt", 0) == 0;
  const std::string path = scalar_or_empty(d["path"]);
  const bool loader_path = (path == "json" || path == "parquet") && d["data_files"].IsDefined();
  const bool untyped = !d["type"].IsDefined() || d["type"].IsNull();
  if (!sharegpt && !loader_path && !untyped) return d;
  YAML::Node out = YAML::Clone(d);
  if (untyped) {
    // axolotl takes a dataset without a type as already tokenized (input_ids, attention_mask,
    // labels), used as is; any other rows are its "unhandled prompt tokenization strategy" error.
    out["type"] = "tokenized";
    notes.push_back(where + ": no type: read as pre-tokenized rows (input_ids, labels), as axolotl reads a dataset "
                            "without a type; written today as type: tokenized");
  }
  if (loader_path) {
    // axolotl before 0.5: path names the datasets loader, data_files the local file(s).
    const YAML::Node files = d["data_files"];
    if (files.IsScalar() || (files.IsSequence() && files.size() == 1)) {
      const std::string file = files.IsScalar() ? files.Scalar() : scalar_or_empty(files[0]);
      out["path"] = file;
      out.remove("data_files");
      if (!out["ds_type"].IsDefined()) out["ds_type"] = path;
      notes.push_back(where + ": path: " + path + " with data_files: " + file + " became path: " + file);
    } else {
      problems.emplace_back(where + ".data_files", "path: " + path + " with several data_files: give one dataset entry per "
                                                   "local file (path: FILE)");
    }
  }
  if (!sharegpt) return out;
  static const std::map<std::string, std::string> role_field = {
      {"sharegpt", "from"}, {"sharegpt:chat", "from"}, {"sharegpt.load_role", "role"}, {"sharegpt.load_guanaco", "from"}};
  const auto variant = role_field.find(type);
  if (variant == role_field.end()) {
    problems.emplace_back(where + ".type", "'" + type + "': axolotl's older sharegpt forms eo-ddp converts are sharegpt, "
                                           "sharegpt:chat, sharegpt.load_role and sharegpt.load_guanaco; write this one "
                                           "as type: chat_template with its field mapping");
    return out;
  }
  std::string change = "type: chat_template";
  out["type"] = "chat_template";
  if (!out["field_messages"].IsDefined()) {
    out["field_messages"] = "conversations";
    change += ", field_messages: conversations";
  }
  if (!out["message_property_mappings"].IsDefined() && !out["message_field_role"].IsDefined() &&
      !out["message_field_content"].IsDefined()) {
    out["message_property_mappings"]["role"] = variant->second;
    out["message_property_mappings"]["content"] = "value";
    change += ", message_property_mappings: {role: " + variant->second + ", content: value}";
  }
  // The legacy roles: human (or field_human) is the user, gpt (or field_model) the assistant.
  const std::string human = scalar_or_empty(d["field_human"]), model = scalar_or_empty(d["field_model"]);
  if (!human.empty() || !model.empty() || type == "sharegpt.load_guanaco") {
    if (d["roles"].IsDefined()) {
      problems.emplace_back(where + ".roles", "give either roles or field_human / field_model");
    } else {
      YAML::Node roles;
      roles["user"].push_back(!human.empty() ? human : type == "sharegpt.load_guanaco" ? "prompter" : "human");
      roles["assistant"].push_back(!model.empty() ? model : type == "sharegpt.load_guanaco" ? "assistant" : "gpt");
      roles["system"].push_back("system");
      out["roles"] = roles;
      change += ", roles: {user: [" + scalar_or_empty(roles["user"][0]) + "], assistant: [" + scalar_or_empty(roles["assistant"][0]) +
                "], system: [system]}";
    }
  }
  out.remove("field_human");
  out.remove("field_model");
  if (d["roles"].IsDefined() && d["roles"].IsMap() && (d["roles"]["input"].IsDefined() || d["roles"]["output"].IsDefined()))
    problems.emplace_back(where + ".roles", "sharegpt's roles: {input, output} are not converted: with type: chat_template, "
                                            "map the data's roles with roles: {user: [...], assistant: [...]} and choose "
                                            "the trained ones with roles_to_train");
  if (d["conversation"].IsDefined() && !d["conversation"].IsNull()) {
    const std::string conv = scalar_or_empty(d["conversation"]);
    const auto it = fastchat_templates().find(conv);
    if (it == fastchat_templates().end()) {
      problems.emplace_back(where + ".conversation", "'" + conv + "': the FastChat templates eo-ddp converts are " +
                                                         names(fastchat_templates()) +
                                                         " (to axolotl's named templates); set chat_template on the "
                                                         "dataset (tokenizer_default, a named template, or jinja)");
    } else if (!out["chat_template"].IsDefined()) {
      out["chat_template"] = it->second;
      change += ", chat_template: " + it->second + " (from conversation: " + conv + ")";
    }
    out.remove("conversation");
  }
  if (out["strict"].IsDefined()) out.remove("strict");
  notes.push_back(where + ": type: " + type + " (axolotl's removed sharegpt loader) became " + change +
                  ", as axolotl's migration guide writes it");
  return out;
}

}  // namespace eo
