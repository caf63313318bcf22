// The expert offload engine: homes (host) -> slots (device) -> the 4-bit linears of the staged
// block. Implements model::WeightProvider, so the decoder neither knows nor cares where the bytes
// are (design.md §2.3).
//
//  - Each MoE block's 4-bit experts (NF4, MXFP4 or NVFP4: packed codes + quantisation statistics) live in
//    one exact-size, NUMA-local, page-locked host arena: one copy per block moves everything.
//  - Device slots, allocated once, hold the staged blocks: one in synchronous mode, 1 + depth with
//    prefetch (expert_offload_prefetch_depth). stage(L) is called by block L's forward and again by
//    its recompute in backward; what to copy and which slot to overwrite are chosen at staging
//    time — never by a hook after a block's forward, which a checkpoint recompute may skip.
//  - The schedule: the trainer hands over the step's staging order (set_schedule: the MoE blocks
//    in the order it will call stage(), one optimizer step, repeating every step). stage() checks
//    each call against it, so the engine never guesses: the future is known. While block L
//    computes, those of the next `depth` streamed blocks of the schedule that are not in a slot are
//    copied on a copy stream into slots holding neither L nor any of the `depth`, evicting the
//    block whose next use is farthest away (Belady's rule, exact). More depth lets the copy stream
//    run further ahead of compute, at one block of device memory per slot. The compute stream waits
//    for a slot's "ready" event only when it needs the block; before a slot is overwritten, the
//    copy stream waits for its "released" event, recorded after the last kernel that read it.
//    Without a schedule (scoring, tests) every stage() of a block not in a slot copies it
//    synchronously and nothing is prefetched.
//  - Blocks that fit in expert_offload_vram_budget stay resident and are never copied.
//  - Which block goes into which slot when is one policy (offload/staging.h), a plain value the
//    engine runs for real and the disk homes' read-ahead runs dry.
//  - Homes (expert_offload_homes) are one interface, offload/home_store.h: per_rank, per_numa_node
//    or disk. A copy reads a block's bytes only through HomeStore::acquire() / release(), and
//    homes that read ahead (disk) are told the copies the policy will make next.
//  - On a CPU build the slots are host memory and copies are memcpy: the same state machine runs,
//    so its logic is tested without a GPU.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "models/weights.h"
#include "offload/home_store.h"
#include "offload/homes.h"
#include "offload/staging.h"

namespace eo::offload {

struct OffloadOptions {
  at::Device device = at::kCPU;
  // Unset: every rank its own homes (per_rank). With `disk` unset it means per_numa_node.
  std::optional<HomeSharing> sharing;
  std::optional<DiskHomesOptions> disk;  // homes on a local drive (with `sharing`: one file per host)
  bool pin_memory = true;
  bool prefetch = true;
  int prefetch_depth = 1;  // with prefetch: blocks staged ahead of the one computing (slots = 1 + depth)
  std::int64_t vram_budget_bytes = 0;  // device bytes for permanently resident blocks
  // > 0: each copy into a slot takes at least its bytes at this rate (GB/s) on the device's clock
  // (offload/copy_pace_cuda.h): a slower card's host link, simulated. 0: the link's own pace.
  double copy_pace_gbps = 0;
  // > 0 and fewer than a block's experts: a streamed block moves in groups of this many experts
  // (contiguous ranges of its arena), one slot per group: two with prefetch (the next group copies
  // while this one computes), one without. stage(L) starts L's first group; expert_weight() of
  // another group switches to it. Not with disk homes (they read whole blocks).
  int group_size = 0;
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
  // Disk homes: blocks read from the drive into the ring, the reader thread's time reading, the
  // time a copy waited for its block's read, and blocks read on demand (not planned ahead).
  // Blocks a copy found still in the ring from an earlier use were not read again (disk_ring_hits).
  std::int64_t disk_reads = 0, disk_read_bytes = 0, disk_unplanned = 0, disk_ring_hits = 0;
  double disk_read_seconds = 0, disk_wait_seconds = 0;
  // The engine's shape when the step was taken: blocks resident within the VRAM budget, homes on
  // a drive, copies made by memcpy (no device: the CPU's "link").
  std::int64_t resident_blocks = 0;
  bool disk_homes = false, memcpy_link = false;

  // The step's metrics.jsonl fields (README: metrics): staged bytes, H2D rate, copy and stall
  // time; with disk homes, the drive's reads.
  nlohmann::json to_metrics() const;
};

class ExpertOffloader : public model::WeightProvider {
 public:
  // Moves every expert of `bank` (any device) into homes; the bank's tensors are released.
  ExpertOffloader(model::ResidentWeights::Bank bank, const OffloadOptions& options);
  ~ExpertOffloader() override;

