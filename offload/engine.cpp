#include "offload/engine.h"

#include "offload/layout.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>

#include <nlohmann/json.hpp>

#include "common/error.h"
#include "common/log.h"
#include "common/progress_meter.h"
#include "common/text.h"

#ifdef EO_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include "common/cuda_check.h"
#include "offload/copy_pace_cuda.h"
#endif

namespace eo::offload {

// Where a tensor of a QuantizedWeight sits in its block's arena.
struct ExpertOffloader::Piece {
  std::int64_t offset = 0, bytes = 0;
};

struct ExpertOffloader::Block {
  int layer = -1;
  std::int64_t bytes = 0;  // arena size
  // Where the block sits in one contiguous, page-aligned copy of every arena (ArenaExtent::offset).
  std::int64_t copy_offset = 0;
  // Per expert and matrix: the metadata (shape, blocksize, ...) and where its tensors live.
  std::vector<std::array<QuantizedWeight, 3>> meta;  // tensors undefined; filled into views
  std::vector<std::array<std::array<Piece, 3>, 3>> pieces;  // [expert][matrix][packed|absmax|nested_absmax]
  at::Tensor resident;  // device arena when budget-resident
  std::vector<std::array<QuantizedWeight, 3>> resident_views;
  // Grouped mode: each group's byte range [begin, end) of the arena (its experts' pieces, in order).
  std::vector<std::pair<std::int64_t, std::int64_t>> groups;
};

struct ExpertOffloader::Slot {
  at::Tensor arena;  // device bytes, allocated once
  int layer = -1;
  int group = -1;  // grouped mode: the group of `layer` it holds; views are that group's experts
  std::vector<std::array<QuantizedWeight, 3>> views;
  bool copy_pending = false;  // a copy was enqueued and compute has not waited for it yet
#ifdef EO_WITH_CUDA
  cudaEvent_t ready = nullptr, released = nullptr;
#endif
};

struct ExpertOffloader::CudaState {
#ifdef EO_WITH_CUDA
  c10::cuda::CUDAStream copy_stream = c10::cuda::getStreamFromPool(/*isHighPriority=*/false);
  std::vector<std::pair<cudaEvent_t, cudaEvent_t>> stall_events;  // (before wait, after wait) pairs to time
  std::vector<std::pair<cudaEvent_t, cudaEvent_t>> copy_events;   // (start, end) of every copy this step
  struct Closed {  // a closed step's events, timed when its stats are taken
    std::vector<std::pair<cudaEvent_t, cudaEvent_t>> stall, copy;
  };
  std::deque<Closed> closed;
  std::vector<cudaEvent_t> free_events;
  at::Tensor pace_stamp;  // one int64 on the device: where the copy being paced began
  cudaEvent_t take() {
    if (!free_events.empty()) {
      cudaEvent_t e = free_events.back();
      free_events.pop_back();
      return e;
    }
    cudaEvent_t e;
    EO_CUDA_CHECK(cudaEventCreate(&e), "offload: cudaEventCreate");
    return e;
  }
#endif
};

ExpertOffloader::ExpertOffloader(model::ResidentWeights::Bank bank, const OffloadOptions& options) : opt_(options) {
  const int cuda_index = opt_.device.is_cuda() ? opt_.device.index() : -1;
  node_ = choose_home_node(Topology::get(), cuda_index);
  std::string why;
  if (node_.node >= 0 && !bind_threads_to_node(Topology::get(), node_.node, &why))
    log::warn("could not bind threads to NUMA node " + std::to_string(node_.node) + ": " + why);
#ifdef EO_WITH_CUDA
  if (opt_.device.is_cuda()) {
    c10::cuda::CUDAGuard guard(opt_.device.index());
    cuda_ = std::make_unique<CudaState>();
    cuda_->copy_stream = c10::cuda::getStreamFromPool(false, opt_.device.index());
    if (opt_.copy_pace_gbps > 0) cuda_->pace_stamp = at::zeros({1}, at::dtype(at::kLong).device(opt_.device));
  }
#endif
  const bool pin = opt_.pin_memory && opt_.device.is_cuda();
  std::int64_t max_block = 0, shared_bytes = 0;
  blocks_.resize(bank.size());
  // Layout of every block: for each expert and matrix, packed bytes then the statistics (NF4: fp32
  // absmax, or u8 codes + fp32 scales; MXFP4: u8 E8M0 scales; NVFP4: u8 E4M3 scales + the fp32
  // global scale), each piece 256-byte aligned; blocks
  // page-aligned in a shared copy.
  for (std::size_t layer = 0; layer < bank.size(); ++layer) {
    const auto& experts = bank[layer];
    if (experts.empty()) continue;
    auto b = std::make_unique<Block>();
    b->layer = static_cast<int>(layer);
    b->meta.resize(experts.size());
    b->pieces.resize(experts.size());
    std::int64_t off = 0;
    for (std::size_t e = 0; e < experts.size(); ++e)
      for (int m = 0; m < 3; ++m) {
        const QuantizedWeight& q = experts[e][m];
        auto& p = b->pieces[e][m];
        const at::Tensor& stats = q.stats();
        PieceBytes bytes;  // from the tensors themselves: a stored bitsandbytes layout is kept as it is
        bytes.packed = q.packed.numel();
        bytes.stats = stats.numel() * static_cast<std::int64_t>(stats.element_size());
        bytes.nested = q.nested ? q.nested->nested_absmax.numel() * 4 : q.global_scale.defined() ? q.global_scale.nbytes() : 0;
        const PieceOffsets at = place_matrix(off, bytes);  // offload/layout.h: the one arena layout
        p[0] = {at.packed, bytes.packed};
        p[1] = {at.stats, bytes.stats};
        if (bytes.nested > 0) p[2] = {at.nested, bytes.nested};
        if (q.nested) {
          if (!nested_code_.defined()) nested_code_ = q.nested->nested_code.to(opt_.device, at::kFloat).contiguous();
        }
        QuantizedWeight meta;
        meta.format = q.format;
        meta.shape = q.shape;
        meta.blocksize = q.blocksize;
        meta.dtype = q.dtype;
        if (q.nested) {
          meta.nested = DoubleQuant{};
          meta.nested->offset = q.nested->offset;
          meta.nested->nested_blocksize = q.nested->nested_blocksize;
        }
        b->meta[e][m] = std::move(meta);
      }
    b->bytes = off;
    b->copy_offset = shared_bytes;
    shared_bytes = (shared_bytes + off + 4095) / 4096 * 4096;
    max_block = std::max(max_block, b->bytes);
    blocks_[layer] = std::move(b);
  }
  EO_CHECK(max_block > 0, "offload: the model has no expert blocks to offload");
  for (auto& b : blocks_)
    if (b && opt_.group_size > 0 && opt_.group_size < static_cast<int>(b->meta.size())) grouped_ = true;
  EO_CHECK(!grouped_ || !opt_.disk, "offload: expert groups need the homes in host RAM (the disk homes read whole blocks)");
  // The homes, filled layer by layer from the bank, whose tensors are dropped as they go.
  std::vector<ArenaExtent> extents;
  for (const auto& b : blocks_)
    if (b) extents.push_back({b->layer, b->bytes, b->copy_offset});
  // The homes' progress line (rank 0): blocks filled, bytes, rate. Homes that need no filling (a
  // follower's shared copy, a disk file already right) show none; disk homes fill every block
  // twice (checksums, then the write), so a block filled again starts the count anew.
  ProgressMeter meter;
  std::int64_t all_bytes = 0, filled_bytes = 0;
  int filled = 0;
  for (const ArenaExtent& e : extents) all_bytes += e.bytes;
  std::vector<bool> seen(blocks_.size());
  auto pass_start = std::chrono::steady_clock::now();
  auto homes_line = [&](bool done) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - pass_start).count();
    return std::string(done ? "filled " : "filling") + "  expert homes  block " + std::to_string(filled) + "/" +
           std::to_string(extents.size()) + "  " + human_bytes(double(filled_bytes)) + " of " +
           human_bytes(double(all_bytes)) + "  " + rate_text(double(filled_bytes), s);
  };
  ArenaSource source;
  source.fill = [&](int layer, std::uint8_t* dst) {
    const auto i = static_cast<std::size_t>(layer);
    if (seen[i]) {
      seen.assign(seen.size(), false);
      filled = 0, filled_bytes = 0, pass_start = std::chrono::steady_clock::now();
    }
    seen[i] = true;
    fill_arena(dst, *blocks_[i], bank[i]);
    ++filled;
    filled_bytes += blocks_[i]->bytes;
    if (meter.due()) meter.show(homes_line(false));
  };
  source.drop = [&](int layer) {
    auto& experts = bank[static_cast<std::size_t>(layer)];
    experts.clear();
    experts.shrink_to_fit();
  };
  const int slots_wanted = slots_asked(opt_.prefetch, opt_.prefetch_depth);
  if (opt_.disk)
    homes_ = make_disk_homes(extents, source, node_, pin, *opt_.disk, opt_.sharing, slots_wanted);
  else if (opt_.sharing)
    homes_ = make_node_shared_homes(extents, shared_bytes, source, node_, pin, *opt_.sharing);
  else
    homes_ = make_per_rank_homes(extents, source, node_, pin);
  if (filled > 0) meter.finish(homes_line(true));

  // Budget-resident blocks: the first blocks (in layer order) that fit the budget beside the slots.
  promote_resident(opt_.vram_budget_bytes);
  EO_CHECK(opt_.prefetch_depth >= 1, "offload: prefetch_depth must be at least 1, got ", opt_.prefetch_depth);
  int streamed = 0;
  for (auto& b : blocks_) streamed += (b && !b->resident.defined()) ? 1 : 0;
  // Groups: contiguous expert ranges, so a group is one contiguous range of the arena (the layout
  // places every expert's pieces in expert order) and one copy moves it.
  EO_CHECK(opt_.group_size >= 0, "offload: group_size must be at least 0, got ", opt_.group_size);
  std::int64_t slot_bytes = max_block;
  int slot_count = device_slots(opt_.prefetch, opt_.prefetch_depth, streamed);
  if (grouped_) {
    slot_bytes = 0;
    for (auto& b : blocks_) {
      if (!b) continue;
      const int E = static_cast<int>(b->meta.size());
      for (int first = 0; first < E; first += opt_.group_size) {
        const int end = std::min(E, first + opt_.group_size);
        const std::int64_t lo = b->pieces[first][0][0].offset, hi = end < E ? b->pieces[end][0][0].offset : b->bytes;
        b->groups.emplace_back(lo, hi);
        slot_bytes = std::max(slot_bytes, hi - lo);
      }
    }
    slot_count = streamed > 0 ? (opt_.prefetch ? 2 : 1) : 0;  // double-buffered: one computes, one copies
  }
  for (int i = 0; i < slot_count; ++i) {
    auto s = std::make_unique<Slot>();
    s->arena = at::empty({slot_bytes}, at::TensorOptions().dtype(at::kByte).device(opt_.device));
#ifdef EO_WITH_CUDA
    if (cuda_) {
      EO_CUDA_CHECK(cudaEventCreate(&s->ready), "offload: cudaEventCreate");
      EO_CUDA_CHECK(cudaEventCreate(&s->released), "offload: cudaEventCreate");
    }
#endif
    slots_.push_back(std::move(s));
  }
  policy_ = std::make_unique<StagingPolicy>(static_cast<int>(blocks_.size()), static_cast<int>(slots_.size()), opt_.prefetch);
  for (const auto& b : blocks_)
    if (b && b->resident.defined()) policy_->set_resident(b->layer);
  const std::string where = homes_->describe(home_bytes());
  log::info("expert offload: " + std::to_string(moe_layers().size()) + " MoE blocks, " + where + "; " +
            std::to_string(slots_.size()) + " device slot(s) of " + human_bytes(double(slot_bytes)) +
            (grouped_ ? " (a group of " + std::to_string(opt_.group_size) + " experts each; blocks of " +
                            human_bytes(double(max_block)) + " stream group by group)"
             : slots_.size() > 1 ? " (prefetch " + std::to_string(slots_.size() - 1) + " ahead)"
                                 : std::string()) + "; " +
            std::to_string(resident_layers().size()) + " block(s) resident within the VRAM budget");
}

