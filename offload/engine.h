// The expert offload engine: homes (host) -> slots (device) -> the 4-bit linears of the staged
// block. Implements model::WeightProvider, so the decoder neither knows nor cares where the bytes
// are (design.md §2.3).
//
//  - Each MoE block's NF4 experts (packed bytes + quantisation statistics) live in one exact-size,
//    NUMA-local, page-locked host arena: one copy per block moves everything.
//  - One slot (synchronous mode) or two (prefetch) of device memory, allocated once, hold the
//    staged blocks. stage(L) is called by block L's forward and again by its recompute in backward;
//    the slot to overwrite is chosen at staging time — never by a hook after a block's forward,
//    which a checkpoint recompute may skip.
//  - Prefetch: the order is static (forward 0..N-1, recompute N-1..0), so while block L computes the
//    next block in the current direction is copied into the other slot on a copy stream; the
//    compute stream waits for its event only when it needs the block. Before a slot is overwritten,
//    the copy stream waits for an event recorded after the last kernel that read it.
//  - Blocks that fit in expert_offload_vram_budget stay resident and are never copied.
//  - On a CPU build the slots are host memory and copies are memcpy: the same state machine runs,
//    so its logic is tested without a GPU.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include "models/weights.h"
#include "offload/homes.h"

namespace eo::offload {

struct OffloadOptions {
  at::Device device = at::kCPU;
  bool pin_memory = true;
  bool prefetch = true;
  std::int64_t vram_budget_bytes = 0;  // device bytes for permanently resident blocks
};

// Counters since the last take_step_stats().
struct OffloadStats {
  std::int64_t stage_calls = 0;   // stage() calls (forward + recompute)
  std::int64_t copies = 0;        // blocks copied into a slot
  std::int64_t copied_bytes = 0;
  std::int64_t slot_hits = 0;     // stage() served by a block already in a slot, no copy
  std::int64_t resident_hits = 0; // stage() of a budget-resident block
  double copy_seconds = 0;        // time the copies took (CUDA events / host clock)
  double stall_seconds = 0;       // time compute waited for a copy to finish
};

class ExpertOffloader : public model::WeightProvider {
 public:
  // Moves every expert of `bank` (any device) into homes; the bank's tensors are released.
  ExpertOffloader(model::ResidentWeights::Bank bank, const OffloadOptions& options);
  ~ExpertOffloader() override;

  const nf4::QuantizedWeight& expert_weight(int layer, int expert, model::ExpertMatrix m) override;

  // Makes more blocks permanently resident (in layer order) while they fit in `budget_bytes` of
  // new device memory; returns how many. Call between steps (it copies synchronously).
  int promote_resident(std::int64_t budget_bytes);

  OffloadStats take_step_stats();  // waits for outstanding copies, returns and resets the counters
  std::int64_t home_bytes() const;  // host bytes of all homes (this rank)
  std::int64_t block_bytes(int layer) const;
  std::int64_t slot_bytes() const;  // device bytes of the slots
  std::int64_t resident_bytes() const;  // device bytes of budget-resident blocks
  int num_slots() const { return static_cast<int>(slots_.size()); }
  std::vector<int> moe_layers() const;
  std::vector<int> resident_layers() const;
  // Layers whose bytes are in a slot right now (at most num_slots()).
  std::vector<int> staged_layers() const;
  const HomeNode& home_node() const { return node_; }
  std::vector<int> home_page_nodes() const;  // where the homes' pages really are
  // Every home's bytes (for the cross-rank checksum).
  std::vector<std::pair<const void*, std::size_t>> home_ranges() const;

 protected:
  void stage_block(int layer) override;

 private:
  struct Piece;   // one tensor of a block inside an arena
  struct Block;   // one MoE layer: its home, layout, and views when resident
  struct Slot;    // device arena + the views of the block it holds
  struct CudaState;

  void copy_into(Slot& slot, int layer, bool wait_for_release);
  void wait_ready(Slot& slot);
  void build_views(std::vector<std::array<nf4::QuantizedWeight, 3>>& views, const Block& block, const at::Tensor& arena) const;
  int next_layer(int from, int direction) const;
  Slot* slot_holding(int layer);
  bool b_pinned() const;

  OffloadOptions opt_;
  HomeNode node_;
  std::vector<std::unique_ptr<Block>> blocks_;  // indexed by layer; null for dense layers
  std::vector<std::unique_ptr<Slot>> slots_;
  at::Tensor nested_code_;  // shared 256-entry map for double-quantised statistics (device)
  int current_ = -1;        // layer in use (last staged)
  int direction_ = +1;
  OffloadStats stats_;
  std::unique_ptr<CudaState> cuda_;
};

}  // namespace eo::offload
