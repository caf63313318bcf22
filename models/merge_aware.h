// axolotl's nvfp4_merge_aware (axolotl 0.19.0, integrations/kernels: libs/sonicmoe/nvfp4_lora.py
// _merge_aware_wfq and its autograd Functions, merge_aware_linear.py): a LoRA on a frozen NVFP4
// weight trains through the weight its merge will write, Q(dequant(W) + scaling · B A), so that
// merging the adapter back into an NVFP4 checkpoint (fresh block scales on the base's global scale)
// reproduces the trained model instead of rounding most of the delta away.
#pragma once

#include <ATen/core/Tensor.h>

namespace eo::model {

// Q(w) (nvfp4::fake_quantize on `global`) with the straight-through gradient: the backward passes
// the gradient of Q(w) to w unchanged (d/dW_eff = identity), so the LoRA factors get the gradient
// they would get through W_eff, while a GEMM on the result takes its dX through the snapped weight.
at::Tensor snap_nvfp4_ste(const at::Tensor& w, const at::Tensor& global);

}  // namespace eo::model