void ExpertOffloader::fill_arena(std::uint8_t* dst, const Block& b,
                                 const std::vector<std::array<QuantizedWeight, 3>>& experts) const {
  auto put = [&](const Piece& p, const at::Tensor& t) {
    const at::Tensor c = t.to(at::kCPU).contiguous();
    EO_CHECK(c.numel() * static_cast<std::int64_t>(c.element_size()) == p.bytes, "offload: size mismatch in layout");
    std::memcpy(dst + p.offset, c.data_ptr(), static_cast<std::size_t>(p.bytes));
  };
  for (std::size_t e = 0; e < experts.size(); ++e)
    for (int m = 0; m < 3; ++m) {
      const QuantizedWeight& q = experts[e][m];
      put(b.pieces[e][m][0], q.packed);
      put(b.pieces[e][m][1], q.stats());
      if (q.nested) put(b.pieces[e][m][2], q.nested->nested_absmax);
      if (q.global_scale.defined()) put(b.pieces[e][m][2], q.global_scale);
    }
}

int ExpertOffloader::promote_resident(std::int64_t budget) {
  std::vector<Block*> chosen;
  for (auto& b : blocks_) {
    if (!b || b->resident.defined() || b->bytes > budget) continue;
    chosen.push_back(b.get());
    budget -= b->bytes;
  }
  if (homes_->read_ahead_depth() > 0) {  // read them ahead, in order
    std::vector<int> layers;
    for (const Block* b : chosen) layers.push_back(b->layer);
    homes_->read_ahead(layers);
  }
  int promoted = 0;
  for (Block* b : chosen) {
    b->resident = at::empty({b->bytes}, at::TensorOptions().dtype(at::kByte).device(opt_.device));
    b->resident.copy_(at::from_blob(const_cast<std::uint8_t*>(homes_->acquire(b->layer)), {b->bytes}, at::kByte));  // synchronous
    homes_->release(b->layer);
    build_views(b->resident_views, *b, b->resident);
    if (policy_) policy_->set_resident(b->layer);
    ++promoted;
  }
  plan_reads();
  return promoted;
}

