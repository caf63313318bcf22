// Models and datasets named as on the Hugging Face Hub (`base_model: org/name`, a dataset's
// `path: org/name`), found in the local cache exactly as huggingface_hub lays it out:
//   <cache>/models--org--name/refs/<revision>      a commit hash
//   <cache>/models--org--name/snapshots/<hash>/    the files (links into blobs/)
// (datasets--org--name for datasets; a revision may be the commit hash itself). <cache> is
// $HF_HUB_CACHE, else $HUGGINGFACE_HUB_CACHE, else $HF_HOME/hub, else
// $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub, as huggingface_hub decides it.
// Not cached: downloaded by tools/hub_download.py (huggingface_hub's snapshot_download, its
// progress in the log), unless HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE say not to: then an error
// naming the folders searched and the command that downloads it. A local path that exists always
// wins over a hub name.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "runtime/config.h"

namespace eo::hub {

enum class Repo { Model, Dataset };
// What a model must hold to count as cached: config.json alone (eo-ddp plan, synthetic weights),
// or the weights and tokenizer too.
enum class Need { Config, Everything };

std::string cache_dir();
bool offline();  // HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE set to 1/ON/YES/TRUE
// owner/name as the Hub spells a repository id (one slash, letters, digits, - _ .).
bool is_repo_id(const std::string& s);

// The snapshot folder of repo at revision (empty = main) in the cache, or nothing.
std::optional<std::string> cached_snapshot(Repo repo, const std::string& id, const std::string& revision);

struct Resolution {
  std::string path;     // the local folder (a model) or snapshot (a dataset); empty when not found
  std::string problem;  // why not, with the fix (empty when found)
};
// `name` as a local path when it exists, else as a hub repository: cached (holding what `need`
// asks), else downloaded when `may_download` (and not offline). `key` names the config key in
// messages.
Resolution resolve(Repo repo, const std::string& name, const std::string& revision, Need need, bool may_download,
                   const std::string& key);

// The data files of a dataset snapshot (JSON lines, JSON, parquet), sorted; `data_files` (paths
// in the repository) picks them when given, else the train split's files when the repository
// names splits, else every data file.
std::vector<std::string> dataset_files(const std::string& snapshot, const std::vector<std::string>& data_files);

// Resolves base_model, tokenizer_config and every dataset named as on the Hub, in place (the
// names are kept in base_model_hub / DatasetSpec::hub_name). Problems go to `problems` as
// (key, message); with `may_download` false, a name that is not cached is left for later.
void resolve_config(TrainConfig& cfg, Need need, bool may_download,
                    std::vector<std::pair<std::string, std::string>>& problems);

// The base model as peft's adapter_config.json names it: the hub name when one was given, else
// the model folder's absolute path (so the adapter loads from any folder).
std::string adapter_base_name(const TrainConfig& cfg);

}  // namespace eo::hub
