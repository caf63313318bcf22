// What the grouped GEMM kernels (expert_gemm_cuda.cu, nf4_expert_gemm_cuda.cu) share about their
// row groups: group e's rows, clamped to [0, M); and rows [offsets[E-1], M) of the output, which no
// group covers, written zero, so an output never carries an earlier call's values there. Only .cu
// files include it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace eo::grouped_rows::cuda {

// Group e's rows [start, end) from the int32 cumulative row ends, clamped to [0, M).
__device__ __forceinline__ void group_rows(const int* offsets, int e, std::int64_t M, std::int64_t& start,
                                           std::int64_t& end) {
  start = e == 0 ? 0 : offsets[e - 1];
  end = offsets[e];
  start = start < 0 ? 0 : (start > M ? M : start);
  end = end < start ? start : (end > M ? M : end);
}

// out: [M, N] of 2-byte values, N % 8 == 0 and 16-byte aligned, seen as 16-byte words; offsets: E
// int32 cumulative row ends on the device. Grid-stride: a few blocks do it (usually no row is left).
static __global__ void zero_uncovered(uint4* out, const int* offsets, int experts, std::int64_t M, std::int64_t N) {
  std::int64_t covered = experts > 0 ? offsets[experts - 1] : 0;
  covered = covered < 0 ? 0 : (covered > M ? M : covered);
  const std::int64_t first = covered * N / 8, words = M * N / 8;
  for (std::int64_t i = first + blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < words;
       i += std::int64_t(gridDim.x) * blockDim.x)
    out[i] = make_uint4(0, 0, 0, 0);
}

}  // namespace eo::grouped_rows::cuda
