// Fused elementwise ops of the decoder, each one autograd node: on a GPU one CUDA kernel
// forward and one backward (fused_cuda.h) in place of the chain of ATen kernels the formula
// would launch (RoPE: neg, cat, two products and a sum, each way; SwiGLU backward: ten fp32
// passes). Both devices compute in fp32 and round once to the input's type.
#pragma once

#include <ATen/core/Tensor.h>

namespace eo::model {

// silu(gate) * up. Saves only gate and up (autograd's silu + mul would also keep silu(gate)).
at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up);

// HF's rotary embedding, x * cos + rotate_half(x) * sin, on x [B, T, heads, head_dim] (the
// projection's own layout, so no transpose is materialised); cos and sin are [B, T, rot_dim]
// with rot_dim <= head_dim (partial rotary: the dims past rot_dim pass through).
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

}  // namespace eo::model
