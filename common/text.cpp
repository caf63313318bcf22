#include "common/text.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>

namespace eo {

namespace {
// Damerau-Levenshtein (optimal string alignment): a swapped pair of letters is one edit, which is
// the commonest typo in long keys ("offlaod"). Stops as soon as every alignment is past `bound`
// (then returns bound + 1): closest_match asks only whether a candidate beats the best so far,
// and a config can hold a thousand unknown keys against hundreds of candidates.
std::size_t bounded_edit_distance(const std::string& a, const std::string& b, std::size_t bound) {
  const std::size_t n = a.size(), m = b.size();
  const std::size_t gap = n > m ? n - m : m - n;
  if (gap > bound) return bound + 1;
  // Three rolling rows (the transposition looks two rows back).
  std::vector<std::size_t> rows(3 * (m + 1));
  std::size_t* two_back = rows.data();
  std::size_t* prev = two_back + (m + 1);
  std::size_t* cur = prev + (m + 1);
  for (std::size_t j = 0; j <= m; ++j) prev[j] = j;
  std::size_t prev_min = 0;
  for (std::size_t i = 1; i <= n; ++i) {
    cur[0] = i;
    std::size_t row_min = cur[0];
    for (std::size_t j = 1; j <= m; ++j) {
      const std::size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) cur[j] = std::min(cur[j], two_back[j - 2] + 1);
      row_min = std::min(row_min, cur[j]);
    }
    // A later cell costs at least this row's minimum, or the previous row's plus one (a
    // transposition reaches back two rows): once both are past the bound, so is the answer.
    if (row_min > bound && prev_min + 1 > bound) return bound + 1;
    prev_min = row_min;
    std::swap(two_back, prev);
    std::swap(prev, cur);
  }
  return std::min(prev[m], bound + 1);
}
}  // namespace

std::size_t edit_distance(const std::string& a, const std::string& b) {
  return bounded_edit_distance(a, b, std::max(a.size(), b.size()));
}

std::optional<std::string> closest_match(const std::string& word, const std::vector<std::string>& candidates) {
  // Accept up to a third of the word's length in edits (at least 2).
  const std::size_t limit = std::max<std::size_t>(2, word.size() / 3);
  std::optional<std::string> best;
  std::size_t best_d = limit + 1;
  for (const auto& c : candidates) {
    // Only a candidate strictly better than the best so far matters (the first best wins ties).
    if (best_d == 0) break;
    const std::size_t d = bounded_edit_distance(word, c, best_d - 1);
    if (d < best_d) {
      best_d = d;
      best = c;
    }
  }
  return best;
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
