// The names people bring from transformers' Trainer, TRL / Unsloth and peft for keys that eo-ddp
// (and axolotl) spell differently: one table, read by the config loader's "unknown key" message
// and by `eo-ddp --help-config KEY`.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace eo {

struct KeyAlias {
  const char* foreign;  // as another tool spells it
  const char* key;      // eo-ddp's (and axolotl's) key
  const char* from;     // where the foreign name comes from
};

const std::vector<KeyAlias>& key_aliases();
// The alias of `foreign` (exact, else ignoring case), if it has one.
std::optional<KeyAlias> key_alias(const std::string& foreign);
// "'lr' is spelled 'learning_rate' here (transformers' TrainingArguments)".
std::string spelled_here(const KeyAlias& alias);

}  // namespace eo
