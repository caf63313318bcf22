// The Hugging Face cache lookup and the download through huggingface_hub. See hub.h.
#include "runtime/hub.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>

#include "common/error.h"
#include "common/files.h"
#include "common/log.h"
#include "runtime/data/prepare.h"

namespace eo::hub {
namespace {

namespace fs = std::filesystem;

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

std::string folder_of(Repo repo, const std::string& id) {
  std::string name = id;
  for (std::size_t at; (at = name.find('/')) != std::string::npos;) name.replace(at, 1, "--");
  return cache_dir() + "/" + (repo == Repo::Model ? "models--" : "datasets--") + name;
}

bool is_commit_hash(const std::string& s) {
  return s.size() == 40 && std::all_of(s.begin(), s.end(), [](char c) { return std::isxdigit(static_cast<unsigned char>(c)); });
}

// Whether a model snapshot holds what `need` asks: config.json, and for training the weights (every
// shard its index lists) and a tokenizer.
bool complete(const fs::path& snap, Need need) {
  std::error_code ec;
  if (!fs::is_regular_file(snap / "config.json", ec)) return false;
  if (need == Need::Config) return true;
  if (!fs::is_regular_file(snap / "tokenizer.json", ec) && !fs::is_regular_file(snap / "tokenizer_config.json", ec))
    return false;
  const fs::path index = snap / "model.safetensors.index.json";
  if (fs::is_regular_file(index, ec)) {
    std::string text;
    std::ifstream in(index);
    text.assign(std::istreambuf_iterator<char>(in), {});
    const auto j = nlohmann::json::parse(text, nullptr, false);
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object()) return false;
    for (const auto& [name, file] : j["weight_map"].items())
      if (!file.is_string() || !fs::is_regular_file(snap / file.get<std::string>(), ec)) return false;
    return true;
  }
  return fs::is_regular_file(snap / "model.safetensors", ec);
}

// The command a user runs to fill the cache themselves.
std::string download_command(Repo repo, const std::string& id, const std::string& revision) {
  std::string args = (repo == Repo::Dataset ? " --repo-type dataset " : " ") + id;
  if (!revision.empty()) args += " --revision " + revision;
  return "`hf download" + args + "` (older huggingface_hub: `huggingface-cli download" + args + "`)";
}

// snapshot_download of the files eo-ddp reads, in tools/hub_download.py; the snapshot folder.
Resolution download(Repo repo, const std::string& id, const std::string& revision, Need need, const std::string& key) {
  log::info(key + ": downloading " + id + (revision.empty() ? "" : " at " + revision) + " from the Hugging Face Hub into " +
            cache_dir() + " (huggingface_hub)");
  const std::string out = fs::temp_directory_path().string() + "/eo-ddp-hub-" + std::to_string(::getpid()) + ".out";
  std::string error_line;
  const std::vector<std::string> argv = {data::find_python(), data::find_tool("hub_download.py"),
                                         repo == Repo::Model ? "model" : "dataset", id, revision,
                                         need == Need::Config ? "config" : "all"};
  int rc = 0;
  try {
    rc = data::run_tool(argv, out, error_line, "while downloading from the Hugging Face Hub");
  } catch (...) {
    fs::remove(out);
    throw;
  }
  std::string text;
  read_file_nofollow(out, text);
  fs::remove(out);
  while (!text.empty() && (text.back() == '\n' || text.back() == '\r')) text.pop_back();
  const std::string path = text.substr(text.rfind('\n') == std::string::npos ? 0 : text.rfind('\n') + 1);
  if (rc == 0 && fs::is_directory(path)) return {path, ""};
  if (rc == 2 && !error_line.empty())
    return {"", "'" + id + "' is not a local path, and " + error_line.substr(error_line.find("error:") + 7)};
  return {"", "'" + id + "' is not a local path and downloading it failed (" + argv[0] + " " + argv[1] + " exited with " +
                  std::to_string(rc) + "; its messages are above; does " + argv[0] +
                  " have huggingface_hub? set EO_DDP_PYTHON to choose the interpreter); or download it yourself: " +
                  download_command(repo, id, revision)};
}

// A data file of a dataset repository, as datasets reads them (metadata files aside).
bool is_data_file(const fs::path& p) {
  static const std::set<std::string> metadata = {"dataset_info.json", "dataset_infos.json", "dataset_dict.json", "state.json"};
  const std::string ext = p.extension().string();
  return (ext == ".jsonl" || ext == ".json" || ext == ".parquet") && !metadata.count(p.filename().string());
}

}  // namespace

