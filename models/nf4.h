// NF4 (4-bit NormalFloat) quantisation, bit-compatible with bitsandbytes'
// quantize_4bit(quant_type="nf4") / dequantize_4bit.
//
// Layout (bitsandbytes): the weight [out, in] is flattened row-major and cut into blocks of
// `blocksize` values; absmax[b] = max |x| of block b (fp32); each value becomes the index of
// the nearest NF4 code (midpoint thresholds); element 2j goes in the high nibble of byte j,
// 2j+1 in the low nibble; packed is uint8 [(n+1)/2, 1]. With double quantisation
// (compress_statistics) absmax is stored as uint8 codes of bitsandbytes' signed dynamic map
// in blocks of 256, plus per-block fp32 scales and the mean offset.
//
// The weight itself, tagged with its format, is models/quantized_weight.h's QuantizedWeight.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <optional>
#include <vector>

#include "models/quantized_weight.h"

namespace eo::nf4 {

// bitsandbytes' NF4 code book, index 0..15.
extern const std::array<float, 16> kCode;

// Quantises a 2-D fp32/bf16/fp16 weight in fp32 as bitsandbytes does, on the weight's device
// (a CUDA kernel for a CUDA weight, with the same bits). Byte-identical to bnb 0.50.2
// quantize_4bit(quant_type="nf4") on the CPU; throws on NaN/inf, bad blocksize, or
// (double_quant) an absmax mean that overflows. The result lives on the weight's device.
QuantizedWeight quantize(const at::Tensor& weight, int blocksize = 64, bool double_quant = false);
// NF4 weights only (the format-dispatching eo::dequantize* call these).
at::Tensor dequantize(const QuantizedWeight& q, at::ScalarType dtype);
at::Tensor dequantize_stack(const std::vector<const QuantizedWeight*>& qs, at::ScalarType dtype);
at::Tensor dequantize_stack_window(const std::vector<const QuantizedWeight*>& qs, at::ScalarType dtype, std::int64_t r0,
                                   std::int64_t rows, std::int64_t c0, std::int64_t cols);

// bitsandbytes' signed dynamic 8-bit map (create_dynamic_map(signed=True)), 256 sorted values.
at::Tensor dynamic_map_signed();

}  // namespace eo::nf4
