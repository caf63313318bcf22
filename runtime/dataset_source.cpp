// A dataset's source keys. See dataset_source.h.
#include "runtime/dataset_source.h"

#include <algorithm>

#include "runtime/hub.h"
#include "runtime/yaml_values.h"

namespace eo {

void read_dataset_source(const YAML::Node& d, const std::string& where, DatasetSpec& s, std::vector<ConfigIssue>& issues) {
  const std::string ds_type = scalar_or_empty(d["ds_type"]);
  if (d["ds_type"].IsDefined() && !is_null(d["ds_type"]) && ds_type != "json" && ds_type != "parquet")
    issues.push_back({where + ".ds_type", "eo-ddp reads JSON lines / JSON and parquet files: ds_type json or parquet (or "
                                          "leave it out: the file's extension decides)"});
  const bool named_parquet = s.path.size() > 8 && s.path.compare(s.path.size() - 8, 8, ".parquet") == 0;
  const bool parquet = ds_type == "parquet" || named_parquet;
  // tools/prepare_data.py reads a file as parquet by its name; a local file named otherwise would be read as JSON.
  if (ds_type == "parquet" && !named_parquet && !s.path.empty() && !hub::is_repo_id(s.path))
    issues.push_back({where + ".ds_type", "parquet, but '" + s.path + "' is not named .parquet: rename the file to "
                                          "end in .parquet (eo-ddp reads a data file by its extension)"});
  if (parquet && !s.formatted())
    issues.push_back({where + ".path", "a pre-tokenized dataset (type " + s.type + ") is read from JSON lines; parquet "
                                       "files are read for the axolotl formats (chat_template, alpaca, completion, input_output)"});
  if (d["revision"].IsDefined() && !is_null(d["revision"])) s.revision = scalar_or_empty(d["revision"]);
  if (d["data_files"].IsDefined() && !is_null(d["data_files"])) {
    const YAML::Node f = d["data_files"];
    if (f.IsScalar()) s.data_files.push_back(f.Scalar());
    else if (f.IsSequence())
      for (const auto& x : f) s.data_files.push_back(scalar_or_empty(x));
    if (s.data_files.empty() || std::count(s.data_files.begin(), s.data_files.end(), std::string()))
      issues.push_back({where + ".data_files", "expected a file of the Hub dataset (or a list of them)"});
  }
  for (const char* k : {"shards", "shards_idx"}) {
    if (!d[k].IsDefined() || is_null(d[k])) continue;
    const auto v = as_int(d[k]);
    if (!v || *v < (std::string(k) == "shards" ? 1 : 0)) issues.push_back({where + "." + k, "expected a whole number"});
    else (std::string(k) == "shards" ? s.shards : s.shards_idx) = *v;
  }
  if (d["shards_idx"].IsDefined() && !d["shards"].IsDefined())
    issues.push_back({where + ".shards_idx", "needs shards (the number of shards the rows are cut into)"});
  else if (s.shards > 0 && s.shards_idx >= s.shards)
    issues.push_back({where + ".shards_idx", "must be below shards (" + std::to_string(s.shards) + ")"});
  if (s.shards > 0 && !s.formatted())
    issues.push_back({where + ".shards", "applies to the axolotl formats (chat_template, alpaca, completion, input_output); "
                                         "cut a pre-tokenized file itself"});
}

}  // namespace eo
