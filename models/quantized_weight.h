// The frozen 4-bit weight of the whole code base, in one of three formats (its `format` tag):
// NF4 (models/nf4.h: bitsandbytes' layout, quantised at load), MXFP4 (models/mxfp4.h: the format
// gpt-oss's checkpoints ship their experts in, kept as stored) or NVFP4 (models/nvfp4.h:
// modelopt's checkpoints, kept as stored). The dequantisers below take any of them and dispatch on
// the tag to the format's codec, so the 4-bit linear, the grouped expert GEMM and the offload
// engine hold and stage every format the same way. Sizes per format: models/quant_format.h.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "models/quant_format.h"

namespace eo {

// NF4's double quantisation (bitsandbytes' compress_statistics): absmax as 8-bit codes.
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
  // NF4: fp32 absmax, undoing double quantisation when present (models/nf4.cpp: bnb's nested map).
  at::Tensor absmax_fp32() const;
  // The per-block statistics as stored (what an arena holds after the codes): NF4 fp32 absmax or
  // the nested u8 codes, MXFP4 and NVFP4 the u8 scales.
  const at::Tensor& stats() const;
  std::int64_t bytes() const;  // packed + statistics
};

// Dequantises to `dtype` with shape [out, in], on the device of q.packed (a CUDA kernel on a GPU),
// as the weight's format defines it (nf4.h, mxfp4.h, nvfp4.h). These take any format (all weights
// of a stack alike).
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

}  // namespace eo
