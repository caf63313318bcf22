#include "common/text.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>

namespace eo {

std::size_t edit_distance(const std::string& a, const std::string& b) {
  // Damerau-Levenshtein (optimal string alignment): a swapped pair of letters is one edit,
  // which is the commonest typo in long keys ("offlaod").
  const std::size_t n = a.size(), m = b.size();
  std::vector<std::vector<std::size_t>> d(n + 1, std::vector<std::size_t>(m + 1));
  for (std::size_t i = 0; i <= n; ++i) d[i][0] = i;
  for (std::size_t j = 0; j <= m; ++j) d[0][j] = j;
  for (std::size_t i = 1; i <= n; ++i) {
    for (std::size_t j = 1; j <= m; ++j) {
      const std::size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1])
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  }
  return d[n][m];
}

std::optional<std::string> closest_match(const std::string& word, const std::vector<std::string>& candidates) {
  // Accept up to a third of the word's length in edits (at least 2).
  const std::size_t limit = std::max<std::size_t>(2, word.size() / 3);
  std::optional<std::string> best;
  std::size_t best_d = SIZE_MAX;
  for (const auto& c : candidates) {
    // The distance is at least the length difference: skip what could not be accepted anyway
    // (keeps a config with many long unknown keys from taking quadratic time per key).
    const std::size_t gap = word.size() > c.size() ? word.size() - c.size() : c.size() - word.size();
    if (gap > limit) continue;
    const std::size_t d = edit_distance(word, c);
    if (d < best_d) {
      best_d = d;
      best = c;
    }
  }
  if (best && best_d <= limit) return best;
  return std::nullopt;
}

std::string human_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (std::fabs(bytes) >= 1024.0 && u < 4) {
    bytes /= 1024.0;
    ++u;
  }
  char buf[64];
  if (u == 0)
    std::snprintf(buf, sizeof buf, "%.0f B", bytes);
  else
    std::snprintf(buf, sizeof buf, "%.2f %s", bytes, units[u]);
  return buf;
}

std::optional<std::uint64_t> parse_bytes(const std::string& text) {
  std::string s;
  for (char c : text)
    if (!std::isspace(static_cast<unsigned char>(c))) s += c;
  if (s.empty()) return std::nullopt;
  std::size_t pos = 0;
  double value = 0;
  try {
    value = std::stod(s, &pos);
  } catch (...) {
    return std::nullopt;
  }
  if (!(value >= 0) || !std::isfinite(value)) return std::nullopt;
  std::string unit = s.substr(pos);
  std::transform(unit.begin(), unit.end(), unit.begin(), [](unsigned char c) { return std::tolower(c); });
  double mult = 0;
  if (unit.empty() || unit == "b") mult = 1;
  else if (unit == "kb" || unit == "k") mult = 1e3;
  else if (unit == "mb" || unit == "m") mult = 1e6;
  else if (unit == "gb" || unit == "g") mult = 1e9;
  else if (unit == "tb" || unit == "t") mult = 1e12;
  else if (unit == "kib") mult = 1024.0;
  else if (unit == "mib") mult = 1024.0 * 1024;
  else if (unit == "gib") mult = 1024.0 * 1024 * 1024;
  else if (unit == "tib") mult = 1024.0 * 1024 * 1024 * 1024;
  else return std::nullopt;
  const double bytes = value * mult;
  if (bytes > 1.8e19) return std::nullopt;
  return static_cast<std::uint64_t>(std::llround(bytes));
}

std::string join(const std::vector<std::string>& parts, const std::string& sep) {
  std::string out;
  for (std::size_t i = 0; i < parts.size(); ++i) {
    if (i) out += sep;
    out += parts[i];
  }
  return out;
}

}  // namespace eo