std::string cache_dir() {
  if (const std::string v = env("HF_HUB_CACHE"); !v.empty()) return v;
  if (const std::string v = env("HUGGINGFACE_HUB_CACHE"); !v.empty()) return v;
  if (const std::string v = env("HF_HOME"); !v.empty()) return v + "/hub";
  if (const std::string v = env("XDG_CACHE_HOME"); !v.empty()) return v + "/huggingface/hub";
  return env("HOME") + "/.cache/huggingface/hub";
}

bool offline() {
  for (const char* name : {"HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"}) {
    std::string v = env(name);
    if (v.empty()) continue;  // huggingface_hub reads the first one that is set
    for (auto& c : v) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    return v == "1" || v == "ON" || v == "YES" || v == "TRUE";
  }
  return false;
}

bool is_repo_id(const std::string& s) {
  static const std::regex id(R"(^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$)");
  static const std::regex data_file(R"(\.(jsonl|json|parquet|arrow|csv|txt|bin|safetensors)$)");
  if (s.size() > 96 || !std::regex_match(s, id) || s.find("..") != std::string::npos || std::regex_search(s, data_file))
    return false;
  // fixtures/tiny-model where ./fixtures exists is a local path that is missing, not a Hub name.
  std::error_code ec;
  return !fs::exists(s.substr(0, s.find('/')), ec);
}

std::optional<std::string> cached_snapshot(Repo repo, const std::string& id, const std::string& revision) {
  const fs::path root = folder_of(repo, id);
  const std::string rev = revision.empty() ? "main" : revision;
  std::string hash;
  std::ifstream ref(root / "refs" / rev);
  if (ref) std::getline(ref, hash);
  else if (is_commit_hash(rev)) hash = rev;
  std::error_code ec;
  if (hash.empty() || !fs::is_directory(root / "snapshots" / hash, ec)) return std::nullopt;
  return (root / "snapshots" / hash).string();
}

Resolution resolve(Repo repo, const std::string& name, const std::string& revision, Need need, bool may_download,
                   const std::string& key) {
  std::error_code ec;
  if (fs::exists(name, ec) || !is_repo_id(name)) return {name, ""};  // a local path: the config's checks judge it
  const auto snap = cached_snapshot(repo, name, revision);
  if (snap && (repo == Repo::Dataset || complete(*snap, need))) {
    log::info(key + ": " + name + (revision.empty() ? "" : " at " + revision) + " from the Hugging Face cache: " + *snap);
    return {*snap, ""};
  }
  const std::string where = folder_of(repo, name);
  const std::string missing = snap ? "its snapshot " + *snap + " lacks files eo-ddp reads"
                                   : "not in the Hugging Face cache (searched " + where + "/refs/" +
                                         (revision.empty() ? "main" : revision) + " and " + where + "/snapshots/; the cache is " +
                                         cache_dir() + ": HF_HUB_CACHE, else HF_HOME/hub)";
  if (offline())
    return {"", "'" + name + "' is not a local path (resolved against " + fs::current_path(ec).string() + ") and " + missing +
                    "; HF_HUB_OFFLINE is set, so eo-ddp does not download it: run " +
                    download_command(repo, name, revision) + " where the Hub can be reached, then run eo-ddp again"};
  if (!may_download) return {"", ""};
  return download(repo, name, revision, need, key);
}

