#include "runtime/rank_agreement.h"

#include <sys/stat.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>

#include <set>
#include <sstream>

#include "common/checksum.h"
#include "common/error.h"
#include "runtime/ddp/world.h"
#include "runtime/model_identity.h"

namespace eo {
namespace {

void flatten(const YAML::Node& n, const std::string& key, std::map<std::string, std::string>& out) {
  if (n.IsMap()) {
    for (const auto& kv : n) flatten(kv.second, (key.empty() ? "" : key + ".") + kv.first.as<std::string>(), out);
  } else if (n.IsSequence()) {
    for (std::size_t i = 0; i < n.size(); ++i) flatten(n[i], key + "." + std::to_string(i), out);
    if (n.size() == 0) out[key] = "[]";
  } else {
    YAML::Emitter e;
    e << YAML::Flow << n;
    out[key] = e.c_str();
  }
}

std::string shown(const std::string& v) { return v.size() > 80 ? v.substr(0, 77) + "..." : v; }

// One line per key, tab-separated; keys and emitted YAML scalars hold no tab or newline once escaped.
std::string encode(const std::map<std::string, std::string>& m) {
  std::string s;
  for (const auto& [k, v] : m) {
    std::string val;
    for (char c : v) val += c == '\n' ? std::string("\\n") : c == '\t' ? std::string("\\t") : std::string(1, c);
    s += k + "\t" + val + "\n";
  }
  return s;
}

std::map<std::string, std::string> decode(const std::string& s) {
  std::map<std::string, std::string> m;
  std::istringstream in(s);
  for (std::string line; std::getline(in, line);) {
    const auto tab = line.find('\t');
    if (tab != std::string::npos) m[line.substr(0, tab)] = line.substr(tab + 1);
  }
  return m;
}

// What a dataset path holds: a file's content hash; a folder's files' names, sizes and hashes;
// the path itself where it names nothing local (a hub dataset id).
std::string dataset_contents(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return path + " (no local file)";
  if (S_ISREG(st.st_mode)) return file_content_hash(path);
  if (!S_ISDIR(st.st_mode)) return path + " (not a file)";
  std::vector<std::filesystem::path> files;
  std::error_code ec;
  for (const auto& e : std::filesystem::recursive_directory_iterator(path, ec))
    if (e.is_regular_file()) files.push_back(e.path());
  std::sort(files.begin(), files.end());
  std::string desc;
  for (const auto& f : files)
    desc += std::filesystem::relative(f, path, ec).string() + " " + file_content_hash(f.string()) + "\n";
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(hash_bytes(desc.data(), desc.size())));
  return std::string("folder ") + hex;
}

}  // namespace

std::map<std::string, std::string> run_identity(const TrainConfig& cfg) {
  std::map<std::string, std::string> out;
  flatten(YAML::Load(config_to_yaml(cfg)), "", out);
  out.erase("base_model");
  out["base model contents"] = base_model_identity(cfg);
  // The data by its contents, as checkpoints record it: two ranks with one path may read
  // different files (a node-local copy), two paths may hold the same data.
  for (const auto* list : {&cfg.datasets, &cfg.test_datasets}) {
    const std::string key = list == &cfg.datasets ? "datasets." : "test_datasets.";
    for (std::size_t i = 0; i < list->size(); ++i) {
      out.erase(key + std::to_string(i) + ".path");
      out[key + std::to_string(i) + " contents"] = dataset_contents((*list)[i].path);
    }
  }
  return out;
}

std::vector<std::string> rank_disagreements(const std::vector<std::map<std::string, std::string>>& per_rank) {
  std::set<std::string> keys;
  for (const auto& m : per_rank)
    for (const auto& kv : m) keys.insert(kv.first);
  std::vector<std::string> out;
  for (const auto& k : keys) {
    auto value = [&](std::size_t r) {
      auto it = per_rank[r].find(k);
      return it == per_rank[r].end() ? std::string("(not set)") : it->second;
    };
    std::string line;
    for (std::size_t r = 1; r < per_rank.size(); ++r)
      if (value(r) != value(0)) line += ", rank " + std::to_string(r) + " has " + shown(value(r));
    if (!line.empty()) out.push_back(k + ": rank 0 has " + shown(value(0)) + line);
  }
  return out;
}

void check_ranks_agree(const TrainConfig& cfg, const ddp::World& world) {
  if (world.size() <= 1) return;
  std::vector<std::map<std::string, std::string>> per_rank;
  for (const auto& s : world.allgather(encode(run_identity(cfg)))) per_rank.push_back(decode(s));
  const auto diff = rank_disagreements(per_rank);
  if (diff.empty()) return;
  std::string msg = "the ranks of this job were given different runs (" + std::to_string(diff.size()) +
                    " key(s) differ); every rank must get the same config and base model:";
  for (const auto& d : diff) msg += "\n  " + d;
  msg += "\nGive every rank the same --config and --set arguments (and the same base_model contents).";
  throw UsageError(msg);
}

}  // namespace eo
