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

// h = silu(g) * u over n values, where g = g0 + g1 and u = u0 + u1 summed in fp32 (g1, u1 may be
// null: the expert LoRA's deltas, added without writing the sums).
cudaError_t swiglu_forward(const void* g0, const void* g1, const void* u0, const void* u1, void* h, std::int64_t n,
                           DType t, cudaStream_t s);
// dg = dh * u * s * (1 + g * (1 - s)), du = dh * silu(g), s = sigmoid(g), with g and u as above
// and dh = dh0 + dh1 summed in fp32 (dh1 may be null: the gradient of h's second consumer).
cudaError_t swiglu_backward(const void* g0, const void* g1, const void* u0, const void* u1, const void* dh0,
                            const void* dh1, void* dg, void* du, std::int64_t n, DType t, cudaStream_t s);

// The MoE dispatch and combine as gathers (all [*, cols] contiguous, index int64, weight fp32;
// fp32 sums, rounded once):
// out[r, :] = the sum over j < fanout of weight[r * fanout + j] * (x + y)[index[r * fanout + j], :],
// y and weight may be null (none, 1): the dispatch's backward (each token's k routed gradients
// summed in one pass), the combine (routing-weighted, with the down LoRA's delta as y) and, at
// fanout 1, the combine's backward (each row its token's gradient times its weight).
cudaError_t gather_sum_rows(const void* x, const void* y, const std::int64_t* index, const float* weight, void* out,
                            std::int64_t rows, int fanout, std::int64_t cols, DType t, cudaStream_t s);
// out[o] = dot(g[o / fanout, :], (x + y)[index[o], :]) for o < rows * fanout, fp32 out, y may be
// null: the combine's routing-weight gradient.
cudaError_t gather_dot_rows(const void* x, const void* y, const std::int64_t* index, const void* g, float* out,
                            std::int64_t rows, int fanout, std::int64_t cols, DType t, cudaStream_t s);

// Rotary embedding on x [rows = B*T, heads, head_dim] (contiguous), the first rot_dim dims of
// each head rotated as HF's rotate_half pairs them (d with d + rot_dim/2), the rest copied.
// cos/sin: [rows, rot_dim] contiguous, x's type. backward = true applies the transpose
// (dx = dy*cos + R^T(dy*sin)).
cudaError_t rope(const void* x, const void* cos, const void* sin, void* out, std::int64_t rows, int heads,
                 int head_dim, int rot_dim, bool backward, DType t, cudaStream_t s);

}  // namespace eo::fused::cuda
