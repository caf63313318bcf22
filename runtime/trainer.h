// The training loop: one process (one GPU or the CPU), or one rank of a data-parallel job.
//
//   for each optimizer step:
//     for each micro-batch: forward (blocks checkpointed) → loss / global target tokens → backward
//     reduce gradients across ranks → clip → AdamW at the scheduled lr → log → maybe save
//
// The loss of a step is normalised by the number of target tokens of the whole step (every
// micro-batch on every rank), as transformers does with num_items_in_batch, so N ranks × b
// sequences compute the gradient of the same global batch as 1 rank × N·b.
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "runtime/config.h"

namespace eo {

namespace dist {
class World;
}

struct TrainResult {
  int exit_code = 0;       // kExitOk, or kExitPreempted after a signal-triggered save
  std::int64_t steps = 0;  // optimizer steps completed (including resumed ones)
  double first_loss = 0, last_loss = 0;
  double eval_loss = NAN;  // the last evaluation's, if any
  std::string adapter_dir;
};

// Observation points for benchmarks (a production run passes none; fault injection for tests
// is common/fault_seam.h).
struct TrainHooks {
  // At the start of optimizer step `step` (1-based), before its batches are read.
  std::function<void(std::int64_t step)> before_step;
  // After step `step` has been applied and reported (a benchmark stops its profiler here). With
  // this hook set, each step is read before the next is queued (no step runs ahead of the host's
  // reading of the previous one).
  std::function<void(std::int64_t step)> after_step;
  // Around the part of step `step` that queues device work and must not wait on the device
  // (batches, forward/backward, reduction, optimizer): called with true where it begins and false
  // where its end is marked, before the host reads any earlier step (a test turns CUDA's sync
  // debug mode on inside it).
  std::function<void(std::int64_t step, bool entering)> step_work;
};

// `model`: base_model's config.json as the config's checks parsed it (ConfigLoadOptions::model_out).
TrainResult train(const TrainConfig& cfg, const model::ModelConfig& model, dist::World& world, const TrainHooks& hooks = {});
// The same, parsing config.json here.
TrainResult train(const TrainConfig& cfg, dist::World& world, const TrainHooks& hooks = {});

}  // namespace eo
