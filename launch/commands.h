// The eo-ddp subcommands. Each takes the arguments after its name and returns an exit code
// (eo::ExitCode); usage problems throw eo::UsageError, runtime failures eo::Error.
#pragma once

#include <string>
#include <vector>

namespace eo {
struct TrainConfig;
namespace ddp {
class World;
}
}  // namespace eo

namespace eo::launch {

using Args = std::vector<std::string>;

// eo-ddp's whole command line (launch/eo_ddp.cpp's main; the tests' eo-ddp-faults calls it too).
int run_main(int argc, char** argv);

int run_train(const Args& args);  // eo-ddp [train] --config F [--set k=v ...] [--check]
int run_score(const Args& args);  // eo-ddp score --model DIR [--adapter DIR] --data FILE ...
int run_plan(const Args& args);   // eo-ddp plan --config F [--vram SIZE] [--ranks-per-node N]
int run_preprocess(const Args& args);  // eo-ddp preprocess --config F [--set k=v ...]
int run_generate(const Args& args);  // eo-ddp generate --model DIR [--adapter DIR] --prompt TEXT | --chat FILE
int run_merge(const Args& args);  // eo-ddp merge --model DIR --adapter DIR --output DIR ...

// Before training: the axolotl-format datasets tokenised into dataset_prepared_path (rank 0; the
// others wait, bounded by dataset_prepare_timeout) and cfg pointed at the cached files. Collective.
void prepare_datasets(TrainConfig& cfg, ddp::World& world);

// Small argument reader shared by the subcommands: --flag, --key value, --key=value.
class ArgReader {
 public:
  explicit ArgReader(Args args) : args_(std::move(args)) {}
  bool flag(const std::string& name);                                   // consumes --name
  std::vector<std::string> values(const std::string& name);             // consumes every --name X
  std::string value(const std::string& name, const std::string& fallback = "");
  bool has_value(const std::string& name);
  // Throws UsageError naming anything not consumed.
  void finish(const std::string& command) const;

 private:
  Args args_;
  std::vector<bool> used_ = std::vector<bool>(args_.size(), false);
};

}  // namespace eo::launch
