// How often something happens during a run, in optimizer steps.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>

namespace eo {

// eval_steps / evals_per_epoch / saves_per_epoch as a step interval: N steps, a fraction of the
// run (rounded up, as transformers does), or k times per epoch of steps_per_epoch steps. 0 = never.
inline std::int64_t step_interval(std::optional<double> steps, std::optional<int> per_epoch, double steps_per_epoch,
                                  std::int64_t total) {
  if (steps) return *steps >= 1 ? static_cast<std::int64_t>(*steps) : static_cast<std::int64_t>(std::ceil(*steps * double(total)));
  if (per_epoch) return std::max<std::int64_t>(1, static_cast<std::int64_t>(std::ceil(steps_per_epoch / *per_epoch)));
  return 0;
}

}  // namespace eo
