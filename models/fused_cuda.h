// Fused elementwise CUDA kernels for the decoder's hot path (fused.h wraps them for tensors).
// Plain pointers and a stream, like nf4_cuda.h: no libtorch headers in the .cu file.
//
// Each kernel computes in fp32 and rounds once to the storage type, where the ATen composition
// it replaces rounded after every op (silu, then the product; x*cos, rot(x)*sin, then the sum).
// fused.cpp's CPU path does the same fp32 math, so both devices agree within one rounding.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace eo::fused::cuda {

enum class DType : int { F32 = 0, BF16 = 1, F16 = 2 };

// h = silu(g) * u over n values.
cudaError_t swiglu_forward(const void* g, const void* u, void* h, std::int64_t n, DType t, cudaStream_t s);
// dg = dh * u * s * (1 + g * (1 - s)), du = dh * silu(g), s = sigmoid(g).
cudaError_t swiglu_backward(const void* g, const void* u, const void* dh, void* dg, void* du, std::int64_t n, DType t,
                            cudaStream_t s);

// Rotary embedding on x [rows = B*T, heads, head_dim] (contiguous), the first rot_dim dims of
// each head rotated as HF's rotate_half pairs them (d with d + rot_dim/2), the rest copied.
// cos/sin: [rows, rot_dim] contiguous, x's type. backward = true applies the transpose
// (dx = dy*cos + R^T(dy*sin)).
cudaError_t rope(const void* x, const void* cos, const void* sin, void* out, std::int64_t rows, int heads,
                 int head_dim, int rot_dim, bool backward, DType t, cudaStream_t s);

}  // namespace eo::fused::cuda
