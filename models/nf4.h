// NF4 (4-bit NormalFloat) quantisation, bit-compatible with bitsandbytes'
// quantize_4bit(quant_type="nf4") / dequantize_4bit.
//
// Layout (bitsandbytes): the weight [out, in] is flattened row-major and cut into blocks of
// `blocksize` values; absmax[b] = max |x| of block b (fp32); each value becomes the index of
// the nearest NF4 code (midpoint thresholds); element 2j goes in the high nibble of byte j,
// 2j+1 in the low nibble; packed is uint8 [(n+1)/2, 1]. With double quantisation
// (compress_statistics) absmax is stored as uint8 codes of bitsandbytes' signed dynamic map
// in blocks of 256, plus per-block fp32 scales and the mean offset.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <optional>
#include <vector>

namespace eo::nf4 {

// bitsandbytes' NF4 code book, index 0..15.
extern const std::array<float, 16> kCode;

struct DoubleQuant {
  at::Tensor absmax_codes;   // uint8 [nblocks]
  at::Tensor nested_absmax;  // fp32 [ceil(nblocks / nested_blocksize)]
  at::Tensor nested_code;    // fp32 [256], bitsandbytes' create_dynamic_map(signed=True)
  float offset = 0;          // mean of the original absmax
  int nested_blocksize = 256;
};

// A quantised weight. `packed` and the statistics are CPU or device tensors.
struct QuantizedWeight {
  at::Tensor packed;  // uint8 [(numel + 1) / 2, 1]
  at::Tensor absmax;  // fp32 [nblocks]; undefined when `nested` holds the statistics
  std::optional<DoubleQuant> nested;
  std::vector<std::int64_t> shape;  // [out, in]
  int blocksize = 64;
  at::ScalarType dtype = at::kFloat;  // the original dtype (dequantise casts to it by default)

  std::int64_t numel() const;
  std::int64_t nblocks() const;
  // fp32 absmax, undoing double quantisation when present.
  at::Tensor absmax_fp32() const;
  std::int64_t bytes() const;  // packed + statistics
};

// Quantises a 2-D fp32/bf16/fp16 weight in fp32 as bitsandbytes does, on the weight's device
// (a CUDA kernel for a CUDA weight, with the same bits). Byte-identical to bnb 0.50.2
// quantize_4bit(quant_type="nf4") on the CPU; throws on NaN/inf, bad blocksize, or
// (double_quant) an absmax mean that overflows. The result lives on the weight's device.
QuantizedWeight quantize(const at::Tensor& weight, int blocksize = 64, bool double_quant = false);
// Dequantises to `dtype` with shape [out, in], on the device of q.packed:
// code[nibble] * absmax[i / blocksize] in fp32, rounded to dtype (CUDA kernel on a GPU).
at::Tensor dequantize(const QuantizedWeight& q, at::ScalarType dtype);
at::Tensor dequantize(const QuantizedWeight& q);  // to q.dtype
// Dequantises matrices of one layout (same shape, blocksize and statistics kind, one device)
// into one [count, out, in] tensor: a MoE block's experts for a grouped GEMM. One kernel pass
// on a GPU, no host synchronisation.
at::Tensor dequantize_stack(const std::vector<const QuantizedWeight*>& qs, at::ScalarType dtype);
// The same for rows [r0, r0 + rows) x columns [c0, c0 + cols) of every matrix: [count, rows, cols],
// the same bits as the slice of dequantize_stack's result. On a GPU c0, cols and in must be
// multiples of 8 (the window kernel); the CPU slices the whole stack.
at::Tensor dequantize_stack_window(const std::vector<const QuantizedWeight*>& qs, at::ScalarType dtype, std::int64_t r0,
                                   std::int64_t rows, std::int64_t c0, std::int64_t cols);

// bitsandbytes' signed dynamic 8-bit map (create_dynamic_map(signed=True)), 256 sorted values.
at::Tensor dynamic_map_signed();

}  // namespace eo::nf4
