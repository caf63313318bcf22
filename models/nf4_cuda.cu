// NF4 dequantise / quantise kernels (interface and bit-exactness contract: nf4_cuda.h).
//
// Dequantise is a streaming kernel: each thread reads 4 packed bytes, looks its 8 nibbles up in
// a shared-memory code book, scales by the block's absmax and writes 8 values with one 128-bit
// store. Every 8-value group lies in one absmax block (blocksize >= 32, a power of two), so a
// thread reads one absmax. Matrices whose size or pointers don't allow the vector path take a
// byte-per-thread kernel.
#include "models/nf4_cuda.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

namespace eo::nf4::cuda {
namespace {

__constant__ float kCodeConst[16] = {
    -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f, -0.28444138169288635f,
    -0.18477343022823334f, -0.09105003625154495f, 0.0f, 0.07958029955625534f, 0.16093020141124725f,
    0.24611230194568634f, 0.33791524171829224f, 0.44070982933044434f, 0.5626170039176941f,
    0.7229568362236023f, 1.0f};

// A launch's matrices, passed by value (2 KB of kernel arguments).
struct SourceBatch {
  Nf4Source src[kMaxSourcesPerLaunch];
};

template <typename T>
struct Store;
template <>
struct Store<float> {
  static __device__ float cvt(float v) { return v; }
};
template <>
struct Store<__nv_bfloat16> {
  static __device__ __nv_bfloat16 cvt(float v) { return __float2bfloat16_rn(v); }
};
template <>
struct Store<__half> {
  static __device__ __half cvt(float v) { return __float2half_rn(v); }
};

// fp32 absmax of block b: plain, or bnb's double quantisation (code * scale, then + offset, as
// two roundings like the CPU tensor ops).
template <bool kNested>
__device__ __forceinline__ float block_absmax(const Nf4Source& s, const Nf4Layout& l, std::int64_t b) {
  if (!kNested) return __ldg(static_cast<const float*>(s.absmax) + b);
  const std::uint8_t code = __ldg(static_cast<const std::uint8_t*>(s.absmax) + b);
  const float scaled = __fmul_rn(__ldg(l.nested_code + code), __ldg(s.nested_absmax + b / l.nested_blocksize));
  return __fadd_rn(scaled, s.offset);
}

// 4 packed bytes (8 nibbles, little-endian: byte k holds values 2k, 2k+1) scaled by their
// block's absmax, written as 8 values with 16-byte stores (dst 16-byte aligned).
template <typename T>
__device__ __forceinline__ void store8(std::uint32_t word, float am, const float* code, T* dst) {
  T vals[8];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const std::uint32_t byte = (word >> (8 * k)) & 0xFF;
    vals[2 * k] = Store<T>::cvt(__fmul_rn(code[byte >> 4], am));
    vals[2 * k + 1] = Store<T>::cvt(__fmul_rn(code[byte & 15], am));
  }
  uint4* out = reinterpret_cast<uint4*>(dst);
  const uint4* v = reinterpret_cast<const uint4*>(vals);
#pragma unroll
  for (int k = 0; k < static_cast<int>(8 * sizeof(T) / 16); ++k) out[k] = v[k];
}

// 4 packed bytes -> 8 values per thread and iteration: a warp reads 128 contiguous bytes and
// writes 512 (bf16) contiguous bytes with one 16-byte store per thread, so loads and stores are
// fully coalesced.
template <typename T, bool kNested>
__global__ void dequantize_vec8(const SourceBatch batch, Nf4Layout layout, T* out) {
  __shared__ float code[16];
  if (threadIdx.x < 16) code[threadIdx.x] = kCodeConst[threadIdx.x];
  __syncthreads();
  const Nf4Source& s = batch.src[blockIdx.y];
  const std::int64_t groups = layout.n / 8;
  const std::uint32_t* src = reinterpret_cast<const std::uint32_t*>(s.packed);
  T* dst_base = out + static_cast<std::int64_t>(blockIdx.y) * layout.n;
  for (std::int64_t g = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; g < groups;
       g += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    store8(__ldg(src + g), block_absmax<kNested>(s, layout, (g * 8) / layout.blocksize), code, dst_base + g * 8);
  }
}

// The window variant: group g of the window maps to value (r0 + g / (cols/8)) * row_len + c0 +
// 8 * (g % (cols/8)) of the matrix; the rest as dequantize_vec8 (same bits).
template <typename T, bool kNested>
__global__ void dequantize_window_vec8(const SourceBatch batch, Nf4Layout layout, Nf4Window w, T* out) {
  __shared__ float code[16];
  if (threadIdx.x < 16) code[threadIdx.x] = kCodeConst[threadIdx.x];
  __syncthreads();
  const Nf4Source& s = batch.src[blockIdx.y];
  const std::int64_t per_row = w.cols / 8, groups = w.rows * per_row;
  const std::uint32_t* src = reinterpret_cast<const std::uint32_t*>(s.packed);
  T* dst_base = out + static_cast<std::int64_t>(blockIdx.y) * w.rows * w.cols;
  for (std::int64_t g = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; g < groups;
       g += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t row = g / per_row;
    const std::int64_t flat = (w.r0 + row) * w.row_len + w.c0 + (g - row * per_row) * 8;
    store8(__ldg(src + flat / 8), block_absmax<kNested>(s, layout, flat / layout.blocksize), code, dst_base + g * 8);
  }
}

template <typename T, bool kNested>
__global__ void dequantize_bytes(const SourceBatch batch, Nf4Layout layout, T* out) {
  const Nf4Source& s = batch.src[blockIdx.y];
  const std::int64_t bytes = (layout.n + 1) / 2;
  T* dst = out + static_cast<std::int64_t>(blockIdx.y) * layout.n;
  for (std::int64_t j = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; j < bytes;
       j += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::uint8_t byte = s.packed[j];
    const std::int64_t i = 2 * j;
    dst[i] = Store<T>::cvt(__fmul_rn(kCodeConst[byte >> 4], block_absmax<kNested>(s, layout, i / layout.blocksize)));
    if (i + 1 < layout.n)
      dst[i + 1] =
          Store<T>::cvt(__fmul_rn(kCodeConst[byte & 15], block_absmax<kNested>(s, layout, (i + 1) / layout.blocksize)));
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15) == 0; }

template <typename T, bool kNested>
cudaError_t launch(const Nf4Source* sources, int count, const Nf4Layout& layout, void* out, cudaStream_t stream) {
  SourceBatch batch;
  bool packed_aligned = true;
  for (int i = 0; i < count; ++i) {
    batch.src[i] = sources[i];
    packed_aligned = packed_aligned && (reinterpret_cast<std::uintptr_t>(sources[i].packed) & 3) == 0;
  }
  // The vector path needs whole 8-value groups, 4-byte aligned packed bytes and 16-byte aligned
  // output rows (blocksize >= 32, so a group never straddles two absmax blocks).
  const bool vec = layout.n % 8 == 0 && layout.blocksize >= 8 && aligned16(out) &&
                   (layout.n * static_cast<std::int64_t>(sizeof(T))) % 16 == 0 && packed_aligned;
  int sms = 132;
  int dev = 0;
  if (cudaGetDevice(&dev) == cudaSuccess) cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  const int threads = 256;
  const std::int64_t work = vec ? layout.n / 8 : (layout.n + 1) / 2;
  // Enough blocks to fill the GPU several times over across all matrices, grid-stride beyond.
  const std::int64_t want = (work + threads - 1) / threads;
  const std::int64_t cap = std::max<std::int64_t>(1, (static_cast<std::int64_t>(sms) * 8 + count - 1) / count);
  const dim3 grid(static_cast<unsigned>(std::min(want, std::max<std::int64_t>(cap, 1))), static_cast<unsigned>(count));
  if (vec)
    dequantize_vec8<T, kNested><<<grid, threads, 0, stream>>>(batch, layout, static_cast<T*>(out));
  else
    dequantize_bytes<T, kNested><<<grid, threads, 0, stream>>>(batch, layout, static_cast<T*>(out));
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_type(const Nf4Source* sources, int count, const Nf4Layout& layout, void* out, cudaStream_t stream) {
  for (int first = 0; first < count; first += kMaxSourcesPerLaunch) {
    const int k = std::min(kMaxSourcesPerLaunch, count - first);
    T* dst = static_cast<T*>(out) + static_cast<std::int64_t>(first) * layout.n;
    const cudaError_t rc = layout.nested ? launch<T, true>(sources + first, k, layout, dst, stream)
                                         : launch<T, false>(sources + first, k, layout, dst, stream);
    if (rc != cudaSuccess) return rc;
  }
  return cudaSuccess;
}

template <typename T>
cudaError_t launch_window(const Nf4Source* sources, int count, const Nf4Layout& layout, const Nf4Window& w, void* out,
                          cudaStream_t stream) {
  if (w.cols % 8 || w.c0 % 8 || w.row_len % 8 || w.r0 < 0 || w.c0 < 0 || w.c0 + w.cols > w.row_len ||
      (w.r0 + w.rows) * w.row_len > layout.n || !aligned16(out) || (w.cols * static_cast<std::int64_t>(sizeof(T))) % 16)
    return cudaErrorInvalidValue;
  for (int i = 0; i < count; ++i)
    if (reinterpret_cast<std::uintptr_t>(sources[i].packed) & 3) return cudaErrorInvalidValue;
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
    if (layout.nested)
      dequantize_window_vec8<T, true><<<grid, threads, 0, stream>>>(batch, layout, w, dst);
    else
      dequantize_window_vec8<T, false><<<grid, threads, 0, stream>>>(batch, layout, w, dst);
    const cudaError_t rc = cudaGetLastError();
    if (rc != cudaSuccess) return rc;
  }
  return cudaSuccess;
}

// torch.bucketize(v, midpoints): midpoints m with !(m >= v); NaN counts all 15.
__device__ __forceinline__ std::uint8_t nf4_index(float v, const float* mid) {
  int idx = 0;
#pragma unroll
  for (int i = 0; i < 15; ++i) idx += !(mid[i] >= v);
  return static_cast<std::uint8_t>(idx);
}

__device__ __forceinline__ float clamp_unit(float x) { return x < -1.0f ? -1.0f : (x > 1.0f ? 1.0f : x); }

// One thread per absmax block (quantisation runs once, at load; simplicity over bandwidth).
__global__ void quantize_blocks(const float* x, std::int64_t n, int blocksize, std::uint8_t* packed, float* absmax) {
  __shared__ float mid[15];
  if (threadIdx.x < 15) mid[threadIdx.x] = __fdiv_rn(__fadd_rn(kCodeConst[threadIdx.x], kCodeConst[threadIdx.x + 1]), 2.0f);
  __syncthreads();
  const std::int64_t nblocks = (n + blocksize - 1) / blocksize, full = n / blocksize;
  for (std::int64_t b = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; b < nblocks;
       b += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t begin = b * blocksize, end = min(n, begin + blocksize);
    float block_max = 0.0f;
    for (std::int64_t i = begin; i < end; ++i) block_max = fmaxf(block_max, fabsf(x[i]));
    const float floored = fmaxf(block_max, 1e-38f);
    const bool whole = b < full;
    absmax[b] = whole ? block_max : floored;
    const float inv = __fdiv_rn(1.0f, floored);
    auto code_of = [&](std::int64_t i) -> std::uint8_t {
      if (i >= end) return nf4_index(0.0f, mid);  // odd total count: pad with 0.0
      return nf4_index(clamp_unit(whole ? __fmul_rn(x[i], inv) : __fdiv_rn(x[i], floored)), mid);
    };
    for (std::int64_t i = begin; i < end; i += 2)
      packed[i / 2] = static_cast<std::uint8_t>((code_of(i) << 4) | code_of(i + 1));
  }
}

}  // namespace

