#include "runtime/config_help.h"

#include <sstream>

#include "common/text.h"
#include "runtime/config.h"
#include "runtime/dataset_keys.h"
#include "runtime/key_aliases.h"

namespace eo {

const std::vector<ConfigSection>& config_sections() {
  static const std::vector<ConfigSection> s = {
      {"base_model", "Model and adapter"},
      {"datasets", "Data and tokenisation"},
      {"sequence_len", "Sequences, batch and run length"},
      {"learning_rate", "Optimiser"},
      {"bf16", "Precision and checkpointing"},
      {"expert_offload", "Memory: expert offload, kernels, limits"},
      {"ddp_bucket_cap_mb", "Multi-GPU"},
      {"output_dir", "Outputs and saving"},
      {"val_set_size", "Evaluation"},
      {"lora_model_dir", "Starting from an adapter or a checkpoint"},
  };
  return s;
}

std::string wrap(const std::string& text, const std::string& indent, int width) {
  std::ostringstream os;
  std::istringstream words(text);
  std::string word, line = indent;
  const std::size_t limit = static_cast<std::size_t>(width);
  while (words >> word) {
    if (line.size() > indent.size() && line.size() + 1 + word.size() > limit) {
      os << line << "\n";
      line = indent;
    }
    // A word longer than the line (a long path or regex) is cut rather than overflowing it.
    while (line.size() + word.size() > limit && line.size() == indent.size() && limit > indent.size()) {
      os << line << word.substr(0, limit - indent.size()) << "\n";
      word = word.substr(limit - indent.size());
    }
    line += (line.size() > indent.size() ? " " : "") + word;
  }
  if (line.size() > indent.size()) os << line << "\n";
  return os.str();
}

namespace {

// "  key  (type; default X)" on one line (the type and default below it when too long), then the
// description indented under it.
std::string entry(const ConfigKeyDoc& d, int width) {
  const std::string kind = "(" + d.type + "; default " + d.default_text + ")";
  std::string head = "  " + d.key + "  " + kind + "\n";
  if (head.size() > static_cast<std::size_t>(width) + 1) head = "  " + d.key + "\n" + wrap(kind, "      ", width);
  return head + wrap(d.doc, "      ", width);
}

}  // namespace

std::string config_reference_text(int width) {
  std::ostringstream os;
  os << wrap("eo-ddp's config keys (YAML, as axolotl names them; --set key=value overrides one). One key: eo-ddp "
             "--help-config KEY. The table as markdown: eo-ddp --help-config --markdown. axolotl's other keys: eo-ddp "
             "--help-axolotl-keys. Relative paths in a config file are relative to the file's folder; given with --set, to "
             "the current folder.",
             "", width);
  const auto& sections = config_sections();
  for (const auto& d : config_key_docs()) {
    for (const auto& s : sections)
      if (d.key == s.first_key) os << "\n" << s.title << "\n";
    os << entry(d, width);
  }
  os << "\nKeys of each datasets / test_datasets entry (eo-ddp --help-config datasets[].KEY)\n";
  for (const auto& d : dataset_key_docs()) os << entry(d, width);
  return os.str();
}

KeyHelp config_key_help(const std::string& key, int width) {
  auto docs = config_key_docs();
  for (auto& d : dataset_key_docs()) docs.push_back(std::move(d));
  for (const auto& d : docs)
    if (d.key == key) return {true, entry(d, width)};
  if (const auto alias = key_alias(key)) {
    for (const auto& d : docs)
      if (d.key == alias->key) return {true, wrap(spelled_here(*alias) + ":", "", width) + entry(d, width)};
  }
  for (const auto& a : axolotl_keys())
    if (a.key == key)
      return {true, wrap(key + "  (axolotl's key; " + a.cls + ")", "  ", width) +
                        wrap(a.text.empty() ? "read as axolotl does" : a.text, "      ", width)};
  std::vector<std::string> names;
  for (const auto& d : docs) names.push_back(d.key);
  std::string msg = "unknown config key '" + key + "'";
  if (const auto m = closest_match(key, names)) msg += "; did you mean '" + *m + "'?";
  return {false, wrap(msg + " (eo-ddp --help-config lists every key)", "", width)};
}

}  // namespace eo
