#include "runtime/fault_hooks.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <limits>
#include <utility>

#include "common/fault_seam.h"

namespace eo {
namespace {

// Both, `first` first; either alone where the other is unset.
template <class... Args>
std::function<void(Args...)> both(std::function<void(Args...)> first, std::function<void(Args...)> second) {
  if (!first) return second;
  if (!second) return first;
  return [first = std::move(first), second = std::move(second)](Args... args) {
    first(args...);
    second(args...);
  };
}

std::function<bool(std::int64_t, int)> either(std::function<bool(std::int64_t, int)> first,
                                              std::function<bool(std::int64_t, int)> second) {
  if (!first) return second;
  if (!second) return first;
  return [first = std::move(first), second = std::move(second)](std::int64_t step, int rank) {
    const bool a = first(step, rank);
    return second(step, rank) || a;
  };
}

}  // namespace

TrainHooks with_fault_plan(TrainHooks hooks) {
  const faults::Plan& plan = faults::plan();
  hooks.before_training = both(std::move(hooks.before_training), plan.before_training);
  hooks.poison_loss = either(std::move(hooks.poison_loss), plan.at_step);
  hooks.overflow = either(std::move(hooks.overflow), plan.overflow_at);
  hooks.in_step_work = both(std::move(hooks.in_step_work), plan.in_step_work);
  hooks.after_queue = both(std::move(hooks.after_queue), plan.after_queue);
  if (const std::int64_t at = plan.nan_state_at; at >= 0) {
    // A NaN in the LoRA, as a bad update would leave.
    std::function<void(std::int64_t, const std::vector<at::Tensor>&)> corrupt = [at](std::int64_t step,
                                                                                   const std::vector<at::Tensor>& params) {
      if (step != at || params.empty()) return;  // empty: every LoRA parameter is held on the host
      at::NoGradGuard ng;
      params.front().view(-1).narrow(0, 0, 1).fill_(std::numeric_limits<float>::quiet_NaN());
    };
    hooks.after_update = both(std::move(hooks.after_update), std::move(corrupt));
  }
  return hooks;
}

}  // namespace eo
