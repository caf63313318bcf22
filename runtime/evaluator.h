// Evaluation during a run: the held-out rows (val_set_size / test_datasets) every eval_steps (or
// evals_per_epoch) and at the end, as a token-weighted loss over all ranks.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace eo {

struct TrainConfig;
struct Run;
class StepRunner;
namespace ddp {
class World;
}

class Evaluator {
 public:
  // Writes the rows to output_dir/eval.jsonl (rank 0) and says when they are evaluated.
  Evaluator(const TrainConfig& cfg, Run& run, const StepRunner& runner, ddp::World& world);
  // Whether step `step` (1-based) ends with an evaluation.
  bool due(std::int64_t step) const;
  // The loss over all ranks and the target tokens it counts.
  std::pair<double, std::int64_t> run();

 private:
  const TrainConfig& cfg_;
  Run& run_;
  const StepRunner& runner_;
  ddp::World& world_;
  std::int64_t every_ = 0;  // steps between evaluations, 0: at the end only
  std::vector<bool> moe_blocks_;
};

}  // namespace eo
