// The gated delta rule's chunk chain (contract: delta_rule_cuda.h). One block per (pair, 32 value
// columns); lane = column, so every shared-memory read of the state or of y is one word per lane and
// every read of P or Q is a broadcast. fp32 throughout, sums in a fixed order (deterministic).
#include "models/delta_rule_cuda.h"

#include <cstddef>

namespace eo::delta_rule::cuda {
namespace {

constexpr int kCols = 32;                  // value columns per block: one warp's lanes
constexpr int kWarps = 8;
constexpr int kThreads = kCols * kWarps;
constexpr int kMaxChunk = 16 * kWarps;     // y's rows c = warp + kWarps · r, r < 16
constexpr int kMaxRowsPerWarp = 32;        // the state's rows d = warp · R + r, r < R ≤ 32: dk ≤ 256

// The state slice [dk][kCols], one chunk of P or Q [C][dk], y's slice [C][kCols].
std::size_t shared_bytes(const ChainShape& s) {
  return sizeof(float) * (std::size_t(s.dk) * kCols + std::size_t(s.C) * s.dk + std::size_t(s.C) * kCols);
}
// Each warp's share of the state's rows, a multiple of 4 (float4 reads of Q's rows).
int rows_per_warp(int dk) { return ((dk + kWarps - 1) / kWarps + 3) / 4 * 4; }

__device__ __forceinline__ void copy_chunk(float* dst, const float* __restrict__ src, int n) {
  for (int e = threadIdx.x; e < n; e += kThreads) dst[e] = src[e];
}

__global__ void __launch_bounds__(kThreads) chunk_chain_kernel(ChainShape s, ChainArgs a, int rows) {
  extern __shared__ float4 shared_f4[];
  float* st = reinterpret_cast<float*>(shared_f4);  // [dk][kCols]
  float* m = st + s.dk * kCols;                     // [C][dk]: P[n], then Q[n]
  float* yv = m + s.C * s.dk;                       // [C][kCols]
  const int lane = threadIdx.x % kCols, warp = threadIdx.x / kCols;
  const int dk = s.dk, dv = s.dv, C = s.C;
  const std::int64_t pair = blockIdx.x;
  const int col = blockIdx.y * kCols + lane;
  const bool live = col < dv;  // columns past dv stay zero
  const int d0 = warp * rows;

  for (int d = warp; d < dk; d += kWarps) st[d * kCols + lane] = live ? a.state[(pair * dk + d) * dv + col] : 0.f;
  __syncthreads();
  for (std::int64_t i = 0; i < s.chunks; ++i) {
    const std::int64_t pn = pair * s.chunks + (a.reverse ? s.chunks - 1 - i : i);
    if (live)
      for (int d = warp; d < dk; d += kWarps) a.saved[(pn * dk + d) * dv + col] = st[d * kCols + lane];
    copy_chunk(m, a.p + pn * C * dk, C * dk);
    __syncthreads();

    // y = x + sign_p · P S, rows c = warp + kWarps · r.
    float acc[kMaxChunk / kWarps];
#pragma unroll
    for (int r = 0; r < kMaxChunk / kWarps; ++r) acc[r] = 0.f;
    for (int d = 0; d < dk; d += 4) {
      const float s0 = st[d * kCols + lane], s1 = st[(d + 1) * kCols + lane], s2 = st[(d + 2) * kCols + lane],
                  s3 = st[(d + 3) * kCols + lane];
#pragma unroll
      for (int r = 0; r < kMaxChunk / kWarps; ++r) {
        const int c = warp + kWarps * r;
        if (c < C) {
          const float4 pv = *reinterpret_cast<const float4*>(m + c * dk + d);
          acc[r] = fmaf(pv.w, s3, fmaf(pv.z, s2, fmaf(pv.y, s1, fmaf(pv.x, s0, acc[r]))));
        }
      }
    }
    const float* x = a.x + pn * C * dv;
    float* y = a.y + pn * C * dv;
#pragma unroll
    for (int r = 0; r < kMaxChunk / kWarps; ++r) {
      const int c = warp + kWarps * r;
      if (c < C) {
        const float out = live ? x[c * dv + col] + a.sign_p * acc[r] : 0.f;
        yv[c * kCols + lane] = out;
        if (live) y[c * dv + col] = out;
      }
    }
    __syncthreads();  // every warp is done with P and has written its rows of y
    copy_chunk(m, a.q + pn * C * dk, C * dk);
    __syncthreads();

    // S = decay · S + z + sign_q · Qᵀ y, rows d = d0 + r.
    float sacc[kMaxRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kMaxRowsPerWarp; ++r) sacc[r] = 0.f;
    for (int c = 0; c < C; ++c) {
      const float yc = yv[c * kCols + lane];
#pragma unroll
      for (int r = 0; r < kMaxRowsPerWarp; r += 4) {
        if (r < rows && d0 + r < dk) {
          const float4 qv = *reinterpret_cast<const float4*>(m + c * dk + d0 + r);
          sacc[r] = fmaf(qv.x, yc, sacc[r]);
          sacc[r + 1] = fmaf(qv.y, yc, sacc[r + 1]);
          sacc[r + 2] = fmaf(qv.z, yc, sacc[r + 2]);
          sacc[r + 3] = fmaf(qv.w, yc, sacc[r + 3]);
        }
      }
    }
    const float decay = a.decay[pn];
    const float* z = a.z ? a.z + pn * dk * dv : nullptr;
#pragma unroll
    for (int r = 0; r < kMaxRowsPerWarp; ++r) {
      const int d = d0 + r;
      if (r < rows && d < dk) {
        float next = decay * st[d * kCols + lane];
        if (z && live) next += z[d * dv + col];
        st[d * kCols + lane] = live ? next + a.sign_q * sacc[r] : 0.f;
      }
    }
    __syncthreads();  // the state is whole again, and Q's buffer free for the next chunk's P
  }
  if (live)
    for (int d = warp; d < dk; d += kWarps) a.final_state[(pair * dk + d) * dv + col] = st[d * kCols + lane];
}

// Column j of T = (I + A)⁻¹: T[i][j] = [i = j] − Σ_{k<i} A[i][k] T[k][j], with T[k][j] = 0 above the
// diagonal, so every thread runs the same loop (A's reads are broadcasts, T's one word per lane).
__global__ void unit_lower_inverse_kernel(const float* __restrict__ a, float* __restrict__ inv, int C) {
  extern __shared__ float4 shared_f4[];
  float* sa = reinterpret_cast<float*>(shared_f4);  // [C][C]
  float* st = sa + C * C;                           // [C][C]
  const std::int64_t base = static_cast<std::int64_t>(blockIdx.x) * C * C;
  for (int e = threadIdx.x; e < C * C; e += blockDim.x) sa[e] = a[base + e];
  __syncthreads();
  const int j = threadIdx.x;
  if (j < C) {
    for (int i = 0; i < C; ++i) {
      float acc = i == j ? 1.f : 0.f;
      if (i > j)
        for (int k = j; k < i; ++k) acc = fmaf(-sa[i * C + k], st[k * C + j], acc);
      st[i * C + j] = acc;
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < C * C; e += blockDim.x) inv[base + e] = st[e];
}

}  // namespace

bool chain_fits(const ChainShape& s) {
  if (s.C < 1 || s.C > kMaxChunk || s.dk < 4 || s.dk % 4 != 0 || rows_per_warp(s.dk) > kMaxRowsPerWarp || s.dv < 1)
    return false;
  int device = 0, optin = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess)
    return false;
  return shared_bytes(s) <= static_cast<std::size_t>(optin);
}

cudaError_t chunk_chain(const ChainShape& s, const ChainArgs& a, cudaStream_t stream) {
  if (s.pairs == 0 || s.chunks == 0) return cudaSuccess;
  const std::size_t bytes = shared_bytes(s);
  if (bytes > 48 * 1024) {
    const cudaError_t rc =
        cudaFuncSetAttribute(chunk_chain_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
    if (rc != cudaSuccess) return rc;
  }
  const dim3 grid(static_cast<unsigned>(s.pairs), static_cast<unsigned>((s.dv + kCols - 1) / kCols));
  chunk_chain_kernel<<<grid, kThreads, bytes, stream>>>(s, a, rows_per_warp(s.dk));
  return cudaGetLastError();
}

cudaError_t unit_lower_inverse(const float* a, float* inv, std::int64_t batch, int C, cudaStream_t stream) {
  if (batch == 0) return cudaSuccess;
  if (C < 1 || C > kMaxInverseC) return cudaErrorInvalidValue;
  const std::size_t bytes = sizeof(float) * 2 * std::size_t(C) * C;
  if (bytes > 48 * 1024) {
    const cudaError_t rc = cudaFuncSetAttribute(unit_lower_inverse_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                static_cast<int>(bytes));
    if (rc != cudaSuccess) return rc;
  }
  const int threads = (C + 31) / 32 * 32;
  unit_lower_inverse_kernel<<<static_cast<unsigned>(batch), threads, bytes, stream>>>(a, inv, C);
  return cudaGetLastError();
}

}  // namespace eo::delta_rule::cuda
