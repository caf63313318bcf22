// One optimizer step queued on the device, and the clock that times steps. The host queues step s
// and reads it later (runtime/one_step_behind.h): everything the host will want of it is copied
// once, as one fp64 tensor, when the step is queued.
//
//   queue: before_step hook → this step's micro-batches (target tokens summed over ranks) → the
//          schedule's forward/loss/backward (StepRunner) → gradient buckets finished → norm, clip
//          and the non-finite guard's decision, all on the device → AdamW (skipped on NaN/Inf) →
//          the loss scale's update → gradients zeroed → the values to read, copied to the host
//
// Step times come from the device: a mark where the step's device work begins and one where it
// ends (DeviceMark: CUDA events on the compute stream, the wall clock on the CPU). A step's time
// is its end minus the previous step's end, so the device's idle time while it waited for the
// host counts, as it does in the run's length. The first step, and a step after an evaluation,
// a save or the automatic budget (work that is not a step's), run from their own begin mark.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <vector>

#include "runtime/device.h"
#include "runtime/nonfinite_guard.h"

namespace eo {

struct TrainConfig;
struct TrainHooks;
struct Run;
class StepRunner;
class LossScaler;
namespace ddp {
class World;
}

struct QueuedStep {
  std::int64_t step = 0;     // 1-based
  std::int64_t tokens = 0;   // target tokens, all ranks
  double lr = 0, epoch = 0;
  std::int64_t start_allocated = 0;  // device bytes allocated when the step began
  DeviceMark begin, end;     // where the step's device work begins and ends
  DeviceMark since;          // what its time counts from (StepClock)
  HostCopy values;           // StepValues, in their order
  // The host-held expert LoRA's state check (runtime/expert_lora_offload.h): 1 when its update
  // left NaN/Inf (the update is applied block by block as the next step stages them); empty without.
  std::function<double()> host_state_check;
  StepValues read();         // waits for this step's values only
};

class TrainStep {
 public:
  TrainStep(const TrainConfig& cfg, Run& run, StepRunner& runner, LossScaler& scaler, ddp::World& world,
            const TrainHooks& hooks);
  // Queues optimizer step run.step + 1 and counts it done (run.step).
  QueuedStep queue();

 private:
  const TrainConfig& cfg_;
  Run& run_;
  StepRunner& runner_;
  LossScaler& scaler_;
  ddp::World& world_;
  const TrainHooks& hooks_;
  // The step's update, decided from the gradient norm (fp64 []: the gradients' as they are, before
  // any loss scale is divided out), the summed non-finite flags and fp16's loss scale (undefined
  // without): the norm reported, the skip flag and the gradients' divisor, on the norm's device.
  struct UpdateDecision {
    at::Tensor norm, skip, grad_divisor;
  };
  UpdateDecision decide_update(const at::Tensor& scaled_norm, const at::Tensor& nonfinite_flags,
                               const at::Tensor& scale) const;
  // The host-held expert LoRA's update (runtime/expert_lora_offload.h): the global norm over every
  // parameter (on the device) and the check of the state it leaves.
  struct HostUpdate {
    at::Tensor scaled_norm;
    std::function<double()> state_check;
  };
  HostUpdate update_host_lora(const at::Tensor& sums, double lr);

  std::vector<at::Tensor> params_;  // the parameters the device updates
  std::int64_t merge_aware_from_ = -1;  // nvfp4_merge_aware's first step (0-based steps done), -1: never
};

// The host's and the device's clocks of a run's steps (see above).
class StepClock {
 public:
  using Clock = std::chrono::steady_clock;
  // The run's clocks start here, and the device's peak memory counts from here.
  explicit StepClock(const at::Device& device);
  // Step q was queued: its time runs from the previous step's end, or from its own begin.
  void queued(QueuedStep& q);
  // Work that is not a step's was done (an evaluation, a save): the next step times from its own
  // begin and the host's interval from now.
  void other_work();
  // At the host's reading of a step: the host's interval since the previous reading.
  double host_interval();
  double device_clock_s(const QueuedStep& q) const { return q.end.seconds_since(run_start_); }
  double elapsed_s() const { return std::chrono::duration<double>(Clock::now() - t_start_).count(); }

 private:
  Clock::time_point t_start_, t_last_;
  DeviceMark run_start_, last_end_;
};

}  // namespace eo
