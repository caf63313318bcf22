// One optimizer step as data: the ordered list of block uses (design.md §1).
//
// A step over g micro-batches and N decoder blocks is a sequence of uses:
//   Forward(i, m)   run block i on micro-batch m's hidden state (no graph when checkpointing)
//   Loss(m)         final norm + lm_head + cross entropy (+ router aux loss) of micro-batch m
//   Backward(i, m)  block i's backward for micro-batch m (recomputed from its saved input when
//                   checkpointing), turning dL/d(output) into dL/d(input)
//
// Layer-major (the default with checkpointing): every micro-batch goes through block i before
// block i+1, then the losses, then the blocks top down, so each block's experts are staged once
// in forward and once in backward per optimizer step, whatever g is. Micro-batch-major is the
// classic order (forward, loss, backward per micro-batch); it is what a run without
// checkpointing uses (keeping one micro-batch's graph, not g) and the oracle the tests compare the
// layer-major order with. Within one (block, micro-batch) the work is identical in both orders, and
// each parameter's gradient sums its micro-batches in the same order (m = 0, 1, ...), so both
// orders give bitwise the same result in fp32.
//
// The step runner executes the list; the offload engine is handed staging_order() so it prefetches
// along it and evicts by farthest next use, exactly; the DDP reducer launches block i's buckets at
// last_backward_use(i).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace eo {

enum class StepOrder { LayerMajor, MicroBatchMajor };

struct BlockUse {
  enum class Kind { Forward, Loss, Backward };
  Kind kind = Kind::Forward;
  int block = -1;  // -1 for Loss
  int micro = 0;
  bool operator==(const BlockUse& o) const { return kind == o.kind && block == o.block && micro == o.micro; }
};

struct StepSchedule {
  int blocks = 0;
  int micro_batches = 0;
  StepOrder order = StepOrder::LayerMajor;
  std::vector<BlockUse> uses;

  // The blocks the runner stages, in order: one entry per maximal run of consecutive uses of the
  // same block (Loss uses break nothing: they stage no block). Only the blocks for which
  // `stages(block)` is true appear (MoE blocks; dense blocks have no experts to stage).
  std::vector<int> staging_order(const std::vector<bool>& stages) const;
  // Index in `uses` of block i's last Backward use: its gradients are final after it.
  std::vector<std::size_t> last_backward_use() const;
  // "F0:0 F0:1 ... L0 L1 ... B1:0 ..." (tests and logs).
  std::string describe() const;
};

StepSchedule make_step_schedule(int blocks, int micro_batches, StepOrder order);

// The order a step runs in: without checkpointing a layer-major step would keep g micro-batches'
// graphs, so it runs micro-batch-major whatever was asked.
inline StepOrder step_order_in_effect(bool checkpointing, StepOrder asked) {
  return checkpointing ? asked : StepOrder::MicroBatchMajor;
}

}  // namespace eo
