// Tokenising the axolotl-format datasets before training (runtime/data/prepare.h): rank 0 builds
// what the cache lacks while the other ranks wait, bounded; `eo-ddp preprocess` does it alone.
#include <algorithm>
#include <cstdio>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "common/error.h"
#include "common/log.h"
#include "launch/commands.h"
#include "runtime/config.h"
#include "runtime/data/prepare.h"
#include "runtime/train_state.h"
#include "runtime/ddp/world.h"
#include "runtime/signals.h"

namespace eo::launch {

void prepare_datasets(TrainConfig& cfg, ddp::World& world) {
  // Rank 0 -> all: the prepared files as JSON ([test, index, file] each), or "error: ...".
  if (world.rank() == 0) {
    data::PreparePlan plan = data::plan_preparation(cfg);
    if (plan.empty()) {  // pre-tokenized data only: no Python
      if (world.size() > 1) world.broadcast_string("[]", 0);
      return;
    }
    try {
      // A file, /dev/null or a read-only mount as the cache folder: exit 2 naming the key, before Python starts.
      if (plan.missing() > 0) check_output_dir_writable(cfg.dataset_prepared_path, "dataset_prepared_path");
      if (plan.missing() > 0)
        log::info("datasets: " + std::to_string(plan.missing()) + " of " + std::to_string(plan.datasets.size()) +
                  " need tokenising (no cache in " + cfg.dataset_prepared_path + " for their data, tokenizer and keys)");
      data::run_preparation(cfg, plan);
    } catch (const Stopped& e) {
      if (world.size() > 1) world.broadcast_string(std::string("stopped: ") + e.what(), 0);
      throw;
    } catch (const std::exception& e) {
      if (world.size() > 1) world.broadcast_string(std::string("error: ") + e.what(), 0);
      throw;
    }
    for (const auto& p : plan.datasets) log::info("dataset " + (p.test ? cfg.test_datasets : cfg.datasets)[p.index].path + ": " + p.file());
    data::apply_preparation(cfg, plan);
    if (world.size() == 1) return;
    nlohmann::json files = nlohmann::json::array();
    for (const auto& p : plan.datasets) files.push_back({p.test, p.index, p.file()});
    world.broadcast_string(files.dump(), 0);
    return;
  }
  // The other ranks wait for rank 0's tokenisation, bounded by dataset_prepare_timeout.
  const double ddp_timeout = world.timeout();
  world.set_timeout(cfg.dataset_prepare_timeout, "dataset_prepare_timeout: rank 0 tokenising the datasets");
  const std::string outcome = world.broadcast_string("", 0);
  world.set_timeout(ddp_timeout);
  if (outcome.rfind("error: ", 0) == 0) throw UsageError("rank 0 could not prepare the datasets: " + outcome.substr(7));
  if (outcome.rfind("stopped: ", 0) == 0) throw Stopped("rank 0 " + outcome.substr(9));
  for (const auto& f : nlohmann::json::parse(outcome)) {
    const bool test = f[0].get<bool>();
    const auto index = f[1].get<std::size_t>();
    const std::string file = f[2].get<std::string>();
    if (!std::filesystem::is_regular_file(file))
      throw UsageError("rank " + std::to_string(world.rank()) + " cannot see " + file + ", which rank 0 prepared: "
                       "dataset_prepared_path must be on a file system every node shares (or run eo-ddp preprocess "
                       "--config F on every node first)");
    (test ? cfg.test_datasets : cfg.datasets).at(index).prepared = file;
  }
}

int run_preprocess(const Args& args) {
  ArgReader reader(args);
  const std::string config_path = reader.value("--config");
  const auto overrides = reader.values("--set");
  reader.finish("preprocess");
  if (config_path.empty()) throw UsageError("preprocess: --config FILE is required (see eo-ddp --help)");
  TrainConfig cfg = load_config_file(config_path, overrides);
  for (const auto& w : cfg.warnings) log::warn(w);
  data::PreparePlan plan = data::plan_preparation(cfg);
  if (plan.empty()) {
    std::printf("nothing to preprocess: every dataset is pre-tokenized (type tokenized or tokens)\n");
    return kExitOk;
  }
  const std::size_t missing = plan.missing();
  data::run_preparation(cfg, plan);
  for (const auto& p : plan.datasets)
    std::printf("%s -> %s\n", (p.test ? cfg.test_datasets : cfg.datasets)[p.index].path.c_str(), p.file().c_str());
  std::printf("%zu dataset(s) tokenised, %zu already cached in %s\n", missing, plan.datasets.size() - missing,
              cfg.dataset_prepared_path.c_str());
  return kExitOk;
}

}  // namespace eo::launch
