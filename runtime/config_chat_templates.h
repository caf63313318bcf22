// chat_template values, top-level or a datasets entry's: eo-ddp's own (tokenizer_default,
// tokenizer_default_fallback_chatml, jinja) and axolotl's named templates, every one eo-ddp ships in
// tools/chat_templates.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "models/hf_config.h"

namespace eo::config_detail {

// What is wrong with chat_template value V, or nothing.
std::optional<std::string> template_problem(const std::string& v);

// A named template eo-ddp ships renders on any model as in axolotl; on another family's model a
// note (to `warnings`, naming `key`), since this tokenizer may split the template's special tokens
// into pieces.
void note_named_template(const std::string& value, const std::string& key, const model::ModelConfig& mc,
                         std::vector<std::string>& warnings);

}  // namespace eo::config_detail