std::vector<std::string> dataset_files(const std::string& snapshot, const std::vector<std::string>& data_files) {
  std::vector<std::string> out;
  std::error_code ec;
  if (!data_files.empty()) {
    for (const auto& f : data_files) out.push_back((fs::path(snapshot) / f).string());
    return out;
  }
  // datasets' default split names: a path whose words include train / training is the train
  // split's; when some file names a split, only the train split's files are read.
  static const std::regex train(R"((^|[-._ 0-9/])(train|training)([-._ 0-9/]|$))");
  static const std::regex split(R"((^|[-._ 0-9/])(train|training|validation|valid|dev|val|test|testing|eval|evaluation)([-._ 0-9/]|$))");
  std::vector<std::string> all, trains;
  bool named = false;
  for (auto it = fs::recursive_directory_iterator(snapshot, ec); !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
    // Lexically: a snapshot's files are links into blobs/, which fs::relative would follow.
    const fs::path rel = it->path().lexically_relative(snapshot);
    if (rel.empty() || rel.string()[0] == '.' || !is_data_file(it->path()) || !fs::is_regular_file(it->path(), ec)) continue;
    all.push_back(it->path().string());
    named |= std::regex_search(rel.string(), split);
    if (std::regex_search(rel.string(), train)) trains.push_back(it->path().string());
  }
  out = named ? trains : all;
  std::sort(out.begin(), out.end());
  return out;
}

void resolve_config(TrainConfig& cfg, Need need, bool may_download, std::vector<std::pair<std::string, std::string>>& problems) {
  const Need model_need = cfg.synthetic_weights ? Need::Config : need;
  auto model = [&](std::string& value, std::string& hub_name, const std::string& revision, Need n, const std::string& key) {
    if (value.empty() || !hub_name.empty()) return;
    const Resolution r = resolve(Repo::Model, value, revision, n, may_download, key);
    if (!r.problem.empty()) {
      problems.emplace_back(key, r.problem);
      return;
    }
    if (r.path.empty() || r.path == value) return;
    hub_name = value;
    value = r.path;
  };
  model(cfg.base_model, cfg.base_model_hub, cfg.base_model_revision, model_need, "base_model");
  std::string tokenizer_hub;
  model(cfg.tokenizer_config, tokenizer_hub, cfg.base_model_revision, Need::Config, "tokenizer_config");
  if (need == Need::Config) return;  // eo-ddp plan reads no data
  for (auto* list : {&cfg.datasets, &cfg.test_datasets})
    for (std::size_t i = 0; i < list->size(); ++i) {
      DatasetSpec& d = (*list)[i];
      const std::string key = std::string(list == &cfg.datasets ? "datasets." : "test_datasets.") + std::to_string(i) + ".path";
      if (!d.hub_name.empty()) continue;
      const Resolution r = resolve(Repo::Dataset, d.path, d.revision, need, may_download, key);
      if (!r.problem.empty()) {
        problems.emplace_back(key, r.problem);
        continue;
      }
      std::error_code ec;
      if (r.path.empty() || r.path == d.path) {
        if (fs::is_directory(d.path, ec) && d.formatted()) d.files = dataset_files(d.path, d.data_files);  // a local dataset folder
        continue;
      }
      d.hub_name = d.path;
      d.files = dataset_files(r.path, d.data_files);
      if (d.files.empty())
        problems.emplace_back(key, "the Hub dataset " + d.path + " (" + r.path + ") holds no .jsonl, .json or .parquet data "
                                   "file; name them with data_files");
      for (const auto& f : d.files)
        if (!fs::is_regular_file(f, ec)) problems.emplace_back(key, "data file " + f + " is not in the snapshot " + r.path);
      if (!d.formatted() && d.files.size() != 1)
        problems.emplace_back(key, "a pre-tokenized dataset (type " + d.type + ") is read from one file, but " + d.path +
                                   " has " + std::to_string(d.files.size()) + "; name it with data_files");
      else if (!d.formatted()) d.path = d.files.front();
    }
}

std::string adapter_base_name(const TrainConfig& cfg) {
  if (!cfg.base_model_hub.empty()) return cfg.base_model_hub;
  std::error_code ec;
  const fs::path abs = fs::absolute(cfg.base_model, ec);
  return ec ? cfg.base_model : abs.lexically_normal().string();
}

}  // namespace eo::hub
