// float64 reference of y = a · B_e on row groups (models/grouped_mm.h): each expert's rows
// times its matrix, on the CPU in float64. Rows past the last group are zero. Shared by the CPU
// (GroupedMm.*) and GPU (Cuda.SmallKGroupedMm*) suites.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace eo::testing {

inline at::Tensor grouped_mm_f64(const at::Tensor& a, const at::Tensor& b, const std::vector<std::int64_t>& counts) {
  const at::Tensor a64 = a.detach().to(at::kCPU, at::kDouble), b64 = b.detach().to(at::kCPU, at::kDouble);
  at::Tensor y = at::zeros({a.size(0), b.size(2)}, a64.options());
  std::int64_t row = 0;
  for (std::size_t e = 0; e < counts.size(); ++e) {
    if (counts[e] > 0) y.narrow(0, row, counts[e]).copy_(at::mm(a64.narrow(0, row, counts[e]), b64[e]));
    row += counts[e];
  }
  return y;
}

inline at::Tensor offsets_of(const std::vector<std::int64_t>& counts, const at::Device& dev) {
  return at::tensor(counts, at::kLong).cumsum(0).to(at::kInt).to(dev);
}

}  // namespace eo::testing