// The ring reads ahead exactly the blocks the next copies will take, in order: the policy's dry
// run along the schedule from the next stage() on (a step and a bit, enough to fill the ring).
void ExpertOffloader::plan_reads() {
  const int depth = homes_->read_ahead_depth();
  if (depth == 0 || !policy_) return;
  const std::size_t n = policy_->schedule().size();
  homes_->read_ahead(policy_->upcoming_copies(cursor_, static_cast<std::size_t>(depth), 2 * n + 1));
}

ExpertOffloader::~ExpertOffloader() {
#ifdef EO_WITH_CUDA
  if (cuda_) {
    cudaStreamSynchronize(cuda_->copy_stream.stream());
    for (auto& s : slots_) {
      cudaEventDestroy(s->ready);
      cudaEventDestroy(s->released);
    }
    std::vector<std::vector<std::pair<cudaEvent_t, cudaEvent_t>>*> lists{&cuda_->stall_events, &cuda_->copy_events};
    for (auto& c : cuda_->closed) {
      lists.push_back(&c.stall);
      lists.push_back(&c.copy);
    }
    for (auto* list : lists)
      for (auto& [a, b] : *list) {
        cudaEventDestroy(a);
        cudaEventDestroy(b);
      }
    for (auto e : cuda_->free_events) cudaEventDestroy(e);
  }
#endif
}

