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

#include <ATen/core/Tensor.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "runtime/config.h"

namespace eo {

namespace ddp {
class World;
}

struct TrainResult {
  int exit_code = 0;       // kExitOk, or kExitPreempted after a signal-triggered save
  std::int64_t steps = 0;  // optimizer steps completed (including resumed ones)
  double first_loss = 0, last_loss = 0;
  double eval_loss = NAN;  // the last evaluation's, if any
  std::string adapter_dir;
};

// Observation points for benchmarks and tests (a production run passes none). Fault injection
// reaches the loop here too: train() adds the test binaries' plan (common/fault_seam.h) to these
// hooks (runtime/fault_hooks.h), so the loop itself has no test seam of its own.
struct TrainHooks {
  // After setup, just before the check that ends a run stopped while loading.
  std::function<void()> before_training;
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
  // Tests: true turns this rank's loss of step `step` into NaN (it may also throw or end the
  // process: a failing rank); true from overflow makes the rank's loss scale infinite for the step
  // (its gradients overflow, its loss stays finite: fp16's skipped step).
  std::function<bool(std::int64_t step, int rank)> poison_loss, overflow;
  // Tests: while step `step`'s device work is queued (after its micro-batches, before the
  // reduction and the optimizer), where a test adds device work of a known length.
  std::function<void(std::int64_t step)> in_step_work;
  // Tests: after step `step`'s optimizer update, with the trainable parameters (a test corrupts one
  // as a bad update would).
  std::function<void(std::int64_t step, const std::vector<at::Tensor>& params)> after_update;
  // Tests: after step `step` is queued, before the step before it is read (a test makes the host late).
  std::function<void(std::int64_t step)> after_queue;
};

// `model`: base_model's config.json as the config's checks parsed it (ConfigLoadOptions::model_out).
TrainResult train(const TrainConfig& cfg, const model::ModelConfig& model, ddp::World& world, const TrainHooks& hooks = {});
// The same, parsing config.json here.
TrainResult train(const TrainConfig& cfg, ddp::World& world, const TrainHooks& hooks = {});

}  // namespace eo
