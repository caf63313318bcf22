// The dequantise kernel and launch loop that MXFP4 and NVFP4 share (mxfp4_cuda.cu, nvfp4_cuda.cu):
// the two formats differ only in their scale group, their per-matrix state and the decode of one
// value, which each .cu file supplies as a format struct F:
//   F::Source, F::Window   its header's structs (codes, scales, ...; row_len, r0, rows, c0, cols)
//   F::kGroup              values per scale byte (quant_format.h's table)
//   F::kMaxSources         matrices per launch (kernel arguments, no device table)
//   F::usable(source)      host: the source's other pointers are set (the codes' alignment is checked here)
//   F::matrix(source)      device: the matrix's state, read once per thread (NVFP4's global scale)
//   F::value<T>(m, c, s)   device: code c under scale byte s as T
// Only .cu files include it.
//
// Each thread reads 4 code bytes (8 values, low nibble first) and one scale byte (an 8-value group
// aligned to 8 never leaves its scale group), decodes them and writes 8 values with 16-byte stores.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "models/nf4_cuda.h"  // OutType

namespace eo::fp4::cuda {

template <typename F>
struct SourceBatch {
  typename F::Source src[F::kMaxSources];
};

template <typename F, typename T>
__global__ void dequantize_window_vec8(const SourceBatch<F> batch, typename F::Window w, T* out) {
  const typename F::Source& s = batch.src[blockIdx.y];
  const std::int64_t per_row = w.cols / 8, groups = w.rows * per_row;
  const std::uint32_t* codes = reinterpret_cast<const std::uint32_t*>(s.codes);
  const typename F::Matrix m = F::matrix(s);
  T* dst_base = out + static_cast<std::int64_t>(blockIdx.y) * w.rows * w.cols;
  for (std::int64_t g = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; g < groups;
       g += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t row = g / per_row;
    const std::int64_t flat = (w.r0 + row) * w.row_len + w.c0 + (g - row * per_row) * 8;  // first of the 8 values
    const std::uint32_t word = __ldg(codes + flat / 8);
    const unsigned scale = __ldg(s.scales + flat / F::kGroup);
    T vals[8];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const unsigned byte = (word >> (8 * k)) & 0xFFu;
      vals[2 * k] = F::template value<T>(m, byte & 15u, scale);  // low nibble: the even element
      vals[2 * k + 1] = F::template value<T>(m, byte >> 4, scale);
    }
    uint4* dst = reinterpret_cast<uint4*>(dst_base + g * 8);
    const uint4* v = reinterpret_cast<const uint4*>(vals);
#pragma unroll
    for (int k = 0; k < static_cast<int>(8 * sizeof(T) / 16); ++k) dst[k] = v[k];
  }
}

inline bool aligned(const void* p, std::uintptr_t to) { return (reinterpret_cast<std::uintptr_t>(p) & (to - 1)) == 0; }

template <typename F, typename T>
cudaError_t launch(const typename F::Source* sources, int count, const typename F::Window& w, void* out, cudaStream_t stream) {
  if (w.row_len % F::kGroup || w.cols % 8 || w.c0 % 8 || w.r0 < 0 || w.c0 < 0 || w.c0 + w.cols > w.row_len || !aligned(out, 16))
    return cudaErrorInvalidValue;
  for (int i = 0; i < count; ++i)
    if (!aligned(sources[i].codes, 4) || !F::usable(sources[i])) return cudaErrorInvalidValue;
  int sms = 132, dev = 0;
  if (cudaGetDevice(&dev) == cudaSuccess) cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  const int threads = 256;
  for (int first = 0; first < count; first += F::kMaxSources) {
    const int k = std::min(F::kMaxSources, count - first);
    SourceBatch<F> batch;
    for (int i = 0; i < k; ++i) batch.src[i] = sources[first + i];
    // Enough blocks to fill the GPU several times over across all matrices, grid-stride beyond.
    const std::int64_t want = (w.rows * w.cols / 8 + threads - 1) / threads;
    const std::int64_t cap = std::max<std::int64_t>(1, (static_cast<std::int64_t>(sms) * 8 + k - 1) / k);
    const dim3 grid(static_cast<unsigned>(std::max<std::int64_t>(1, std::min(want, cap))), static_cast<unsigned>(k));
    T* dst = static_cast<T*>(out) + static_cast<std::int64_t>(first) * w.rows * w.cols;
    dequantize_window_vec8<F, T><<<grid, threads, 0, stream>>>(batch, w, dst);
    const cudaError_t rc = cudaGetLastError();
    if (rc != cudaSuccess) return rc;
  }
  return cudaSuccess;
}

// The format's dequantize (mxfp4_cuda.h, nvfp4_cuda.h): the output type's kernel.
template <typename F>
cudaError_t dequantize(const typename F::Source* sources, int count, const typename F::Window& window, void* out,
                       nf4::cuda::OutType type, cudaStream_t stream) {
  using nf4::cuda::OutType;
  if (count <= 0 || window.rows <= 0 || window.cols <= 0) return cudaSuccess;
  switch (type) {
    case OutType::F32: return launch<F, float>(sources, count, window, out, stream);
    case OutType::BF16: return launch<F, __nv_bfloat16>(sources, count, window, out, stream);
    case OutType::F16: return launch<F, __half>(sources, count, window, out, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace eo::fp4::cuda
