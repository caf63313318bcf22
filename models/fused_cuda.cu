// Fused elementwise kernels (contract: fused_cuda.h). Grid-stride loops over plain arrays; the
// load/store helpers convert each storage type to fp32 and back with round-to-nearest.
#include "models/fused_cuda.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

namespace eo::fused::cuda {
namespace {

template <typename T>
struct Cvt;
template <>
struct Cvt<float> {
  static __device__ float in(float v) { return v; }
  static __device__ float out(float v) { return v; }
};
template <>
struct Cvt<__nv_bfloat16> {
  static __device__ float in(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __device__ __nv_bfloat16 out(float v) { return __float2bfloat16_rn(v); }
};
template <>
struct Cvt<__half> {
  static __device__ float in(__half v) { return __half2float(v); }
  static __device__ __half out(float v) { return __float2half_rn(v); }
};

__device__ __forceinline__ float sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

template <typename T>
__device__ __forceinline__ float sum_of(const T* __restrict__ a, const T* __restrict__ b, std::int64_t i) {
  return b ? Cvt<T>::in(a[i]) + Cvt<T>::in(b[i]) : Cvt<T>::in(a[i]);
}

// 16 bytes of values per load and store (8 bf16 / fp16, 4 fp32): the elementwise kernels run
// on these chunks where every operand is 16-byte aligned and n a multiple of kVec<T>.
template <typename T>
constexpr int kVec = 16 / sizeof(T);
template <typename T>
__device__ __forceinline__ void load_chunk(const T* __restrict__ p, std::int64_t chunk, float (&out)[kVec<T>]) {
  const uint4 raw = reinterpret_cast<const uint4*>(p)[chunk];
  const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int k = 0; k < kVec<T>; ++k) out[k] = Cvt<T>::in(v[k]);
}
// out += p's chunk, where p is given (a LoRA delta).
template <typename T>
__device__ __forceinline__ void add_chunk(const T* __restrict__ p, std::int64_t chunk, float (&out)[kVec<T>]) {
  if (!p) return;
  float d[kVec<T>];
  load_chunk(p, chunk, d);
#pragma unroll
  for (int k = 0; k < kVec<T>; ++k) out[k] += d[k];
}
template <typename T>
__device__ __forceinline__ void store_chunk(T* __restrict__ p, std::int64_t chunk, const float (&in)[kVec<T>]) {
  uint4 raw;
  T* v = reinterpret_cast<T*>(&raw);
#pragma unroll
  for (int k = 0; k < kVec<T>; ++k) v[k] = Cvt<T>::out(in[k]);
  reinterpret_cast<uint4*>(p)[chunk] = raw;
}

bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }  // null counts as aligned

template <typename T>
__global__ void swiglu_forward_kernel(const T* __restrict__ g0, const T* __restrict__ g1, const T* __restrict__ u0,
                                      const T* __restrict__ u1, T* __restrict__ h, std::int64_t n, bool vec) {
  constexpr int V = kVec<T>;
  const std::int64_t items = vec ? n / V : n;
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < items;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    if (!vec) {
      const float gv = sum_of(g0, g1, i), uv = sum_of(u0, u1, i);
      h[i] = Cvt<T>::out(gv * sigmoid(gv) * uv);
      continue;
    }
    float g[V], u[V], o[V];
    load_chunk(g0, i, g);
    add_chunk(g1, i, g);
    load_chunk(u0, i, u);
    add_chunk(u1, i, u);
#pragma unroll
    for (int k = 0; k < V; ++k) o[k] = g[k] * sigmoid(g[k]) * u[k];
    store_chunk(h, i, o);
  }
}