void ExpertOffloader::build_views(std::vector<std::array<QuantizedWeight, 3>>& views, const Block& block,
                                  const at::Tensor& arena, int first, int count, std::int64_t base) const {
  if (count < 0) count = static_cast<int>(block.meta.size()) - first;
  views.assign(block.meta.begin() + first, block.meta.begin() + first + count);
  for (std::size_t i = 0; i < views.size(); ++i)
    for (int m = 0; m < 3; ++m) {
      QuantizedWeight& q = views[i][m];
      const auto& p = block.pieces[static_cast<std::size_t>(first) + i][m];
      auto piece = [&](int k) { return arena.narrow(0, p[k].offset - base, p[k].bytes); };
      q.packed = piece(0).view({p[0].bytes, 1});
      if (q.nested) {
        q.nested->absmax_codes = piece(1);
        q.nested->nested_absmax = piece(2).view(at::kFloat);
        q.nested->nested_code = nested_code_;
      } else if (q.format != QuantFormat::Nf4) {
        q.scales = piece(1);
        if (q.format == QuantFormat::Nvfp4) q.global_scale = piece(2).view(at::kFloat);
      } else {
        q.absmax = piece(1).view(at::kFloat);
      }
    }
}

ExpertOffloader::Slot* ExpertOffloader::slot_holding(int layer) {
  for (auto& s : slots_)
    if (s->layer == layer) return s.get();
  return nullptr;
}

