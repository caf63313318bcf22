// The host's reading of a queued step (runtime/train_step.h), one step late or at once
// (runtime/one_step_behind.h): its values through the non-finite guard, an evaluation when one is
// due, the progress line and metrics.jsonl (rank 0), the after_step hook, and the run's tally.
#pragma once

#include <memory>

#include "runtime/progress.h"

namespace eo {

struct TrainConfig;
struct TrainHooks;
struct Run;
struct QueuedStep;
class NonfiniteGuard;
class Evaluator;
class StepClock;
class MetricsLog;
class Trackers;
namespace ddp {
class World;
}

class StepReader {
 public:
  StepReader(const TrainConfig& cfg, Run& run, NonfiniteGuard& guard, Evaluator& eval, StepClock& clock, const TrainHooks& hooks,
             ddp::World& world);
  ~StepReader();
  // Waits for step q's values only, then reports it; `eval_now`: the step ends with an evaluation.
  void read(QueuedStep q, bool eval_now);
  const RunTally& tally() const { return tally_; }

 private:
  const TrainConfig& cfg_;
  Run& run_;
  NonfiniteGuard& guard_;
  Evaluator& eval_;
  StepClock& clock_;
  const TrainHooks& hooks_;
  int rank_, world_size_;
  std::unique_ptr<MetricsLog> metrics_;  // rank 0
  std::unique_ptr<Trackers> trackers_;   // rank 0
  EtaWindow eta_;
  RunTally tally_;
};

}  // namespace eo
