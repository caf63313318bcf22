// y = a · B_e on row groups (rows [offsets[e-1], offsets[e]) through expert e), with autograd:
// at::_grouped_mm's 2-D x 3-D form and its backward, except that every product whose
// contraction is small (the LoRA rank: K <= 64) runs on eo's small-K kernel on a GPU
// (grouped_mm_cuda.h). That is the expert LoRA's B GEMM forward (down [N, r] · B^T) and its A
// GEMM's dX (d_down [N, r] · A), the GEMMs whose outputs are [N, in] or [N, out] wide.
#pragma once

#include <ATen/ATen.h>

namespace eo::model {

// a [M, K], b [E, K, N] (any strides: a transposed view is fine), offsets int32 [E] on a's
// device: [M, N] in a's dtype.
at::Tensor grouped_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offsets);

// The forward product alone, no autograd: the small-K kernel where small_k_kernel_applies,
// at::_grouped_mm otherwise.
at::Tensor grouped_mm_product(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offsets);
// Whether a · b runs on the small-K kernel: CUDA (sm_80+), bf16, K <= 64 and K, N multiples of
// 8, at most 1024 experts, b contiguous as [E, K, N] or as the transposed view of a contiguous [E, N, K].
bool small_k_kernel_applies(const at::Tensor& a, const at::Tensor& b);
// Turns the small-K kernel off (tests and eo-lora-gemm compare it with libtorch's GEMM).
void set_small_k_kernel_enabled(bool on);

}  // namespace eo::model
