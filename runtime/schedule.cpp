#include "runtime/schedule.h"

#include <sstream>

#include "common/error.h"

namespace eo {

StepSchedule make_step_schedule(int blocks, int micro_batches, StepOrder order) {
  EO_CHECK(blocks > 0 && micro_batches > 0, "step schedule: need at least one block and one micro-batch, got ", blocks,
           " and ", micro_batches);
  StepSchedule s;
  s.blocks = blocks;
  s.micro_batches = micro_batches;
  s.order = order;
  using K = BlockUse::Kind;
  if (order == StepOrder::LayerMajor) {
    for (int i = 0; i < blocks; ++i)
      for (int m = 0; m < micro_batches; ++m) s.uses.push_back({K::Forward, i, m});
    for (int m = 0; m < micro_batches; ++m) s.uses.push_back({K::Loss, -1, m});
    for (int i = blocks - 1; i >= 0; --i)
      for (int m = 0; m < micro_batches; ++m) s.uses.push_back({K::Backward, i, m});
  } else {
    for (int m = 0; m < micro_batches; ++m) {
      for (int i = 0; i < blocks; ++i) s.uses.push_back({K::Forward, i, m});
      s.uses.push_back({K::Loss, -1, m});
      for (int i = blocks - 1; i >= 0; --i) s.uses.push_back({K::Backward, i, m});
    }
  }
  return s;
}

std::vector<int> StepSchedule::staging_order(const std::vector<bool>& stages) const {
  std::vector<int> out;
  int last = -1;
  for (const BlockUse& u : uses) {
    if (u.kind == BlockUse::Kind::Loss) continue;
    if (u.block == last) continue;
    last = u.block;
    if (u.block < static_cast<int>(stages.size()) && stages[u.block]) out.push_back(u.block);
  }
  return out;
}

std::vector<std::size_t> StepSchedule::last_backward_use() const {
  std::vector<std::size_t> out(blocks, 0);
  for (std::size_t k = 0; k < uses.size(); ++k)
    if (uses[k].kind == BlockUse::Kind::Backward) out[uses[k].block] = k;
  return out;
}

std::string StepSchedule::describe() const {
  std::ostringstream o;
  for (std::size_t k = 0; k < uses.size(); ++k) {
    const BlockUse& u = uses[k];
    if (k) o << ' ';
    if (u.kind == BlockUse::Kind::Loss) o << 'L' << u.micro;
    else o << (u.kind == BlockUse::Kind::Forward ? 'F' : 'B') << u.block << ':' << u.micro;
  }
  return o.str();
}

}  // namespace eo
