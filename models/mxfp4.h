// MXFP4 (OCP microscaling FP4), the format gpt-oss ships its experts in: per 32 values one
// E8M0 scale byte (2^(s - 127)) and 16 bytes of FP4 E2M1 codes, the low nibble first.
//
// Dequantisation is transformers' convert_moe_packed_tensors (integrations/mxfp4.py, what
// Mxfp4Config(dequantize=True) runs), bit for bit: every MXFP4 value is exact in bf16 (two
// significant bits, exponent within bf16's range, ±inf where the product reaches 2^128), so the
// result is bf16; other dtypes are that bf16 value converted (mxfp4_decode.h has the one decode
// the CPU and the CUDA kernel share).
//
// The experts can stay in this format (QuantizedWeight with format MXFP4, 4.25 bits per
// weight, lossless with respect to the checkpoint), dequantised on the fly into the grouped GEMM's
// bf16 bank: weight() rebuilds one expert matrix [out, in] from the checkpoint's rows. The Hub
// layout needs no transposition for that: `gate_up_proj_blocks` [E, 2I, H/32, 16] holds row r of
// the [2I, H] matrix whose transpose transformers runs (gate = even rows, up = odd rows), its
// 32-groups run along H, the input dimension, so the rows of gate / up / down are the rows of
// eo-ddp's [out, in] weights, with the groups along `in` as the format needs.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "models/quantized_weight.h"

namespace eo::mxfp4 {

constexpr int kGroup = 32;  // values per scale byte

// blocks uint8 [..., R, G, 16] and scales uint8 [..., R, G] → bf16 [..., R, G·32] (row r holds
// its G groups of 32 values in order). transformers then transposes the last two dims of the 3-D
// expert tensors; the caller does the same.
at::Tensor dequantize(const at::Tensor& blocks, const at::Tensor& scales);

// One matrix held in MXFP4: blocks [rows, G, 16] and scales [rows, G] (any strides, any device)
// → a QuantizedWeight of shape [rows, G·32] with contiguous copies of the bytes, on their device.
QuantizedWeight weight(const at::Tensor& blocks, const at::Tensor& scales);

// MXFP4 weights of one shape on one device → [count, out, in] (one CUDA kernel pass on a GPU, no
// host synchronisation), and the window rows [r0, r0 + rows) x columns [c0, c0 + cols) of each
// ([count, rows, cols], the same bits as the slice; on a GPU c0 and cols multiples of 8).
// eo::dequantize* call these for MXFP4 weights.
at::Tensor dequantize_stack(const std::vector<const QuantizedWeight*>& qs, at::ScalarType dtype);
at::Tensor dequantize_stack_window(const std::vector<const QuantizedWeight*>& qs, at::ScalarType dtype, std::int64_t r0,
                                   std::int64_t rows, std::int64_t c0, std::int64_t cols);

}  // namespace eo::mxfp4