void ExpertOffloader::set_schedule(const std::vector<int>& order) {
  for (int l : order)
    EO_CHECK(l >= 0 && l < static_cast<int>(blocks_.size()) && blocks_[l], "offload: the step schedule stages layer ", l,
             ", which has no offloaded experts");
  policy_->set_schedule(order);
  cursor_ = 0;
  plan_reads();
}

void ExpertOffloader::copy_into(Slot& slot, int layer, int group) {
  const Block& b = *blocks_[layer];
  // The whole arena, or one group's range of it.
  const std::int64_t lo = group >= 0 ? b.groups[static_cast<std::size_t>(group)].first : 0;
  const std::int64_t bytes = group >= 0 ? b.groups[static_cast<std::size_t>(group)].second - lo : b.bytes;
  ++stats_.copies;
  stats_.copied_bytes += bytes;
  const std::uint8_t* home = homes_->acquire(layer) + lo;
  auto views = [&] {
    slot.layer = layer;
    slot.group = group;
    if (group < 0) return build_views(slot.views, b, slot.arena);
    const int first = group * opt_.group_size;
    build_views(slot.views, b, slot.arena, first, std::min(opt_.group_size, static_cast<int>(b.meta.size()) - first), lo);
  };
#ifdef EO_WITH_CUDA
  if (cuda_) {
    cudaStream_t cs = cuda_->copy_stream.stream();
    // The slot's previous block may still be read by kernels enqueued on the compute stream.
    EO_CUDA_CHECK(cudaStreamWaitEvent(cs, slot.released, 0), "offload: cudaStreamWaitEvent");
    cudaEvent_t start = cuda_->take(), end = cuda_->take();
    EO_CUDA_CHECK(cudaEventRecord(start, cs), "offload: cudaEventRecord");
    const bool paced = cuda_->pace_stamp.defined();
    if (paced) EO_CUDA_CHECK(offload::cuda::pace_begin(cuda_->pace_stamp.data_ptr<std::int64_t>(), cs), "offload: copy pace");
    EO_CUDA_CHECK(cudaMemcpyAsync(slot.arena.data_ptr(), home, static_cast<std::size_t>(bytes), cudaMemcpyHostToDevice, cs),
                  "offload: cudaMemcpyAsync (expert staging)");
    if (paced)
      EO_CUDA_CHECK(offload::cuda::pace_end(cuda_->pace_stamp.data_ptr<std::int64_t>(),
                                            static_cast<std::int64_t>(double(bytes) / opt_.copy_pace_gbps), cs),
                    "offload: copy pace");
    EO_CUDA_CHECK(cudaEventRecord(end, cs), "offload: cudaEventRecord");
    EO_CUDA_CHECK(cudaEventRecord(slot.ready, cs), "offload: cudaEventRecord");
    cuda_->copy_events.emplace_back(start, end);
    if (homes_->reuses_buffers()) {
      // The ring buffer is free again once this copy has read it: the reader waits on an event
      // of its own (the pooled ones are this thread's) before it reads another block into it.
      cudaEvent_t copied;
      EO_CUDA_CHECK(cudaEventCreateWithFlags(&copied, cudaEventDisableTiming), "offload: cudaEventCreate");
      EO_CUDA_CHECK(cudaEventRecord(copied, cs), "offload: cudaEventRecord");
      homes_->release(layer, [copied, device = opt_.device.index()] {
        cudaSetDevice(device);  // the reader thread's calls go to this rank's device
        const cudaError_t rc = cudaEventSynchronize(copied);
        cudaEventDestroy(copied);
        EO_CUDA_CHECK(rc, "offload: waiting for a copy out of the disk homes' ring");
      });
    } else {
      homes_->release(layer);
    }
    slot.copy_pending = true;
    views();
    return;
  }
#endif
  const auto t0 = std::chrono::steady_clock::now();
  std::memcpy(slot.arena.data_ptr(), home, static_cast<std::size_t>(bytes));
  stats_.copy_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  homes_->release(layer);
  views();
}

