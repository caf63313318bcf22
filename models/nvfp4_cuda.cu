// NVFP4 dequantise kernel (interface and bit-exactness contract: nvfp4_cuda.h).
//
// Shaped like the MXFP4 kernel (mxfp4_cuda.cu): each thread reads 4 code bytes (8 values, low
// nibble first) and one scale byte (an 8-value group aligned to 8 never leaves its 16-value scale
// group), decodes them with the shared code_times_scale, multiplies by the matrix's global scale
// (__fmul_rn: one IEEE rounding, no contraction) and writes 8 values with 16-byte stores.
#include "models/nvfp4_cuda.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "models/nvfp4_decode.h"

namespace eo::nvfp4::cuda {
namespace {

struct SourceBatch {
  Nvfp4Source src[kMaxSourcesPerLaunch];
};

template <typename T>
struct Store;
template <>
struct Store<__nv_bfloat16> {
  static __device__ __nv_bfloat16 cvt(float v) { return __float2bfloat16_rn(v); }
};
template <>
struct Store<float> {
  static __device__ float cvt(float v) { return v; }
};
template <>
struct Store<__half> {
  static __device__ __half cvt(float v) { return __float2half_rn(v); }
};

template <typename T>
__global__ void dequantize_window_vec8(const SourceBatch batch, Nvfp4Window w, T* out) {
  const Nvfp4Source& s = batch.src[blockIdx.y];
  const std::int64_t per_row = w.cols / 8, groups = w.rows * per_row;
  const std::uint32_t* codes = reinterpret_cast<const std::uint32_t*>(s.codes);
  const float global = __ldg(s.global);
  T* dst_base = out + static_cast<std::int64_t>(blockIdx.y) * w.rows * w.cols;
  for (std::int64_t g = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; g < groups;
       g += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t row = g / per_row;
    const std::int64_t flat = (w.r0 + row) * w.row_len + w.c0 + (g - row * per_row) * 8;  // first of the 8 values
    const std::uint32_t word = __ldg(codes + flat / 8);
    const unsigned scale = __ldg(s.scales + flat / 16);
    T vals[8];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const unsigned byte = (word >> (8 * k)) & 0xFFu;
      vals[2 * k] = Store<T>::cvt(__fmul_rn(code_times_scale(byte & 15u, scale), global));  // low nibble: even element
      vals[2 * k + 1] = Store<T>::cvt(__fmul_rn(code_times_scale(byte >> 4, scale), global));
    }
    uint4* dst = reinterpret_cast<uint4*>(dst_base + g * 8);
    const uint4* v = reinterpret_cast<const uint4*>(vals);
#pragma unroll
    for (int k = 0; k < static_cast<int>(8 * sizeof(T) / 16); ++k) dst[k] = v[k];
  }
}

bool aligned(const void* p, std::uintptr_t to) { return (reinterpret_cast<std::uintptr_t>(p) & (to - 1)) == 0; }

template <typename T>
cudaError_t launch(const Nvfp4Source* sources, int count, const Nvfp4Window& w, void* out, cudaStream_t stream) {
  if (w.row_len % 16 || w.cols % 8 || w.c0 % 8 || w.r0 < 0 || w.c0 < 0 || w.c0 + w.cols > w.row_len || !aligned(out, 16))
    return cudaErrorInvalidValue;
  for (int i = 0; i < count; ++i)
    if (!aligned(sources[i].codes, 4) || sources[i].global == nullptr) return cudaErrorInvalidValue;
  int sms = 132, dev = 0;
  if (cudaGetDevice(&dev) == cudaSuccess) cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  const int threads = 256;
  for (int first = 0; first < count; first += kMaxSourcesPerLaunch) {
    const int k = std::min(kMaxSourcesPerLaunch, count - first);
    SourceBatch batch;
    for (int i = 0; i < k; ++i) batch.src[i] = sources[first + i];
    const std::int64_t want = (w.rows * w.cols / 8 + threads - 1) / threads;
    const std::int64_t cap = std::max<std::int64_t>(1, (static_cast<std::int64_t>(sms) * 8 + k - 1) / k);
    const dim3 grid(static_cast<unsigned>(std::max<std::int64_t>(1, std::min(want, cap))), static_cast<unsigned>(k));
    T* dst = static_cast<T*>(out) + static_cast<std::int64_t>(first) * w.rows * w.cols;
    dequantize_window_vec8<T><<<grid, threads, 0, stream>>>(batch, w, dst);
    const cudaError_t rc = cudaGetLastError();
    if (rc != cudaSuccess) return rc;
  }
  return cudaSuccess;
}

}  // namespace

cudaError_t dequantize(const Nvfp4Source* sources, int count, const Nvfp4Window& window, void* out, OutType type,
                       cudaStream_t stream) {
  if (count <= 0 || window.rows <= 0 || window.cols <= 0) return cudaSuccess;
  switch (type) {
    case OutType::F32: return launch<float>(sources, count, window, out, stream);
    case OutType::BF16: return launch<__nv_bfloat16>(sources, count, window, out, stream);
    case OutType::F16: return launch<__half>(sources, count, window, out, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace eo::nvfp4::cuda
