// The grouped GEMM of frozen NF4 experts with the dequantisation inside the mainloop: each tile of
// an expert's weight is decoded from its packed 4-bit codes and absmax (plain or nested) into
// shared memory as bf16 and multiplied there with tensor cores (mma.sync, fp32 accumulation), so no
// bf16 bank of the experts is written or read. The two products frozen experts need, with W_e
// stored [N, K] row-major as the homes store it (nf4.h's layout, Nf4Source / Nf4Layout):
//   forward   out[rows of e] = a[rows of e] · W_e^T   (a [M, K], out [M, N])
//   backward  out[rows of e] = a[rows of e] · W_e     (a [M, N], out [M, K]: dX; no weight gradient)
// Like expert_gemm_cuda.h, the groups' sizes are read on the device from int32 cumulative row ends
// (nothing read by the host, so a CUDA graph can hold the call). bf16 on sm_80 and newer.
// Plain pointers and a stream; models/nf4_expert_gemm.h is the tensor API. Design: docs/design.md.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "models/nf4_cuda.h"

namespace eo::nf4_gemm::cuda {

using nf4::cuda::Nf4Layout;
using nf4::cuda::Nf4Source;

// cudaSuccess where the build's code that runs on the current device is sm_80 or newer (bf16
// mma.sync); cudaErrorNoKernelImageForDevice otherwise (older code, or none for this device).
cudaError_t available();

// Device bytes of the per-call tile table for E groups (E + 1 int32, 16-byte aligned).
std::size_t workspace_bytes(int experts);

enum class Product { kForward, kBackward };

// One call over E experts whose weights W_e [N, K] (layout.n == N * K, every expert alike) are
// sources[e] (a DEVICE array of E entries: the pointers are read by the kernel, so the table is
// built once and the call can be captured). Rows of group e: [offsets[e-1], offsets[e]) (offsets:
// E int32 cumulative row ends on the device, offsets[-1] = 0, clamped to [0, M]); rows from
// offsets[E-1] to M are written zero. kForward: a [M, K] -> out [M, N]; kBackward: a [M, N] ->
// out [M, K]; a and out bf16 row-major. Needs N % 8 == 0, K % 8 == 0, the blocksize a power of two
// >= 8 (bitsandbytes' are) and the nested one a power of two, a and out 16-byte aligned, every packed
// pointer 4-byte aligned, workspace 16-byte aligned.
cudaError_t grouped(Product product, const void* a, const Nf4Source* sources, const Nf4Layout& layout,
                    std::int64_t N, std::int64_t K, const int* offsets, int experts, void* out, std::int64_t M,
                    void* workspace, cudaStream_t stream);

}  // namespace eo::nf4_gemm::cuda
