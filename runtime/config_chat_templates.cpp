// chat_template values (runtime/config_chat_templates.h).
#include "runtime/config_chat_templates.h"

#include <algorithm>
#include <map>

#include "common/text.h"

namespace eo::config_detail {
namespace {

// chat_template values: eo-ddp's own, and axolotl's named templates, every one eo-ddp ships in
// tools/chat_templates (copied from axolotl; rendered on any model as axolotl does). The families
// a template is the own template of, for note_named_template.
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

}  // namespace

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

}  // namespace eo::config_detail
