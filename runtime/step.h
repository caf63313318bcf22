// Runs one optimizer step's schedule (runtime/schedule.h) on the model: forward, loss, backward,
// per-block DDP buckets. Returns the step's loss sums; the optimizer update is the caller's.
//
//   Forward(i, m)   stage block i if it differs from the block used last; with checkpointing keep
//                   its input x[i][m] (ActivationStore) and run it without a graph; without, run it
//                   with a graph on a detached leaf input and keep the graph
//   Loss(m)         loss_m = CE(head(h[m])) / global tokens (+ aux): backward to dL/dh[m] (and to
//                   every block's router logits when the aux loss is on)
//   Backward(i, m)  tell the weight provider (before_backward: its per-block gradients ready), then
//                   recompute block i from x[i][m] with a graph (or take the kept one), then
//                   backward(y, dh[m]) — plus the router logits' gradient from the aux loss — gives
//                   the LoRA gradients of block i (accumulated in micro-batch order) and dh[m] for
//                   block i-1. After block i's last backward use: reducer.block_done(i).
// No backward runs inside another one, so this is activation checkpointing with non-reentrant
// semantics, driven explicitly. The LoRA dropout of each (block, micro-batch) draws from its own
// seed, derived from one draw of the global generator per step, so the recompute repeats the
// forward's masks and every schedule order draws the same masks.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "models/linear4bit.h"
#include "runtime/schedule.h"

namespace eo {

namespace model {
class MoeModel;
}
namespace data {
struct MicroBatch;
}
namespace ddp {
class GradReducer;
}
namespace offload {
class ActivationStore;
}
class BlockGraphs;

struct StepOptions {
  bool checkpointing = true;           // recompute blocks in backward (else keep each block's graph)
  StepOrder order = StepOrder::LayerMajor;  // with checkpointing; without, micro-batch-major
  bool activation_offloading = false;  // park checkpointed block inputs in pinned host RAM
  bool aux_loss = false;               // router load-balancing loss (output_router_logits)
  double aux_coef = 0;                 // its weight per micro-batch: coef / (g x ranks)
  bool random_blocks = false;          // blocks draw random numbers (LoRA dropout): seed per use
  // Replay the uses as CUDA graphs (runtime/block_graphs.h): the run's decision (RunSpec::graphs),
  // taken where uses can replay (checkpointing, no random blocks).
  bool cuda_graphs = true;
};

// Device scalars: read them once, after the step (no host synchronisation inside it).
struct StepLosses {
  at::Tensor ce_sum;   // fp64 [], summed over micro-batches
  at::Tensor aux_sum;  // fp64 [], summed raw aux losses (undefined without aux)
  std::int64_t tokens = 0;  // counted target tokens of this rank
};

class StepRunner {
 public:
  StepRunner(model::MoeModel& model, const StepOptions& options, int micro_batches, ddp::GradReducer* reducer);
  ~StepRunner();
  StepRunner(const StepRunner&) = delete;
  StepRunner& operator=(const StepRunner&) = delete;

  const StepSchedule& schedule() const { return schedule_; }
  // Runs the schedule over `micro` (size = micro_batches). `global_tokens` normalises the loss;
  // `poison(m)` (tests) turns micro-batch m's loss into NaN; `loss_scale` (fp32 [] on the device,
  // fp16's LossScaler) multiplies the loss before backward, so every gradient is that many times
  // the loss's (the returned sums are not scaled); undefined: 1.
  StepLosses run(const std::vector<data::MicroBatch>& micro, double global_tokens,
                 const std::function<bool(int)>& poison = {}, const at::Tensor& loss_scale = {});
  // Peak device bytes of saved block inputs in the steps run so far.
  std::int64_t peak_checkpoint_bytes() const;
  std::int64_t checkpoint_host_bytes() const;
  // Whether block uses replay as CUDA graphs; then the LoRA gradients must stay allocated between
  // steps (zeroed in place), since the graphs accumulate into them at fixed addresses.
  bool graphs_enabled() const;
  int graphs_captured() const;

 private:
  model::MoeModel& model_;
  StepOptions options_;
  StepSchedule schedule_;
  std::vector<std::size_t> last_backward_;
  ddp::GradReducer* reducer_;
  std::unique_ptr<offload::ActivationStore> store_;
  std::unique_ptr<BlockGraphs> graphs_;
};

}  // namespace eo