  const QuantizedWeight& expert_weight(int layer, int expert, model::ExpertMatrix m) override;
  // 0 for a budget-resident block, 1 + its slot's index for a staged one, -1 when not staged.
  std::int64_t placement(int layer) override;
  // The order of stage() calls of one optimizer step (MoE layers; repeats every step). Replaces
  // any earlier schedule and restarts at its first entry. An empty list: no schedule.
  void set_schedule(const std::vector<int>& staging_order) override;

  // Makes more blocks permanently resident (in layer order) while they fit in `budget_bytes` of
  // new device memory; returns how many. Call between steps (it copies synchronously).
  int promote_resident(std::int64_t budget_bytes);

  // Closes the step being queued: its counters and copy timings are set aside for
  // take_step_stats(). Waits for nothing, so the host may queue the next step while this one runs.
  void end_step();
  // The oldest closed step's counters (closing the current one first when none is closed),
  // waiting only for that step's copies and stalls to have happened.
  OffloadStats take_step_stats();
  std::int64_t home_bytes() const;  // bytes of all homes' arenas (this rank; in RAM or on the drive)
  std::int64_t host_ram_bytes() const { return homes_->host_ram_bytes(); }  // on this rank (disk: the read ring)
  std::int64_t block_bytes(int layer) const;
  std::int64_t slot_bytes() const;  // device bytes of the slots
  std::int64_t resident_bytes() const;  // device bytes of budget-resident blocks
  int num_slots() const { return static_cast<int>(slots_.size()); }
  int expert_group_size() const override { return grouped_ ? opt_.group_size : 0; }
  std::vector<int> moe_layers() const;
  std::vector<int> resident_layers() const;
  // Layers whose bytes are in a slot right now (at most num_slots()).
  std::vector<int> staged_layers() const;
  const HomeNode& home_node() const { return node_; }
  const HomeStore& homes() const { return *homes_; }
  std::vector<int> home_page_nodes() const { return homes_->page_nodes(); }  // where the homes' pages really are
  bool homes_shared() const { return homes_->kind() == HomeKind::NodeShared; }
  bool homes_on_disk() const { return homes_->kind() == HomeKind::Disk; }
  std::string disk_file() const { return homes_->file(); }  // the disk homes file ("" without)
  int disk_ring_size() const { return homes_->read_ahead_depth(); }  // read buffers of the disk homes (0 without)
  // Equal on every rank sharing one copy.
  std::pair<std::uint64_t, std::uint64_t> homes_file_id() const { return homes_->file_id(); }
  // What the cross-rank checksum compares (HomeStore::checked_ranges).
  std::vector<std::pair<const void*, std::size_t>> home_ranges() const { return homes_->checked_ranges(); }

 protected:
  void stage_block(int layer) override;

 private:
  struct Piece;   // one tensor of a block inside an arena
  struct Block;   // one MoE layer: its home, layout, and views when resident
  struct Slot;    // device arena + the views of the block it holds
  struct CudaState;

  void copy_into(Slot& slot, int layer, int group = -1);
  // Grouped mode (OffloadOptions::group_size): stage() and expert_weight()'s group switches.
  void stage_grouped(int layer);
  Slot& switch_group(int layer, int group);
  Slot* slot_holding_group(int layer, int group);
  void mark_released(Slot& slot);
  void wait_ready(Slot& slot);
  // Views of experts [first, first + count) (count -1: all) whose pieces start at `base` of the block's arena.
  void build_views(std::vector<std::array<QuantizedWeight, 3>>& views, const Block& block, const at::Tensor& arena,
                   int first = 0, int count = -1, std::int64_t base = 0) const;
  Slot* slot_holding(int layer);
  // One block's arena bytes from the checkpoint's tensors into `dst` (zeroed, b.bytes long).
  void fill_arena(std::uint8_t* dst, const Block& b, const std::vector<std::array<QuantizedWeight, 3>>& experts) const;
  void plan_reads();  // homes that read ahead (disk): the copies the policy will make next

  OffloadOptions opt_;
  HomeNode node_;
  std::vector<std::unique_ptr<Block>> blocks_;  // indexed by layer; null for dense layers
  std::unique_ptr<HomeStore> homes_;            // every block's bytes between copies (expert_offload_homes)
  std::vector<std::unique_ptr<Slot>> slots_;
  std::unique_ptr<StagingPolicy> policy_;       // which block each stage() copies into which slot
  at::Tensor nested_code_;  // shared 256-entry map for double-quantised statistics (device)
  int current_ = -1;        // layer in use (last staged)
  bool grouped_ = false;    // blocks stream in groups of opt_.group_size experts
  int current_group_ = -1;  // grouped: the group in use of current_ (-1: none yet since stage())
  int direction_ = 1;       // grouped: +1 while groups are read upwards (forward), -1 downwards (backward)
  std::size_t cursor_ = 0;  // position in the schedule (policy_->schedule()) of the next stage() call
  OffloadStats stats_;            // the step being queued
  std::deque<OffloadStats> closed_;  // closed by end_step(), not yet taken
  std::unique_ptr<CudaState> cuda_;
};

}  // namespace eo::offload
