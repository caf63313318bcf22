// Fused elementwise ops of the decoder, each one autograd node: on a GPU one CUDA kernel
// forward and one backward (fused_cuda.h) in place of the chain of ATen kernels the formula
// would launch (RoPE: neg, cat, two products and a sum, each way; SwiGLU backward: ten fp32
// passes). Both devices compute in fp32 and round once to the input's type.
#pragma once

#include <ATen/core/Tensor.h>

#include <utility>

namespace eo::model {

// silu(gate) * up. Saves only gate and up (autograd's silu + mul would also keep silu(gate)).
// With deltas (the expert LoRA's, either may be undefined): silu(gate + gate_delta) * (up +
// up_delta), the sums formed in fp32 inside the kernel, so no [rows, I] sum is written in forward
// and the deltas get the same gradients as gate and up (no pass in backward either).
at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up, const at::Tensor& gate_delta = at::Tensor(),
                  const at::Tensor& up_delta = at::Tensor());
// The same h as two outputs over one buffer (the second an alias), for two consumers (the down
// projection's GEMM and its LoRA): the backward sums their gradients inside its kernel, where
// autograd would add them in a pass of its own.
std::pair<at::Tensor, at::Tensor> swiglu_twice(const at::Tensor& gate, const at::Tensor& up,
                                               const at::Tensor& gate_delta = at::Tensor(),
                                               const at::Tensor& up_delta = at::Tensor());

// HF's rotary embedding, x * cos + rotate_half(x) * sin, on x [B, T, heads, head_dim] (the
// projection's own layout, so no transpose is materialised); cos and sin are [B, T, rot_dim]
// with rot_dim <= head_dim (partial rotary: the dims past rot_dim pass through).
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// The MoE dispatch's and combine's gathers as single passes (no autograd: gather_rows and
// combine_rows in linear4bit.h are their autograd nodes). On a GPU one kernel each (fp32 sums in
// order, rounded once; no [rows * fanout, cols] gather written), on the CPU the formula in fp32
// (or in x's type where it is wider).
//   gather_sum_rows: (weight[:, None] * (x + addend).index_select(0, index)).view(rows, fanout,
//     -1).sum(1), rows = index.numel() / fanout; addend (x's shape) and weight
//     ([index.numel()], any float type) may be undefined. At fanout 1 with a weight: a scaled gather.
at::Tensor gather_sum_rows(const at::Tensor& x, const at::Tensor& index, std::int64_t fanout,
                           const at::Tensor& addend = at::Tensor(), const at::Tensor& weight = at::Tensor());
//   gather_dot_rows: out[o] = dot(g[o / fanout], (x + addend)[index[o]]), fp32 (or wider) [index.numel()];
//     g is [index.numel() / fanout, cols].
at::Tensor gather_dot_rows(const at::Tensor& x, const at::Tensor& addend, const at::Tensor& index, const at::Tensor& g,
                           std::int64_t fanout);

}  // namespace eo::model