void ExpertOffloader::wait_ready(Slot& slot) {
  if (!slot.copy_pending) return;
  slot.copy_pending = false;
#ifdef EO_WITH_CUDA
  if (cuda_) {
    cudaStream_t compute = c10::cuda::getCurrentCUDAStream(opt_.device.index()).stream();
    cudaEvent_t before = cuda_->take(), after = cuda_->take();
    EO_CUDA_CHECK(cudaEventRecord(before, compute), "offload: cudaEventRecord");
    EO_CUDA_CHECK(cudaStreamWaitEvent(compute, slot.ready, 0), "offload: cudaStreamWaitEvent");
    EO_CUDA_CHECK(cudaEventRecord(after, compute), "offload: cudaEventRecord");
    cuda_->stall_events.emplace_back(before, after);
  }
#endif
}

void ExpertOffloader::stage_block(int layer) {
  EO_CHECK(layer >= 0 && layer < static_cast<int>(blocks_.size()) && blocks_[layer],
           "offload: stage(", layer, ") but layer ", layer, " has no offloaded experts");
  ++stats_.stage_calls;
  if (grouped_) return stage_grouped(layer);
  const std::vector<int>& schedule = policy_->schedule();
  std::size_t position = 0;
  if (!schedule.empty()) {
    position = cursor_;
    EO_CHECK(schedule[position] == layer, "offload: stage(", layer, ") at position ", position, " of the step schedule, which stages layer ",
             schedule[position], " there; the trainer must stage blocks in the order it handed over (set_schedule)");
    cursor_ = (cursor_ + 1) % schedule.size();
  }
  Slot* in_use = current_ >= 0 ? slot_holding(current_) : nullptr;
#ifdef EO_WITH_CUDA
  // Everything enqueued so far may read the block in use: mark the point after which its slot is free.
  if (cuda_ && in_use)
    EO_CUDA_CHECK(cudaEventRecord(in_use->released, c10::cuda::getCurrentCUDAStream(opt_.device.index()).stream()),
                  "offload: cudaEventRecord");
#else
  (void)in_use;
#endif
  current_ = layer;
  const Block& b = *blocks_[layer];
  Slot* hit = slot_holding(layer);
  // The policy says what to copy where: this block if it is not in a slot, then the prefetches.
  const std::vector<StagingPolicy::Copy> copies = policy_->stage(layer, position);
  if (b.resident.defined()) {
    ++stats_.resident_hits;
  } else if (hit) {
    ++stats_.slot_hits;
    wait_ready(*hit);
  }
  for (const auto& c : copies) {
    Slot& slot = *slots_[static_cast<std::size_t>(c.slot)];
    copy_into(slot, c.layer);
    if (c.layer == layer) wait_ready(slot);
  }
  for (std::size_t i = 0; i < slots_.size(); ++i)
    EO_CHECK(slots_[i]->layer == policy_->slot_layers()[i], "offload: slot ", i, " holds layer ", slots_[i]->layer,
             ", the staging policy says ", policy_->slot_layers()[i]);
  plan_reads();
}

ExpertOffloader::Slot* ExpertOffloader::slot_holding_group(int layer, int group) {
  for (auto& s : slots_)
    if (s->layer == layer && s->group == group) return s.get();
  return nullptr;
}

void ExpertOffloader::mark_released(Slot& slot) {
#ifdef EO_WITH_CUDA
  // Everything enqueued so far may read the slot: the point after which a copy may overwrite it.
  if (cuda_)
    EO_CUDA_CHECK(cudaEventRecord(slot.released, c10::cuda::getCurrentCUDAStream(opt_.device.index()).stream()),
                  "offload: cudaEventRecord");
#else
  (void)slot;
#endif
}

