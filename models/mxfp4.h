// MXFP4 (OCP microscaling FP4), the format gpt-oss ships its experts in: per 32 values one
// E8M0 scale byte (2^(s - 127)) and 16 bytes of FP4 E2M1 codes, the low nibble first.
//
// The checkpoint's experts are dequantised once, at load, exactly as transformers'
// convert_moe_packed_tensors (integrations/mxfp4.py) does for Mxfp4Config(dequantize=True); the
// float weights then take the usual path (NF4 with load_in_4bit). Every MXFP4 value is exact in
// bf16 (two significant bits, exponent within bf16's range), so the result is bf16, bit for bit
// transformers' (its ldexp in bf16, extreme scale bytes included).
#pragma once

#include <ATen/core/Tensor.h>

namespace eo::model::mxfp4 {

// blocks uint8 [..., R, G, 16] and scales uint8 [..., R, G] → bf16 [..., R, G·32] (row r holds
// its G groups of 32 values in order). transformers then transposes the last two dims of the 3-D
// expert tensors; the caller does the same.
at::Tensor dequantize(const at::Tensor& blocks, const at::Tensor& scales);

}  // namespace eo::model::mxfp4
