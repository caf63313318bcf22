// What a checkpoint's tensors must hold to be loaded: finite values and quantisation scales that
// decode to finite numbers. Each check throws eo::Error naming the checkpoint, the tensor, how
// many elements are bad and the first one, so a damaged or mis-exported model stops at load, not
// as NaN losses (and skipped steps) once training has begun.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

namespace eo::model {

// A float tensor without NaN or infinity.
void check_finite_input(const std::string& folder, const std::string& name, const at::Tensor& t);
// An NVFP4 global scale (weight_scale_2): finite, positive, and small enough that times the
// largest E4M3 block scale (448) and FP4 value (6) it stays a finite float32.
void check_nvfp4_global_scale(const std::string& folder, const std::string& name, float global);
// NVFP4 block scales (float8_e4m3fn): no NaN byte (0x7f / 0xff).
void check_e4m3_scales(const std::string& folder, const std::string& name, const at::Tensor& scales);
// MXFP4 block scales (E8M0 bytes): no 255, which encodes NaN.
void check_e8m0_scales(const std::string& folder, const std::string& name, const at::Tensor& scales);

}  // namespace eo::model