// Grouped stage(L): the schedule is checked as for whole blocks, the group in use is let go, and
// L's first group is copied ahead (a forward or recompute reads it first) unless a slot holds it.
// Groups are fetched on demand by expert_weight(); nothing crosses blocks, so the policy is unused.
void ExpertOffloader::stage_grouped(int layer) {
  const std::vector<int>& schedule = policy_->schedule();
  if (!schedule.empty()) {
    EO_CHECK(schedule[cursor_] == layer, "offload: stage(", layer, ") at position ", cursor_, " of the step schedule, which stages layer ",
             schedule[cursor_], " there; the trainer must stage blocks in the order it handed over (set_schedule)");
    cursor_ = (cursor_ + 1) % schedule.size();
  }
  Slot* in_use = current_ >= 0 && current_group_ >= 0 ? slot_holding_group(current_, current_group_) : nullptr;
  if (in_use) mark_released(*in_use);
  current_ = layer;
  current_group_ = -1;
  direction_ = 1;
  if (blocks_[layer]->resident.defined()) {
    ++stats_.resident_hits;
    return;
  }
  if (slot_holding_group(layer, 0)) {
    ++stats_.slot_hits;
    return;
  }
  // An empty slot, else one not holding the group just read (its last kernels may still run).
  Slot* target = slots_.front().get();
  for (auto& t : slots_)
    if (t->layer < 0 || t.get() != in_use) {
      target = t.get();
      if (t->layer < 0) break;
    }
  copy_into(*target, layer, 0);
}

// The first read of `group` since another group was read: the old group's slot is released after
// what was enqueued so far, `group` is copied in if no slot holds it (waited for), and the next
// group in the direction of reading (up in a forward, down in a backward) is copied into the other
// slot while `group` computes.
ExpertOffloader::Slot& ExpertOffloader::switch_group(int layer, int group) {
  const Block& b = *blocks_[layer];
  EO_CHECK(group >= 0 && group < static_cast<int>(b.groups.size()), "offload: no group ", group, " in layer ", layer);
  Slot* old = current_group_ >= 0 ? slot_holding_group(layer, current_group_) : nullptr;
  if (old) mark_released(*old);
  if (current_group_ >= 0) direction_ = group > current_group_ ? 1 : -1;
  current_group_ = group;
  Slot* s = slot_holding_group(layer, group);
  if (s) {
    ++stats_.slot_hits;
  } else {
    s = slots_.front().get();
    for (auto& t : slots_)
      if (t.get() != old) { s = t.get(); break; }
    copy_into(*s, layer, group);
  }
  wait_ready(*s);
  const int next = group + direction_;
  if (slots_.size() > 1 && next >= 0 && next < static_cast<int>(b.groups.size()) && !slot_holding_group(layer, next))
    for (auto& t : slots_)
      if (t.get() != s) {
        copy_into(*t, layer, next);
        break;
      }
  return *s;
}

const QuantizedWeight& ExpertOffloader::expert_weight(int layer, int expert, model::ExpertMatrix m) {
  EO_CHECK(layer >= 0 && layer < static_cast<int>(blocks_.size()) && blocks_[layer], "offload: layer ", layer,
           " has no offloaded experts");
  Block& b = *blocks_[layer];
  EO_CHECK(expert >= 0 && expert < static_cast<int>(b.meta.size()), "offload: no expert ", expert, " in layer ", layer);
  if (b.resident.defined()) return b.resident_views[expert][static_cast<int>(m)];
  // Only the block in use may be read: anything else means a stage() was skipped, and reading a
  // slot that now holds another block would give silently wrong results.
  EO_CHECK(layer == current_ && (grouped_ || slot_holding(layer)), "offload: layer ", layer, "'s experts were read while layer ",
           current_, " is staged (a block ran without stage(); is gradient checkpointing on?)");
  if (grouped_) {
    const int group = expert / opt_.group_size;
    Slot& s = group == current_group_ ? *slot_holding_group(layer, group) : switch_group(layer, group);
    return s.views[static_cast<std::size_t>(expert - group * opt_.group_size)][static_cast<int>(m)];
  }
  return slot_holding(layer)->views[expert][static_cast<int>(m)];
}

std::int64_t ExpertOffloader::placement(int layer) {
  if (layer < 0 || layer >= static_cast<int>(blocks_.size()) || !blocks_[layer]) return 0;
  if (blocks_[layer]->resident.defined()) return 0;
  for (std::size_t i = 0; i < slots_.size(); ++i)
    if (slots_[i]->layer == layer) return static_cast<std::int64_t>(i) + 1;
  return -1;
}

