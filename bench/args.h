// The bench programs' command line: `--key value` pairs and comma lists (empty items dropped).
#pragma once

#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

namespace eo::bench {

inline std::string arg(int argc, char** argv, const std::string& key, const std::string& fallback) {
  for (int i = 1; i + 1 < argc; ++i)
    if (argv[i] == key) return argv[i + 1];
  return fallback;
}

// Whether a bare `--key` (a switch without a value) is on the command line.
inline bool flag(int argc, char** argv, const std::string& key) {
  for (int i = 1; i < argc; ++i)
    if (argv[i] == key) return true;
  return false;
}

inline std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, sep))
    if (!item.empty()) out.push_back(item);
  return out;
}

inline std::vector<std::int64_t> int_list(const std::string& s) {
  std::vector<std::int64_t> out;
  for (const std::string& item : split(s, ',')) out.push_back(std::stoll(item));
  return out;
}

}  // namespace eo::bench
