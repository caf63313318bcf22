// NVFP4, NVIDIA modelopt's 4-bit float format, as its checkpoints store every quantised linear
// `P` (config.json quantization_config.quant_method "modelopt", quant_algo "NVFP4"):
//   P.weight          uint8 [out, in / 2]: FP4 E2M1 codes of row-major [out, in], element 2j in
//                     the LOW nibble of byte j (vLLM's break_fp4_bytes: [0xAB] -> [B, A])
//   P.weight_scale    float8_e4m3fn [out, in / 16]: one scale per 16 consecutive values of a row
//   P.weight_scale_2  float32 scalar: the matrix's global scale
//   P.input_scale     float32 scalar: the activation scale of W4A4 inference (not read: eo-ddp
//                     computes in bf16 / fp32, as weight-only dequantisation does)
// value = e2m1 * e4m3 * weight_scale_2 (nvfp4_decode.h has the decode and its rounding).
//
// Experts stay in this format (QuantizedWeight with format NVFP4, 4.5 bits per weight,
// lossless with respect to the checkpoint), dequantised on the fly into the grouped GEMM's bank;
// every other NVFP4 linear is dequantised to the compute dtype when it is loaded.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "models/quantized_weight.h"

namespace eo::nvfp4 {

constexpr int kGroup = 16;  // values per scale byte

// A modelopt NVFP4 linear's tensors (codes uint8 [out, in / 2], scales float8_e4m3fn or uint8
// [out, in / 16], global fp32 with one element; any device) → `dtype` [out, in] on their device.
at::Tensor dequantize(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& global, at::ScalarType dtype);

// The same tensors as a QuantizedWeight of shape [out, in] (contiguous copies of the bytes, on
// their device): packed [out * in / 2, 1], scales uint8 [out * in / 16], global_scale fp32 [1].
QuantizedWeight weight(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& global);

// NVFP4 weights of one shape on one device → [count, out, in] (one CUDA kernel pass on a GPU, no
// host synchronisation), and the window rows [r0, r0 + rows) x columns [c0, c0 + cols) of each
// ([count, rows, cols], the same bits as the slice; on a GPU c0 and cols multiples of 8).
// eo::dequantize* call these for NVFP4 weights.
at::Tensor dequantize_stack(const std::vector<const QuantizedWeight*>& qs, at::ScalarType dtype);
at::Tensor dequantize_stack_window(const std::vector<const QuantizedWeight*>& qs, at::ScalarType dtype, std::int64_t r0,
                                   std::int64_t rows, std::int64_t c0, std::int64_t cols);

// axolotl's merge-aware quantiser (nvfp4_merge_aware; axolotl 0.19.0 nvfp4_quant.py
// fake_quant_nvfp4, which is torchao 0.18's nvfp4_quantize with a per-tensor scale, then
// NVFP4Tensor.dequantize): x [lead, ..., K] (K a multiple of 16) snapped to the NVFP4 grid on the
// global scales `global` (fp32, one element or one per x.size(0): per expert), in x's dtype. Per 16
// consecutive values of the last dim, in fp32: s = e4m3(clamp(amax / 6 / global, 2^-6, 448)) (round
// to nearest even; 2^-6, E4M3's smallest normal, is torchao's floor, so an all-zero block gets it);
// v = clamp(x * ((1 / global) / s), -6, 6) rounded to the nearest E2M1 value, ties to the even
// code, the sign kept (-0); the result v * (global * s). Generic ATen ops (CPU and CUDA alike).
at::Tensor fake_quantize(const at::Tensor& x, const at::Tensor& global);

}  // namespace eo::nvfp4