void ExpertOffloader::end_step() {
  {
    const HomeReads d = homes_->take_reads();
    stats_.disk_reads = d.reads;
    stats_.disk_read_bytes = d.read_bytes;
    stats_.disk_read_seconds = d.read_seconds;
    stats_.disk_wait_seconds = d.wait_seconds;
    stats_.disk_unplanned = d.unplanned;
    stats_.disk_ring_hits = d.ring_hits;
  }
#ifdef EO_WITH_CUDA
  if (cuda_) {
    cuda_->closed.push_back({std::move(cuda_->stall_events), std::move(cuda_->copy_events)});
    cuda_->stall_events.clear();
    cuda_->copy_events.clear();
  }
#endif
  closed_.push_back(stats_);
  stats_ = OffloadStats{};
}

OffloadStats ExpertOffloader::take_step_stats() {
  if (closed_.empty()) end_step();
  OffloadStats out = closed_.front();
  closed_.pop_front();
#ifdef EO_WITH_CUDA
  if (cuda_) {
    CudaState::Closed c = std::move(cuda_->closed.front());
    cuda_->closed.pop_front();
    // Each pair's second event is recorded after its first on the same stream.
    auto time = [this](std::vector<std::pair<cudaEvent_t, cudaEvent_t>>& pairs, double& seconds) {
      for (auto& [first, second] : pairs) {
        EO_CUDA_CHECK(cudaEventSynchronize(second), "offload: cudaEventSynchronize");
        float ms = 0;
        if (cudaEventElapsedTime(&ms, first, second) == cudaSuccess) seconds += ms / 1e3;
        cuda_->free_events.push_back(first);
        cuda_->free_events.push_back(second);
      }
    };
    time(c.copy, out.copy_seconds);
    time(c.stall, out.stall_seconds);
  }
  out.memcpy_link = !cuda_;
#else
  out.memcpy_link = true;
#endif
  out.resident_blocks = static_cast<std::int64_t>(resident_layers().size());
  out.disk_homes = homes_on_disk();
  return out;
}

nlohmann::json OffloadStats::to_metrics() const {
  nlohmann::json m;
  m["staged_bytes"] = copied_bytes;
  m["stagings"] = copies;
  m["stage_calls"] = stage_calls;
  m["h2d_gbps"] = copy_seconds > 0 ? double(copied_bytes) / copy_seconds / 1e9 : 0.0;
  if (memcpy_link) m["staging_link"] = "memcpy";
  m["copy_s"] = copy_seconds;
  m["stall_s"] = stall_seconds;
  m["resident_blocks"] = resident_blocks;
  if (disk_homes) {
    m["disk_read_bytes"] = disk_read_bytes;
    m["disk_reads"] = disk_reads;
    m["disk_ring_hits"] = disk_ring_hits;  // copies whose block was still in the ring: not read again
    m["disk_gbps"] = disk_read_seconds > 0 ? double(disk_read_bytes) / disk_read_seconds / 1e9 : 0.0;
    m["disk_wait_s"] = disk_wait_seconds;
  }
  return m;
}

std::int64_t ExpertOffloader::home_bytes() const {
  std::int64_t n = 0;
  for (const auto& b : blocks_) n += b ? b->bytes : 0;
  return n;
}

std::int64_t ExpertOffloader::block_bytes(int layer) const {
  return layer >= 0 && layer < static_cast<int>(blocks_.size()) && blocks_[layer] ? blocks_[layer]->bytes : 0;
}

std::int64_t ExpertOffloader::slot_bytes() const {
  std::int64_t n = 0;
  for (const auto& s : slots_) n += s->arena.numel();
  return n;
}

std::int64_t ExpertOffloader::resident_bytes() const {
  std::int64_t n = 0;
  for (const auto& b : blocks_) n += b && b->resident.defined() ? b->bytes : 0;
  return n;
}

std::vector<int> ExpertOffloader::moe_layers() const {
  std::vector<int> out;
  for (const auto& b : blocks_)
    if (b) out.push_back(b->layer);
  return out;
}

std::vector<int> ExpertOffloader::resident_layers() const {
  std::vector<int> out;
  for (const auto& b : blocks_)
    if (b && b->resident.defined()) out.push_back(b->layer);
  return out;
}

std::vector<int> ExpertOffloader::staged_layers() const {
  std::vector<int> out;
  for (const auto& s : slots_)
    if (s->layer >= 0) out.push_back(s->layer);
  return out;
}

}  // namespace eo::offload
