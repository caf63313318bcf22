// The card table: one row per card. Rates are the vendors' dense (no sparsity) tensor figures with
// fp32 accumulation: GeForce cards run that at half their fp16-accumulate rate. The T4 has no bf16:
// its row is fp16, the dtype it trains in. link_gbps is what pinned copies reach, not the bus's
// nominal rate: 55 GB/s measured on the H100 and H200 (PCIe 5.0 x16, docs/benchmarks.md); PCIe 4.0
// x16 taken as 24, PCIe 3.0 x16 as 12, PCIe 5.0 x16 on a desktop as 56.
#include "runtime/cards.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <map>

#include "common/error.h"
#include "common/text.h"

namespace eo {

namespace {

const std::vector<CardFigures> kCards = {
    // name    VRAM GiB  bf16 TFLOP/s  memory GB/s  link GB/s  what
    {"t4", 15, 65, 320, 12, "Tesla T4 16 GB (fp16: no bf16), PCIe 3.0 x16", /*flash_attention=*/false},
    {"a2000", 12, 31.9, 288, 24, "RTX A2000 12 GB, PCIe 4.0 x16"},
    {"3090", 24, 71, 936, 24, "GeForce RTX 3090, PCIe 4.0 x16"},
    {"4090", 24, 165.2, 1008, 24, "GeForce RTX 4090, PCIe 4.0 x16"},
    {"5090", 32, 209.5, 1792, 56, "GeForce RTX 5090, PCIe 5.0 x16"},
    {"a100", 80, 312, 2039, 24, "A100 80 GB SXM, PCIe 4.0 x16"},
    {"h100", 79.6, 989.4, 3350, 55, "H100 80 GB HBM3 SXM, PCIe 5.0 x16"},
    {"h200", 140.4, 989.4, 4800, 55, "H200 141 GB SXM, PCIe 5.0 x16"},
};

std::string lower(std::string s) {
  for (char& ch : s) ch = char(std::tolower(static_cast<unsigned char>(ch)));
  return s;
}

}  // namespace

const std::vector<CardFigures>& known_cards() { return kCards; }

std::string known_card_names() {
  std::vector<std::string> names;
  for (const auto& c : kCards) names.push_back(c.name);
  return join(names, ", ");
}

CardFigures find_card(const std::string& name, const std::string& flag) {
  for (const auto& c : kCards)
    if (lower(name) == c.name) return c;
  throw UsageError(flag + ": unknown card '" + name + "'; known cards: " + known_card_names() +
                   " (or give an unlisted card's figures: --card-figures bf16_tflops=..,mem_gbps=..,link_gbps=..,vram_gib=..)");
}

CardFigures card_from_figures(const std::string& text, const std::string& flag) {
  const std::string form = "expected bf16_tflops=N,mem_gbps=N,link_gbps=N,vram_gib=N (e.g. bf16_tflops=165,mem_gbps=1008,link_gbps=24,vram_gib=24)";
  std::map<std::string, double*> keys;
  CardFigures c;
  c.name = "given figures";
  keys["bf16_tflops"] = &c.bf16_tflops;
  keys["mem_gbps"] = &c.mem_gbps;
  keys["link_gbps"] = &c.link_gbps;
  keys["vram_gib"] = &c.vram_gib;
  std::map<std::string, bool> seen;
  std::size_t begin = 0;
  while (begin <= text.size()) {
    const std::size_t end = std::min(text.find(',', begin), text.size());
    const std::string item = text.substr(begin, end - begin);
    begin = end + 1;
    if (item.empty()) continue;
    const std::size_t eq = item.find('=');
    const std::string key = item.substr(0, eq);
    const auto k = keys.find(key);
    if (eq == std::string::npos || k == keys.end())
      throw UsageError(flag + ": unknown key '" + key + "'; " + form);
    if (seen[key]) throw UsageError(flag + ": " + key + " given twice; " + form);
    seen[key] = true;
    const std::string value = item.substr(eq + 1);
    double v = 0;
    std::size_t used = 0;
    try {
      v = std::stod(value, &used);
    } catch (...) {
      used = 0;
    }
    if (used == 0 || used != value.size() || !std::isfinite(v) || v <= 0)
      throw UsageError(flag + ": " + key + " must be a positive number, got '" + value + "'; " + form);
    *k->second = v;
  }
  std::vector<std::string> missing;
  for (const auto& [key, value] : keys)
    if (!seen[key]) missing.push_back(key);
  if (!missing.empty()) throw UsageError(flag + ": missing " + join(missing, ", ") + "; " + form);
  char what[160];
  std::snprintf(what, sizeof what, "%g TFLOP/s, %g GB/s memory, %g GB/s link", c.bf16_tflops, c.mem_gbps, c.link_gbps);
  c.what = what;
  return c;
}

std::string card_memory(const CardFigures& card) {
  char s[32];
  std::snprintf(s, sizeof s, "%gGiB", card.vram_gib);
  return s;
}

}  // namespace eo