template <typename T>
__global__ void swiglu_backward_kernel(const T* __restrict__ g0, const T* __restrict__ g1, const T* __restrict__ u0,
                                       const T* __restrict__ u1, const T* __restrict__ dh, const T* __restrict__ dh1,
                                       T* __restrict__ dg, T* __restrict__ du, std::int64_t n, bool vec) {
  constexpr int V = kVec<T>;
  const std::int64_t items = vec ? n / V : n;
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < items;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    if (!vec) {
      const float gv = sum_of(g0, g1, i), uv = sum_of(u0, u1, i), d = sum_of(dh, dh1, i);
      const float s = sigmoid(gv);
      dg[i] = Cvt<T>::out(d * uv * s * (1.0f + gv * (1.0f - s)));
      du[i] = Cvt<T>::out(d * gv * s);
      continue;
    }
    float g[V], u[V], d[V], og[V], ou[V];
    load_chunk(g0, i, g);
    add_chunk(g1, i, g);
    load_chunk(u0, i, u);
    add_chunk(u1, i, u);
    load_chunk(dh, i, d);
    add_chunk(dh1, i, d);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float s = sigmoid(g[k]);
      og[k] = d[k] * u[k] * s * (1.0f + g[k] * (1.0f - s));
      ou[k] = d[k] * g[k] * s;
    }
    store_chunk(dg, i, og);
    store_chunk(du, i, ou);
  }
}

// Calls f(row, chunk, item) for every item of a [rows, per_row] grid, grid-stride: a chunk is 16
// bytes of a row where the rows allow it (cols a multiple of kVec<T>, every row aligned), else one
// value, and an output row's item is row * per_row + chunk.
template <typename F>
__device__ __forceinline__ void for_each_row_item(std::int64_t rows, std::int64_t per_row, F&& f) {
  const std::int64_t total = rows * per_row;
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < total;
       i += std::int64_t(gridDim.x) * blockDim.x)
    f(i / per_row, i % per_row, i);
}

// Each output item: the sum over j < fanout of weight[row * fanout + j] * (x + y)[index[row *
// fanout + j]] (y, weight null: none, 1), in order, in fp32, rounded once.
template <typename T>
__global__ void gather_sum_rows_kernel(const T* __restrict__ x, const T* __restrict__ y, const std::int64_t* __restrict__ index,
                                       const float* __restrict__ weight, T* __restrict__ out, std::int64_t rows, int fanout,
                                       std::int64_t cols, bool vec) {
  constexpr int V = kVec<T>;
  const std::int64_t per_row = vec ? cols / V : cols;
  for_each_row_item(rows, per_row, [&](std::int64_t row, std::int64_t c, std::int64_t i) {
    const std::int64_t* src = index + row * fanout;
    const float* w = weight ? weight + row * fanout : nullptr;
    if (!vec) {
      float acc = 0;
      for (int j = 0; j < fanout; ++j) {
        const float v = sum_of(x, y, src[j] * per_row + c);
        acc += w ? w[j] * v : v;
      }
      out[i] = Cvt<T>::out(acc);
      return;
    }
    float acc[V] = {};
    for (int j = 0; j < fanout; ++j) {
      float v[V];
      load_chunk(x, src[j] * per_row + c, v);
      add_chunk(y, src[j] * per_row + c, v);
      const float wj = w ? w[j] : 1.0f;
#pragma unroll
      for (int k = 0; k < V; ++k) acc[k] += wj * v[k];
    }
    store_chunk(out, i, acc);
  });
}

// out[o] = dot(g[o / fanout, :], (x + y)[index[o], :]) in fp32 for o < rows * fanout: one warp per
// output, its lanes over the columns (16-byte chunks where the rows allow), a shuffle reduction.
template <typename T>
__global__ void gather_dot_rows_kernel(const T* __restrict__ x, const T* __restrict__ y, const std::int64_t* __restrict__ index,
                                       const T* __restrict__ g, float* __restrict__ out, std::int64_t rows, int fanout,
                                       std::int64_t cols, bool vec) {
  constexpr int V = kVec<T>;
  const std::int64_t per_row = vec ? cols / V : cols;
  const int lane = threadIdx.x % 32;
  const std::int64_t warps = std::int64_t(gridDim.x) * blockDim.x / 32;
  for (std::int64_t o = (blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x) / 32; o < rows * fanout; o += warps) {
    const std::int64_t src = index[o] * per_row, dst = (o / fanout) * per_row;
    float acc = 0;
    for (std::int64_t c = lane; c < per_row; c += 32) {
      if (!vec) {
        acc += sum_of(x, y, src + c) * Cvt<T>::in(g[dst + c]);
        continue;
      }
      float a[V], b[V];
      load_chunk(x, src + c, a);
      add_chunk(y, src + c, a);
      load_chunk(g, dst + c, b);
#pragma unroll
      for (int k = 0; k < V; ++k) acc += a[k] * b[k];
    }
    for (int off = 16; off > 0; off /= 2) acc += __shfl_down_sync(0xffffffffu, acc, off);
    if (lane == 0) out[o] = acc;
  }
}

