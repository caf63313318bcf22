// The portable grouped GEMM of the experts: CUTLASS's tensor-core grouped kernel, bf16 or fp16 in
// and out, fp32 accumulation; its sm80 form (sm_80 to sm_120) for both, its sm75 form for fp16 on
// the T4. Every problem's size and pointers are
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

// The operands' dtype (both operands and the output).
enum class DType { BF16, F16 };

// The architecture of this build's code that runs on the current device, as CUDA numbers it (75,
// 80, 86, 90, ...): the SASS's, or the PTX's where the driver JIT-compiles it (a compute_75 PTX
// build on an sm_90 card gives 75); 0 where the build has none for it.
int kernel_arch();
// Whether the kernels take `dtype` on the current device: bf16 where kernel_arch() is 80 or more
// (sm80's bf16 mma), fp16 where it is 75 or more (sm75's fp16 mma). The one rule for every caller.
bool takes(DType dtype);

// Device bytes of the per-call problem table (sizes, pointers, leading dimensions) for E groups.
std::size_t workspace_bytes(int experts);

// out[m, :] = a[m, :] · B_e for the rows m of group e: [offsets[e-1], offsets[e]) (offsets: E int32
// cumulative row ends on the device, offsets[-1] = 0; rows from offsets[E-1] to M are written zero).
// a: [M, K] row-major; out: [M, N] row-major; B_e at b + e·K·N, [K, N] row-major, or when b_nk
// [N, K] row-major (B_e^T stored). Needs K % 8 == 0, N % 8 == 0 and 16-byte aligned pointers.
// Needs takes(dtype) (else cudaErrorNoKernelImageForDevice).
cudaError_t grouped_rows(DType dtype, const void* a, const void* b, bool b_nk, const int* offsets, int experts,
                         void* out, std::int64_t M, std::int64_t N, std::int64_t K, void* workspace, cudaStream_t s);

// out[e] = a[rows of e]^T · g[rows of e]: [Ka, N] per group, the weight gradient of grouped_rows
// (a group with no rows gives zeros). a: [M, Ka] row-major; g: [M, N] row-major; out: [E, Ka, N]
// row-major. Needs Ka % 8 == 0, N % 8 == 0, 16-byte aligned pointers and takes(dtype).
cudaError_t grouped_contract(DType dtype, const void* a, const void* g, const int* offsets, int experts, void* out,
                             std::int64_t M, std::int64_t Ka, std::int64_t N, void* workspace, cudaStream_t s);

}  // namespace eo::expert_gemm::cuda
