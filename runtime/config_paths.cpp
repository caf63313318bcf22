#include "runtime/config_paths.h"

#include <filesystem>
#include <functional>

#include "runtime/config.h"

namespace eo {
namespace fs = std::filesystem;

namespace {

fs::path current_folder() {
  std::error_code ec;
  fs::path p = fs::current_path(ec);
  return ec ? fs::path(".") : p;
}

bool found(const fs::path& p) {
  std::error_code ec;
  return fs::exists(p, ec);
}

}  // namespace

void resolve_config_paths(TrainConfig& cfg, const std::string& config_dir, const std::set<std::string>& written,
                          const std::vector<std::string>& overrides) {
  if (config_dir.empty()) return;
  const fs::path dir = fs::absolute(config_dir).lexically_normal();
  const fs::path here = current_folder();
  std::error_code ec;
  if (fs::equivalent(dir, here, ec)) return;  // both rules agree
  auto on_command_line = [&](const std::string& key) {
    for (const auto& o : overrides) {
      const std::string k = o.substr(0, o.find('='));
      if (k == key || key.rfind(k + ".", 0) == 0) return true;
    }
    return false;
  };
  auto resolve = [&](const std::string& key, std::string& value, bool input) {
    const std::string top = key.substr(0, key.find('.'));
    if (value.empty() || fs::path(value).is_absolute() || !written.count(top) || on_command_line(key)) return;
    const fs::path beside = (dir / value).lexically_normal();
    if (!input || found(beside)) {
      value = beside.string();
    } else if (found(here / value)) {
      cfg.warnings.push_back(key + ": '" + value + "' is not under the config's folder " + dir.string() +
                             "; using it from the current folder " + here.string() +
                             " (relative paths in a config are relative to its folder: write it so)");
    } else {
      cfg.path_bases[value] = dir.string();
    }
  };
  resolve("base_model", cfg.base_model, true);
  resolve("tokenizer_config", cfg.tokenizer_config, true);
  resolve("lora_model_dir", cfg.lora_model_dir, true);
  if (cfg.resume_from_checkpoint != "auto") resolve("resume_from_checkpoint", cfg.resume_from_checkpoint, true);
  for (const auto& [name, list] : {std::pair{"datasets", &cfg.datasets}, std::pair{"test_datasets", &cfg.test_datasets}})
    for (std::size_t i = 0; i < list->size(); ++i)
      resolve(std::string(name) + "." + std::to_string(i) + ".path", (*list)[i].path, true);
  resolve("output_dir", cfg.output_dir, false);
  resolve("dataset_prepared_path", cfg.dataset_prepared_path, false);
  resolve("expert_offload_disk_path", cfg.expert_offload_disk_path, false);
}

std::string shown_path(const TrainConfig& cfg, const std::string& path) {
  if (path.empty() || fs::path(path).is_absolute()) return "'" + path + "'";
  const auto it = cfg.path_bases.find(path);
  return "'" + path + "' (resolved against " + (it != cfg.path_bases.end() ? it->second : current_folder().string()) + ")";
}

}  // namespace eo
