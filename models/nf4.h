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
// QuantizedWeight is the frozen 4-bit weight of the whole code base, in one of three formats (its
// `format` tag): NF4 as above, MXFP4 (models/mxfp4.h: the format gpt-oss's checkpoints ship their
// experts in, kept as stored) or NVFP4 (models/nvfp4.h: modelopt's checkpoints, kept as stored). dequantize / dequantize_stack / dequantize_stack_window
// below take either and dispatch on the tag, so the 4-bit linear, the grouped expert GEMM and the
// offload engine hold and stage both the same way.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <optional>
#include <vector>

#include "models/quant_format.h"

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

// A quantised weight [out, in]. `packed` and the statistics are CPU or device tensors.
//   NF4:   packed uint8 [(numel + 1) / 2, 1] (element 2j in the high nibble of byte j), absmax or
//          nested statistics per `blocksize` values of the row-major flattening.
//   MXFP4: packed uint8 [numel / 2, 1], the FP4 E2M1 codes of row-major [out, in] (element 2j in
//          the LOW nibble of byte j), scales uint8 [numel / 32] (E8M0: 2^(s - 127) for the 32
//          values of one row's columns [32g, 32g + 32)); in % 32 == 0, blocksize 32, dtype bf16.
//   NVFP4: packed as MXFP4's, scales uint8 [numel / 16] (FP8 E4M3 bytes, one per 16 values of a
//          row), global_scale fp32 [1]; in % 16 == 0, blocksize 16, dtype fp32.
struct QuantizedWeight {
  QuantFormat format = QuantFormat::Nf4;
  at::Tensor packed;  // uint8, as above
  at::Tensor absmax;  // NF4: fp32 [nblocks]; undefined when `nested` holds the statistics (or MXFP4)
  std::optional<DoubleQuant> nested;
  at::Tensor scales;  // MXFP4: uint8 [nblocks] E8M0 scale bytes; NVFP4: E4M3 bytes; undefined for NF4
  at::Tensor global_scale;  // NVFP4: fp32 [1], the matrix's weight_scale_2; undefined otherwise
  std::vector<std::int64_t> shape;  // [out, in]
  int blocksize = 64;
  at::ScalarType dtype = at::kFloat;  // the original dtype (dequantise casts to it by default)

  std::int64_t numel() const;
  std::int64_t nblocks() const;
  // NF4: fp32 absmax, undoing double quantisation when present.
  at::Tensor absmax_fp32() const;
  // The per-block statistics as stored (what an arena holds after the codes): NF4 fp32 absmax or
  // the nested u8 codes, MXFP4 and NVFP4 the u8 scales.
  const at::Tensor& stats() const;
  std::int64_t bytes() const;  // packed + statistics
};

// Quantises a 2-D fp32/bf16/fp16 weight in fp32 as bitsandbytes does, on the weight's device
// (a CUDA kernel for a CUDA weight, with the same bits). Byte-identical to bnb 0.50.2
// quantize_4bit(quant_type="nf4") on the CPU; throws on NaN/inf, bad blocksize, or
// (double_quant) an absmax mean that overflows. The result lives on the weight's device.
QuantizedWeight quantize(const at::Tensor& weight, int blocksize = 64, bool double_quant = false);
// Dequantises to `dtype` with shape [out, in], on the device of q.packed:
// code[nibble] * absmax[i / blocksize] in fp32, rounded to dtype (CUDA kernel on a GPU); MXFP4
// weights as mxfp4.h defines it. These three take either format (all weights of a stack alike).
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