cudaError_t dequantize(const Nf4Source* sources, int count, const Nf4Layout& layout, void* out, OutType type,
                       cudaStream_t stream) {
  if (count <= 0 || layout.n <= 0) return cudaSuccess;
  switch (type) {
    case OutType::F32: return launch_type<float>(sources, count, layout, out, stream);
    case OutType::BF16: return launch_type<__nv_bfloat16>(sources, count, layout, out, stream);
    case OutType::F16: return launch_type<__half>(sources, count, layout, out, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t dequantize_window(const Nf4Source* sources, int count, const Nf4Layout& layout, const Nf4Window& window,
                              void* out, OutType type, cudaStream_t stream) {
  if (count <= 0 || window.rows <= 0 || window.cols <= 0) return cudaSuccess;
  switch (type) {
    case OutType::F32: return launch_window<float>(sources, count, layout, window, out, stream);
    case OutType::BF16: return launch_window<__nv_bfloat16>(sources, count, layout, window, out, stream);
    case OutType::F16: return launch_window<__half>(sources, count, layout, window, out, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t quantize(const float* x, std::int64_t n, int blocksize, std::uint8_t* packed, float* absmax,
                     cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const std::int64_t nblocks = (n + blocksize - 1) / blocksize;
  const int threads = 128;
  const unsigned grid = static_cast<unsigned>(std::min<std::int64_t>((nblocks + threads - 1) / threads, 1 << 20));
  quantize_blocks<<<grid, threads, 0, stream>>>(x, n, blocksize, packed, absmax);
  return cudaGetLastError();
}

}  // namespace eo::nf4::cuda
