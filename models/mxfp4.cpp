#include "models/mxfp4.h"

#include <ATen/ATen.h>

#include "common/error.h"

namespace eo::model::mxfp4 {

at::Tensor dequantize(const at::Tensor& blocks, const at::Tensor& scales) {
  EO_CHECK(blocks.scalar_type() == at::kByte && scales.scalar_type() == at::kByte, "mxfp4: blocks and scales must be uint8");
  EO_CHECK(blocks.dim() >= 2 && blocks.size(-1) == 16 && blocks.sizes().slice(0, blocks.dim() - 1) == scales.sizes(),
           "mxfp4: blocks ", blocks.sizes(), " and scales ", scales.sizes(), " do not match ([..., G, 16] and [..., G])");
  // FP4 E2M1 codes 0..15 (transformers' FP4_VALUES): sign bit 3, then 0, 0.5, 1, 1.5, 2, 3, 4, 6.
  static const float kValues[16] = {+0.0f, +0.5f, +1.0f, +1.5f, +2.0f, +3.0f, +4.0f, +6.0f,
                                    -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  const at::Tensor lut = at::tensor(at::ArrayRef<float>(kValues, 16), at::TensorOptions().dtype(at::kFloat)).to(blocks.device());
  const at::Tensor lo = lut.index_select(0, at::bitwise_and(blocks, 0x0F).to(at::kLong).reshape({-1})).view(blocks.sizes());
  const at::Tensor hi = lut.index_select(0, at::bitwise_right_shift(blocks, 4).to(at::kLong).reshape({-1})).view(blocks.sizes());
  // Each byte gives two consecutive values, low nibble first; then ldexp by scale - 127 in bf16, as
  // transformers does (its bf16 ldexp also fixes what the extreme scale bytes give: 2^128 · 0.5 is
  // finite there, not inf, and 0 · 2^128 is 0).
  const at::Tensor values = at::stack({lo, hi}, -1).flatten(-2).to(at::kBFloat16);  // [..., G, 32]
  return at::ldexp(values, (scales.to(at::kInt) - 127).unsqueeze(-1)).to(at::kBFloat16).flatten(-2);
}

}  // namespace eo::model::mxfp4
