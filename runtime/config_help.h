// `eo-ddp --help-config` for a terminal: the schema's keys grouped by section, each description
// wrapped to the width; `--help-config KEY` for one key (a foreign spelling names eo-ddp's, an
// unknown key gets a "did you mean"). The markdown table stays config_reference_markdown().
#pragma once

#include <string>
#include <vector>

namespace eo {

constexpr int kHelpWidth = 100;  // fits an 80-120 column terminal with room to spare

// Sections in schema order, each named by its first key (a key added to the schema falls in the
// section it is placed in).
struct ConfigSection {
  const char* first_key;
  const char* title;
};
const std::vector<ConfigSection>& config_sections();

std::string config_reference_text(int width = kHelpWidth);

struct KeyHelp {
  bool found = false;
  std::string text;  // the key's entry, or why there is none
};
KeyHelp config_key_help(const std::string& key, int width = kHelpWidth);

// `text` broken at spaces into lines of at most `width` columns, each starting with `indent`.
std::string wrap(const std::string& text, const std::string& indent, int width);

}  // namespace eo
