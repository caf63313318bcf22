// A grouped GEMM for a small contraction (the LoRA rank): out = a · B_e on row groups, bf16 in
// and out, fp32 accumulation on the tensor cores. Plain pointers and a stream, like fused_cuda.h.
//
// libtorch's grouped GEMM (CUTLASS) ran these shapes, K = r or 2r against outputs of thousands of
// columns, at 14-18% of the H200's memory rate (eo-lora-gemm, docs/benchmarks.md): its tiles are
// sized for a long K. Here a thread block's output tile is 64 x 128 and its whole K (at most 64)
// sits in shared memory, so the kernel runs at the pace of writing the output.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace eo::grouped_mm::cuda {

// The largest contraction the kernel takes (K is padded to 16 inside; callers check K % 8 == 0).
constexpr int kMaxK = 64;
// The most experts (groups) it takes: their row ends sit in shared memory.
constexpr int kMaxExperts = 1024;

// out[m, n] = sum_k a[m, k] · B_e[k, n] for every row m with offsets[e-1] <= m < offsets[e]
// (offsets: E int32 cumulative row ends on the device, offsets[-1] = 0; rows at or past
// offsets[E-1] are written zero). a: [M, K] row-major; out: [M, N] row-major; B_e at
// b + e * (K * N): [K, N] row-major when b_nk is false, [N, K] row-major (B_e^T stored) when
// true. All bf16; K % 8 == 0, K <= kMaxK, N % 8 == 0, experts <= kMaxExperts, pointers 16-byte
// aligned. Needs sm_80+.
cudaError_t small_k_grouped_mm(const void* a, const void* b, bool b_nk, const int* offsets, int experts, void* out,
                               std::int64_t M, std::int64_t N, int K, cudaStream_t s);

}  // namespace eo::grouped_mm::cuda
