// CUDA kernels for NF4 (see nf4.h for the format). Plain pointers and a stream, so the .cu file
// needs no libtorch headers; nf4.cpp wraps them for tensors.
//
// Both kernels give the same bits as the CPU path in nf4.cpp: dequantise is code * absmax in
// fp32 rounded to the output type (no fused multiply-add), quantise follows the CPU's
// reciprocal-multiply for full blocks and division for the partial last block.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace eo::nf4::cuda {

enum class OutType : int { F32 = 0, BF16 = 1, F16 = 2 };

// One quantised matrix's statistics and bytes, as the kernels read them.
struct Nf4Source {
  const std::uint8_t* packed = nullptr;  // (n + 1) / 2 bytes
  const void* absmax = nullptr;          // fp32 [nblocks], or uint8 codes when nested
  const float* nested_absmax = nullptr;  // fp32 [ceil(nblocks / nested_blocksize)] when nested
  float offset = 0;                      // nested: added after code * nested_absmax
  int pad_ = 0;
};

struct Nf4Layout {
  std::int64_t n = 0;  // values per matrix
  int blocksize = 64;
  bool nested = false;
  int nested_blocksize = 256;
  const float* nested_code = nullptr;  // device [256] when nested
};

// A window of each matrix: rows [r0, r0 + rows) x columns [c0, c0 + cols) of a row-major
// [n / row_len, row_len] matrix, written densely as [rows, cols]. The MoE's grouped GEMMs
// dequantise their bank in such slices so the temporary bank stays small (linear4bit.h).
// c0, cols and row_len must be multiples of 8.
struct Nf4Window {
  std::int64_t row_len = 0, r0 = 0, rows = 0, c0 = 0, cols = 0;
};

// Dequantises `count` matrices of the same layout into out[i * n ...]. `sources` is a HOST array:
// the pointers travel as kernel arguments (kMaxSourcesPerLaunch per launch), so no table is
// copied to the device and nothing waits for the host.
constexpr int kMaxSourcesPerLaunch = 64;
cudaError_t dequantize(const Nf4Source* sources, int count, const Nf4Layout& layout, void* out, OutType type,
                       cudaStream_t stream);
// The same for one window of every matrix into out[i * rows * cols ...].
cudaError_t dequantize_window(const Nf4Source* sources, int count, const Nf4Layout& layout, const Nf4Window& window,
                              void* out, OutType type, cudaStream_t stream);

// Quantises n fp32 values (device) into packed bytes and fp32 absmax (device), like the CPU path.
cudaError_t quantize(const float* x, std::int64_t n, int blocksize, std::uint8_t* packed, float* absmax,
                     cudaStream_t stream);

}  // namespace eo::nf4::cuda