// One thread per (row, head, pair j < rot_dim/2): reads x[j], x[j + half] and writes both; the
// pass-through dims (rot_dim < head_dim) are copied by the threads with j in [half, D - half).
template <typename T>
__global__ void rope_kernel(const T* __restrict__ x, const T* __restrict__ cos, const T* __restrict__ sin,
                            T* __restrict__ out, std::int64_t rows, int heads, int D, int rot, bool backward) {
  const int half = rot / 2;
  const int per_head = D - half;  // pairs, then the pass-through dims
  const std::int64_t total = rows * heads * per_head;
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < total;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    const int j = int(i % per_head);
    const std::int64_t rh = i / per_head;  // row * heads + head
    const std::int64_t row = rh / heads;
    const T* xh = x + rh * D;
    T* oh = out + rh * D;
    if (j >= half) {  // pass-through dim rot + (j - half)
      const int d = rot + (j - half);
      oh[d] = xh[d];
      continue;
    }
    const T* c = cos + row * rot;
    const T* s = sin + row * rot;
    const float x1 = Cvt<T>::in(xh[j]), x2 = Cvt<T>::in(xh[j + half]);
    const float c1 = Cvt<T>::in(c[j]), c2 = Cvt<T>::in(c[j + half]);
    const float s1 = Cvt<T>::in(s[j]), s2 = Cvt<T>::in(s[j + half]);
    if (!backward) {  // out = x*cos + rotate_half(x)*sin, rotate_half(x) = [-x2, x1]
      oh[j] = Cvt<T>::out(x1 * c1 - x2 * s1);
      oh[j + half] = Cvt<T>::out(x2 * c2 + x1 * s2);
    } else {  // dx = dy*cos + R^T(dy*sin), R^T(z) = [z2, -z1]
      oh[j] = Cvt<T>::out(x1 * c1 + x2 * s2);
      oh[j + half] = Cvt<T>::out(x2 * c2 - x1 * s1);
    }
  }
}

unsigned grid_for(std::int64_t n, int block) {
  const std::int64_t want = (n + block - 1) / block;
  return static_cast<unsigned>(std::max<std::int64_t>(1, std::min<std::int64_t>(want, 132 * 32)));
}

template <template <typename> class Launch, typename... A>
cudaError_t by_type(DType t, A... a) {
  switch (t) {
    case DType::F32: Launch<float>::run(a...); break;
    case DType::BF16: Launch<__nv_bfloat16>::run(a...); break;
    case DType::F16: Launch<__half>::run(a...); break;
  }
  return cudaGetLastError();
}

constexpr int kBlock = 256;

