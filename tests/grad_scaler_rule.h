// GradScaler.update's rule in float64, written out from torch's documentation (defaults: 2^16,
// growth x2, backoff x0.5): an overflow multiplies the scale by the backoff factor and resets the
// count of clean steps; a clean step counts, and the growth_interval-th in a row multiplies the
// scale by the growth factor. The independent reference of the loss-scale tests.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace eo::testing {

// The scale each step's loss is multiplied by, one step per flag ('1': that step overflows);
// the scale and clean-step count after the last step go to *final_scale / *final_tracker.
inline std::vector<double> grad_scaler_scales(const std::string& flags, std::int64_t interval, double* final_scale = nullptr,
                                              std::int64_t* final_tracker = nullptr) {
  double scale = 65536.0;
  std::int64_t clean = 0;
  std::vector<double> used;
  for (char f : flags) {
    used.push_back(scale);
    if (f == '1') {
      scale *= 0.5;
      clean = 0;
    } else if (++clean == interval) {
      scale *= 2.0;
      clean = 0;
    }
  }
  if (final_scale) *final_scale = scale;
  if (final_tracker) *final_tracker = clean;
  return used;
}

}  // namespace eo::testing
