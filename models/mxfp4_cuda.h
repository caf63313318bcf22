// CUDA kernel for MXFP4 dequantisation (format: mxfp4.h / nf4.h's QuantizedWeight). Plain
// pointers and a stream, so the .cu file needs no libtorch headers; mxfp4.cpp wraps it.
//
// Bits: the CPU path's, by construction (both decode with mxfp4_decode.h's bf16_bits; fp32 is
// that bf16 widened, fp16 that value rounded to nearest even).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "models/nf4_cuda.h"  // OutType

namespace eo::mxfp4::cuda {

using OutType = nf4::cuda::OutType;

// One matrix's bytes as the kernel reads them: codes row-major [out, in / 2] (4-byte aligned),
// scales [out, in / 32].
struct Mxfp4Source {
  const std::uint8_t* codes = nullptr;
  const std::uint8_t* scales = nullptr;
};

// Rows [r0, r0 + rows) x columns [c0, c0 + cols) of each [n / row_len, row_len] matrix, written
// densely as [rows, cols] per matrix (the whole matrix: r0 = c0 = 0, rows = n / row_len,
// cols = row_len). row_len a multiple of 32; c0 and cols multiples of 8.
struct Mxfp4Window {
  std::int64_t row_len = 0, r0 = 0, rows = 0, c0 = 0, cols = 0;
};

// Dequantises the window of `count` matrices into out[i * rows * cols ...] (16-byte aligned).
// `sources` is a HOST array: the pointers travel as kernel arguments, kMaxSourcesPerLaunch per
// launch, so nothing is copied to the device and nothing waits for the host.
constexpr int kMaxSourcesPerLaunch = 64;
cudaError_t dequantize(const Mxfp4Source* sources, int count, const Mxfp4Window& window, void* out, OutType type,
                       cudaStream_t stream);

}  // namespace eo::mxfp4::cuda
