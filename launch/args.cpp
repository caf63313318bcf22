#include "common/error.h"
#include "common/text.h"
#include "launch/commands.h"

namespace eo::launch {

bool ArgReader::flag(const std::string& name) {
  bool found = false;
  for (std::size_t i = 0; i < args_.size(); ++i)
    if (!used_[i] && args_[i] == name) used_[i] = found = true;
  return found;
}

std::vector<std::string> ArgReader::values(const std::string& name) {
  std::vector<std::string> out;
  for (std::size_t i = 0; i < args_.size(); ++i) {
    if (used_[i]) continue;
    if (args_[i] == name) {
      if (i + 1 >= args_.size()) throw UsageError(name + " needs a value");
      used_[i] = used_[i + 1] = true;
      out.push_back(args_[i + 1]);
      ++i;
    } else if (args_[i].rfind(name + "=", 0) == 0) {
      used_[i] = true;
      out.push_back(args_[i].substr(name.size() + 1));
    }
  }
  return out;
}

std::string ArgReader::value(const std::string& name, const std::string& fallback) {
  auto v = values(name);
  if (v.size() > 1) throw UsageError(name + " given " + std::to_string(v.size()) + " times");
  return v.empty() ? fallback : v[0];
}

bool ArgReader::has_value(const std::string& name) {
  for (std::size_t i = 0; i < args_.size(); ++i)
    if (!used_[i] && (args_[i] == name || args_[i].rfind(name + "=", 0) == 0)) return true;
  return false;
}

void ArgReader::finish(const std::string& command) const {
  std::vector<std::string> extra;
  for (std::size_t i = 0; i < args_.size(); ++i)
    if (!used_[i]) extra.push_back(args_[i]);
  if (!extra.empty())
    throw UsageError("unexpected argument(s) for '" + command + "': " + join(extra, " ") + " (see eo-ddp --help)");
}

}  // namespace eo::launch
