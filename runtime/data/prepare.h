// The axolotl dataset formats (chat_template, alpaca, completion, input_output), tokenised once
// through the Python stack the users have (transformers: the model's tokenizer and chat
// template) by tools/prepare_data.py, and cached as tokenized JSONL in dataset_prepared_path.
//
// Each formatted dataset gets its own cache folder, <dataset_prepared_path>/<key>/ holding
// data.jsonl and manifest.json, where key is a hash of everything that shapes its tokens: the
// data file's bytes, the tokenizer folder's files (not the weights), the dataset's keys, the
// top-level keys that apply (train_on_inputs, chat_template, chat_template_jinja, tokenizer_type,
// trust_remote_code, special_tokens) and tools/prepare_data.py itself. Change any of them and the
// key changes: the stale folder is not reused, a new one is built. A folder appears only complete
// (written under a temporary name, renamed last). Its manifest records data.jsonl's hash, size and
// rows, checked at every use: a cache file changed since (rewritten, truncated, replaced by a link)
// is rebuilt with a warning. Pre-tokenized datasets (tokenized, tokens)
// never come here: they need no Python.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "runtime/config.h"

namespace eo::data {

struct PreparedDataset {
  bool test = false;      // from test_datasets (else datasets)
  std::size_t index = 0;  // position in its list
  std::string key;        // 16 hex digits
  std::string dir;        // <dataset_prepared_path>/<key>
  bool ready = false;     // dir holds a complete cache
  std::string file() const { return dir + "/data.jsonl"; }
};

struct PreparePlan {
  std::vector<PreparedDataset> datasets;  // the formatted ones, in config order
  std::string tokenizer;                  // tokenizer_config, else base_model
  bool empty() const { return datasets.empty(); }
  std::size_t missing() const;
};

// Hashes the inputs of every formatted dataset (reads the data and tokenizer files; runs nothing).
PreparePlan plan_preparation(const TrainConfig& cfg);

// Builds the missing caches with one run of tools/prepare_data.py (its progress and messages
// pass through to stderr; it runs in its own process group, ended on a stop request, which
// throws Stopped, and when eo-ddp dies). A data problem it reports is a UsageError; no Python, or no tool, is
// an Error saying where eo-ddp looked.
void run_preparation(const TrainConfig& cfg, PreparePlan& plan);

// Points every formatted dataset of cfg at its cache file (DatasetSpec::prepared).
void apply_preparation(TrainConfig& cfg, const PreparePlan& plan);

// The Python interpreter: $EO_DDP_PYTHON, else the interpreter the build was configured with
// (the source tree's .venv), else python3 on the PATH.
std::string find_python();
// Runs one of eo-ddp's Python tools (argv), stdout to `stdout_path`, stderr line by line to the
// log (a progress bar's redraws too); returns the exit status and the tool's last "error:" line.
// A stop request ends it and throws Stopped (`what` says during what).
int run_tool(const std::vector<std::string>& argv, const std::string& stdout_path, std::string& error_line,
             const char* what);
// A file of eo-ddp's tools/: $EO_DDP_TOOLS_DIR, else <prefix>/share/eo-ddp/tools beside the
// installed binary, else the source tree the binary was built from.
std::string find_tool(const std::string& name);

}  // namespace eo::data
