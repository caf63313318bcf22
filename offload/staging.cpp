#include "offload/staging.h"

#include <algorithm>

#include "common/error.h"

namespace eo::offload {

StagingPolicy::StagingPolicy(int num_layers, int num_slots, bool prefetch)
    : slots_(static_cast<std::size_t>(std::max(0, num_slots)), -1),
      resident_(static_cast<std::size_t>(std::max(0, num_layers)), 0),
      prefetch_(prefetch) {}

void StagingPolicy::set_schedule(std::vector<int> order) { schedule_ = std::move(order); }

void StagingPolicy::set_resident(int layer) { resident_.at(static_cast<std::size_t>(layer)) = 1; }

int StagingPolicy::slot_of(int layer) const {
  for (std::size_t s = 0; s < slots_.size(); ++s)
    if (slots_[s] == layer) return static_cast<int>(s);
  return -1;
}

// The streamed layers stage() will be called with after schedule position `from_position`, in
// order of their next use, each once, `current` left out. The walk goes round the schedule once:
// the next step repeats it, so the list is exact across the step boundary too. Budget-resident
// blocks are skipped: they are never copied.
std::vector<int> StagingPolicy::upcoming_layers(std::size_t from_position, int current) const {
  std::vector<int> out;
  if (schedule_.empty()) return out;
  std::vector<char> seen(resident_.size(), 0);
  if (current >= 0) seen[static_cast<std::size_t>(current)] = 1;
  for (std::size_t k = 1; k <= schedule_.size(); ++k) {
    const int l = schedule_[(from_position + k) % schedule_.size()];
    if (seen[static_cast<std::size_t>(l)] || resident(l)) continue;
    seen[static_cast<std::size_t>(l)] = 1;
    out.push_back(l);
  }
  return out;
}

// A slot whose block is not in `keep`: an empty one if any, else the one whose block `future`
// needs last. Ties go to the lowest slot.
int StagingPolicy::slot_to_overwrite(const std::vector<int>& future, const std::vector<int>& keep) const {
  int best = -1;
  std::size_t best_rank = 0;
  for (std::size_t s = 0; s < slots_.size(); ++s) {
    const int layer = slots_[s];
    if (layer >= 0 && std::find(keep.begin(), keep.end(), layer) != keep.end()) continue;
    const auto it = std::find(future.begin(), future.end(), layer);
    const std::size_t rank = layer < 0 ? future.size() + 1 : static_cast<std::size_t>(it - future.begin());
    if (best < 0 || rank > best_rank) {
      best = static_cast<int>(s);
      best_rank = rank;
    }
  }
  EO_CHECK(best >= 0, "offload: every one of the ", slots_.size(), " slots holds a block that must stay");
  return best;
}

std::vector<StagingPolicy::Copy> StagingPolicy::stage(int layer, std::size_t position) {
  std::vector<Copy> copies;
  const int previous = current_;
  current_ = layer;
  // Every streamed block still to come, soonest first: it says what to prefetch and what to evict.
  const std::vector<int> future = upcoming_layers(position, layer);
  if (!resident(layer) && slot_of(layer) < 0) {
    // A miss (the first stage, synchronous mode, or no schedule). Keep the slot in use if there is
    // another: overwriting it would wait for the kernels reading it.
    std::vector<int> keep;
    if (slots_.size() > 1 && previous >= 0) keep.push_back(previous);
    const int target = slot_to_overwrite(future, keep);
    slots_[static_cast<std::size_t>(target)] = layer;
    copies.push_back({target, layer});
  }
  // Prefetch: those of the next `depth` streamed blocks that are not in a slot are copied into
  // slots holding neither this block nor any of the `depth`. With 1 + depth slots there are always
  // enough: this block and those of the `depth` already in slots fill at most 1 + depth - missing.
  if (!prefetch_ || slots_.empty()) return copies;
  const std::size_t depth = std::min(slots_.size() - 1, future.size());
  std::vector<int> keep(future.begin(), future.begin() + static_cast<std::ptrdiff_t>(depth));
  keep.push_back(layer);
  for (std::size_t i = 0; i < depth; ++i)
    if (slot_of(future[i]) < 0) {
      const int target = slot_to_overwrite(future, keep);
      slots_[static_cast<std::size_t>(target)] = future[i];
      copies.push_back({target, future[i]});
    }
  return copies;
}

std::vector<int> StagingPolicy::upcoming_copies(std::size_t next_position, std::size_t max_copies,
                                                std::size_t max_stages) const {
  std::vector<int> out;
  if (schedule_.empty()) return out;
  StagingPolicy dry = *this;
  for (std::size_t k = 0; k < max_stages && out.size() < max_copies; ++k) {
    const std::size_t pos = (next_position + k) % schedule_.size();
    for (const Copy& c : dry.stage(schedule_[pos], pos))
      if (out.size() < max_copies) out.push_back(c.layer);
  }
  return out;
}

std::int64_t steady_copies_per_step(const std::vector<int>& order, int num_layers, int num_slots, bool prefetch,
                                    const std::vector<int>& resident) {
  StagingPolicy p(num_layers, num_slots, prefetch);
  for (int l : resident) p.set_resident(l);
  p.set_schedule(order);
  std::int64_t copies = 0;
  for (int step = 0; step < 3; ++step) {
    copies = 0;
    for (std::size_t pos = 0; pos < order.size(); ++pos) copies += static_cast<std::int64_t>(p.stage(order[pos], pos).size());
  }
  return copies;
}

}  // namespace eo::offload