template <typename T>
struct SwigluForward {
  static void run(const void* g0, const void* g1, const void* u0, const void* u1, void* h, std::int64_t n, cudaStream_t s) {
    const bool vec = n % kVec<T> == 0 && aligned16(g0) && aligned16(g1) && aligned16(u0) && aligned16(u1) && aligned16(h);
    swiglu_forward_kernel<T><<<grid_for(vec ? n / kVec<T> : n, kBlock), kBlock, 0, s>>>(
        static_cast<const T*>(g0), static_cast<const T*>(g1), static_cast<const T*>(u0), static_cast<const T*>(u1),
        static_cast<T*>(h), n, vec);
  }
};
template <typename T>
struct SwigluBackward {
  static void run(const void* g0, const void* g1, const void* u0, const void* u1, const void* dh, const void* dh1, void* dg,
                  void* du, std::int64_t n, cudaStream_t s) {
    const bool vec = n % kVec<T> == 0 && aligned16(g0) && aligned16(g1) && aligned16(u0) && aligned16(u1) && aligned16(dh) &&
                     aligned16(dh1) && aligned16(dg) && aligned16(du);
    swiglu_backward_kernel<T><<<grid_for(vec ? n / kVec<T> : n, kBlock), kBlock, 0, s>>>(
        static_cast<const T*>(g0), static_cast<const T*>(g1), static_cast<const T*>(u0), static_cast<const T*>(u1),
        static_cast<const T*>(dh), static_cast<const T*>(dh1), static_cast<T*>(dg), static_cast<T*>(du), n, vec);
  }
};
template <typename T>
struct GatherSumRows {
  static void run(const void* x, const void* y, const std::int64_t* index, const float* weight, void* out, std::int64_t rows,
                  int fanout, std::int64_t cols, cudaStream_t s) {
    const bool vec = cols % kVec<T> == 0 && aligned16(x) && aligned16(y) && aligned16(out);
    const std::int64_t n = rows * (vec ? cols / kVec<T> : cols);
    gather_sum_rows_kernel<T><<<grid_for(n, kBlock), kBlock, 0, s>>>(static_cast<const T*>(x), static_cast<const T*>(y), index,
                                                                      weight, static_cast<T*>(out), rows, fanout, cols, vec);
  }
};
template <typename T>
struct GatherDotRows {
  static void run(const void* x, const void* y, const std::int64_t* index, const void* g, float* out, std::int64_t rows,
                  int fanout, std::int64_t cols, cudaStream_t s) {
    const bool vec = cols % kVec<T> == 0 && aligned16(x) && aligned16(y) && aligned16(g);
    gather_dot_rows_kernel<T><<<grid_for(rows * fanout * 32, kBlock), kBlock, 0, s>>>(
        static_cast<const T*>(x), static_cast<const T*>(y), index, static_cast<const T*>(g), out, rows, fanout, cols, vec);
  }
};
template <typename T>
struct Rope {
  static void run(const void* x, const void* c, const void* sn, void* out, std::int64_t rows, int heads, int D, int rot,
                  bool backward, cudaStream_t s) {
    const std::int64_t n = rows * heads * (D - rot / 2);
    rope_kernel<T><<<grid_for(n, kBlock), kBlock, 0, s>>>(static_cast<const T*>(x), static_cast<const T*>(c),
                                                         static_cast<const T*>(sn), static_cast<T*>(out), rows, heads, D,
                                                         rot, backward);
  }
};

}  // namespace

cudaError_t swiglu_forward(const void* g0, const void* g1, const void* u0, const void* u1, void* h, std::int64_t n,
                           DType t, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  return by_type<SwigluForward>(t, g0, g1, u0, u1, h, n, s);
}

cudaError_t swiglu_backward(const void* g0, const void* g1, const void* u0, const void* u1, const void* dh, const void* dh1,
                            void* dg, void* du, std::int64_t n, DType t, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  return by_type<SwigluBackward>(t, g0, g1, u0, u1, dh, dh1, dg, du, n, s);
}

cudaError_t gather_sum_rows(const void* x, const void* y, const std::int64_t* index, const float* weight, void* out,
                            std::int64_t rows, int fanout, std::int64_t cols, DType t, cudaStream_t s) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  return by_type<GatherSumRows>(t, x, y, index, weight, out, rows, fanout, cols, s);
}

cudaError_t gather_dot_rows(const void* x, const void* y, const std::int64_t* index, const void* g, float* out,
                            std::int64_t rows, int fanout, std::int64_t cols, DType t, cudaStream_t s) {
  if (rows == 0) return cudaSuccess;
  if (cols == 0) return cudaMemsetAsync(out, 0, sizeof(float) * rows * fanout, s);
  return by_type<GatherDotRows>(t, x, y, index, g, out, rows, fanout, cols, s);
}

cudaError_t rope(const void* x, const void* cos, const void* sin, void* out, std::int64_t rows, int heads, int head_dim,
                 int rot_dim, bool backward, DType t, cudaStream_t s) {
  if (rows == 0) return cudaSuccess;
  return by_type<Rope>(t, x, cos, sin, out, rows, heads, head_dim, rot_dim, backward, s);
}

}  // namespace eo::fused::cuda
