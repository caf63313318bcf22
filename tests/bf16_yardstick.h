// A bf16 path's gradients judged against fp32 math beside a trusted bf16 path: both round, so
// neither equals the fp32 gradients, but a path with a wrong term is further off than rounding
// puts the trusted one. Shared by the GPU suites (the grouped expert path against the
// per-expert loop) and checked on the CPU (Bf16Yardstick.* in test_moe_compute).
#pragma once

#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace eo::testing {

// Each tensor: `got`'s distance to `ref` (fp32) at most 3x `trusted`'s, or 2% of ref's norm.
// All tensors together: at most 1.5x trusted's total distance, plus 0.1% of the total norm.
// (One tensor's ratio is noisy where rounding dominates its gradient; the total is not.)
inline void expect_bf16_no_worse(const std::vector<std::string>& names, const std::vector<at::Tensor>& got,
                                 const std::vector<at::Tensor>& trusted, const std::vector<at::Tensor>& ref) {
  ASSERT_EQ(got.size(), ref.size());
  ASSERT_EQ(trusted.size(), ref.size());
  ASSERT_EQ(names.size(), ref.size());
  double got_sq = 0, trusted_sq = 0, norm_sq = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const at::Tensor r = ref[i].detach().to(at::kCPU, at::kDouble);
    const double scale = r.norm().item<double>();
    const double got_err = (got[i].detach().to(at::kCPU, at::kDouble) - r).norm().item<double>();
    const double trusted_err = (trusted[i].detach().to(at::kCPU, at::kDouble) - r).norm().item<double>();
    got_sq += got_err * got_err;
    trusted_sq += trusted_err * trusted_err;
    norm_sq += scale * scale;
    EXPECT_LE(got_err, std::max(3 * trusted_err, 2e-2 * scale))
        << names[i] << ": " << got_err / scale << " of the fp32 norm away, the trusted path " << trusted_err / scale;
  }
  EXPECT_LE(std::sqrt(got_sq), 1.5 * std::sqrt(trusted_sq) + 1e-3 * std::sqrt(norm_sq))
      << "all tensors: " << std::sqrt(got_sq / norm_sq) << " of the fp32 norm away, the trusted path "
      << std::sqrt(trusted_sq / norm_sq);
}

}  // namespace eo::testing
