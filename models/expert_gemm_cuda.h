// The portable grouped GEMM of the experts: CUTLASS's sm80 tensor-core grouped kernel (it runs on
// sm_80 to sm_120), bf16 in and out, fp32 accumulation. Every problem's size and pointers are
// computed on the device from the groups' cumulative row ends, so nothing is read back by the host
// and the call can be captured in a CUDA graph: at::_grouped_mm has a kernel like that only on
// sm_90 / sm_100 and elsewhere copies the offsets to the host and loops over experts.
// Plain pointers and a stream, like grouped_mm_cuda.h; models/expert_gemm.h is the tensor API.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace eo::expert_gemm::cuda {

// cudaSuccess where this build holds machine code (or PTX) the current device can run; else
// cudaErrorNoKernelImageForDevice (eo-ddp was built for other architectures).
cudaError_t probe_kernel_image();

// Device bytes of the per-call problem table (sizes, pointers, leading dimensions) for E groups.
std::size_t workspace_bytes(int experts);

// out[m, :] = a[m, :] · B_e for the rows m of group e: [offsets[e-1], offsets[e]) (offsets: E int32
// cumulative row ends on the device, offsets[-1] = 0; rows from offsets[E-1] to M are written zero).
// a: [M, K] row-major; out: [M, N] row-major; B_e at b + e·K·N, [K, N] row-major, or when b_nk
// [N, K] row-major (B_e^T stored). Needs K % 8 == 0, N % 8 == 0 and 16-byte aligned pointers.
cudaError_t grouped_rows(const void* a, const void* b, bool b_nk, const int* offsets, int experts, void* out,
                         std::int64_t M, std::int64_t N, std::int64_t K, void* workspace, cudaStream_t s);

// out[e] = a[rows of e]^T · g[rows of e]: [Ka, N] per group, the weight gradient of grouped_rows
// (a group with no rows gives zeros). a: [M, Ka] row-major; g: [M, N] row-major; out: [E, Ka, N]
// row-major. Needs Ka % 8 == 0, N % 8 == 0 and 16-byte aligned pointers.
cudaError_t grouped_contract(const void* a, const void* g, const int* offsets, int experts, void* out, std::int64_t M,
                             std::int64_t Ka, std::int64_t N, void* workspace, cudaStream_t s);

}  // namespace eo::expert_gemm::cuda
