// axolotl's older dataset forms, which configs in users' hands still use, rewritten into the
// current forms before a datasets entry is read, each change noted once in the log:
//   type: sharegpt (sharegpt:chat, sharegpt.load_role, sharegpt.load_guanaco), with conversation:
//     a FastChat template name, field_human / field_model  ->  type: chat_template with
//     field_messages: conversations, message_property_mappings {role: from, content: value} and
//     the named template, as axolotl's migration guide writes it;
//   path: json (or parquet) with data_files: FILE  ->  path: FILE;
//   no type (or type: with no value)  ->  type: tokenized, as axolotl reads such rows.
#pragma once

#include <yaml-cpp/yaml.h>

#include <string>
#include <utility>
#include <vector>

namespace eo {

// The entry `d` (at `where`, e.g. datasets.0) in its current form (a copy; `d` itself when nothing
// is old). Notes go to `notes`; what cannot be rewritten to `problems` as (key, message).
YAML::Node upgrade_legacy_dataset(const YAML::Node& d, const std::string& where, std::vector<std::string>& notes,
                                  std::vector<std::pair<std::string, std::string>>& problems);

}  // namespace eo
