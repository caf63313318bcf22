// The offload engine's one staging policy as a plain value: which block each stage() copies into
// which device slot, apart from the copies themselves (design.md §2.3). The engine runs it for
// real; the disk homes' read-ahead and the memory plan's "disk reads per step" run it dry, so the
// three never disagree about what is copied when.
//
// The rule: a block already in a slot (or budget-resident) is a hit; a miss copies the block into
// a slot holding neither the block just in use (when there is another slot) nor — with prefetch —
// any of the next `slots - 1` streamed blocks of the schedule, which are then copied too. The slot
// overwritten is an empty one, else the one whose block the schedule needs last (Belady's rule:
// the order is known, so this is exact). Ties go to the lowest slot, so every choice is
// deterministic.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace eo::offload {

// The device slots a run asks for: one, or with prefetch one more per block staged ahead.
inline int slots_asked(bool prefetch, int prefetch_depth) { return prefetch ? 1 + prefetch_depth : 1; }
// ... and those it makes: never more than the blocks it streams (with that many, each stays put).
inline int device_slots(bool prefetch, int prefetch_depth, int streamed_blocks) {
  const int asked = slots_asked(prefetch, prefetch_depth);
  return asked < streamed_blocks ? asked : streamed_blocks;
}

class StagingPolicy {
 public:
  // `num_layers` layers (any of which may be staged), `num_slots` device slots.
  StagingPolicy(int num_layers, int num_slots, bool prefetch);

  // The staging order of one optimizer step, repeating every step (empty: unscheduled, nothing is
  // prefetched). The caller has checked every entry is a valid layer.
  void set_schedule(std::vector<int> order);
  const std::vector<int>& schedule() const { return schedule_; }
  // A budget-resident block is never copied nor prefetched.
  void set_resident(int layer);
  bool resident(int layer) const { return resident_[static_cast<std::size_t>(layer)] != 0; }

  struct Copy {
    int slot = -1, layer = -1;
    bool operator==(const Copy& o) const { return slot == o.slot && layer == o.layer; }
  };
  // One stage(layer) at schedule position `position` (ignored without a schedule): the copies it
  // makes, in order (a miss's own copy first, then the prefetches); the slots are updated.
  std::vector<Copy> stage(int layer, std::size_t position);

  // The layers the next stage() calls along the schedule — the first at position `next_position`,
  // on into the following steps — will copy, in order, without changing anything: at most
  // `max_copies`, looking at most `max_stages` calls ahead. Empty without a schedule.
  std::vector<int> upcoming_copies(std::size_t next_position, std::size_t max_copies, std::size_t max_stages) const;

  const std::vector<int>& slot_layers() const { return slots_; }  // -1: empty
  int slot_of(int layer) const;  // -1 when not in a slot
  int current() const { return current_; }

 private:
  std::vector<int> upcoming_layers(std::size_t from_position, int current) const;
  int slot_to_overwrite(const std::vector<int>& future, const std::vector<int>& keep) const;

  std::vector<int> slots_;
  std::vector<char> resident_;
  std::vector<int> schedule_;
  int current_ = -1;
  bool prefetch_ = true;
};

// Copies in one optimizer step once the slots are warm: a dry run of three steps from empty slots
// along `order` (MoE layers < num_layers), the last one counted. `resident`: budget-resident layers.
std::int64_t steady_copies_per_step(const std::vector<int>& order, int num_layers, int num_slots, bool prefetch,
                                    const std::vector<int>& resident = {});

}  // namespace eo::offload
