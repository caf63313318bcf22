// The small-K grouped GEMM (contract: grouped_mm_cuda.h). Work comes in 64 x 128 output tiles:
// a tile's A rows (all of K) are loaded once; for each expert whose rows meet the tile, that
// expert's [K, 128] slice of B is loaded and the 8 warps (2 x 4, 32 x 32 each) run bf16 WMMA
// into fp32 fragments, which go out through a per-warp shared staging tile as 16-byte stores of
// the rows that belong to the expert. Tiles that straddle two experts compute twice; with the
// 128 rows an expert gets on average (Qwen3, 2048 tokens) that is about half the tiles, cheap
// beside the output write this kernel is bound by.
#include "models/grouped_mm_cuda.h"

#include <cuda_bf16.h>
#include <mma.h>

#include <algorithm>
#include <cstdint>

namespace eo::grouped_mm::cuda {
namespace {

constexpr int kBM = 64, kBN = 128, kThreads = 256, kPad = 8;
constexpr int kLdA = kMaxK + kPad;                       // As: [kBM][kLdA]
constexpr int kLdBnk = kMaxK + kPad;                     // Bs as [kBN][kLdBnk] (B_e^T stored: col-major B)
constexpr int kLdBkn = kBN + kPad;                       // Bs as [kMaxK][kLdBkn] (row-major B)
constexpr int kBsElems = std::max(kBN * kLdBnk, kMaxK * kLdBkn);

// Two fp32 values as one 32-bit word of bf16 (round to nearest), for the 16-byte output stores:
// storing each 8 values as four 4-byte writes (PTX st.global.u32) writes pieces of sectors, which
// capped the outputs at about 650 GB/s on the H200 (docs/benchmarks-history.md, "a small-K grouped
// GEMM that was no faster").
__device__ __forceinline__ unsigned bf16x2_bits(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const unsigned*>(&h);
}

// Persistent: each block takes a run of consecutive (row tile, column tile) items, so its A
// rows and the expert search carry over between the column tiles of a row tile, and the
// offsets sit in shared memory. (Against a block per tile walking the offsets in global memory
// this measured the same on the H200: the limit was elsewhere, most likely the output stores
// then split into 4-byte pieces, fixed since and not yet timed.)
template <bool kNK>
__global__ void __launch_bounds__(kThreads, 3)
    small_k_grouped_mm_kernel(const __nv_bfloat16* __restrict__ a, const __nv_bfloat16* __restrict__ b,
                              const int* __restrict__ offsets, int experts, __nv_bfloat16* __restrict__ out,
                              std::int64_t M, std::int64_t N, int K, std::int64_t items_per_block) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  using namespace nvcuda;
  __shared__ int ends[kMaxExperts];
  __shared__ __align__(128) __nv_bfloat16 As[kBM * kLdA];
  __shared__ __align__(128) __nv_bfloat16 Bs[kBsElems];
  __shared__ __align__(128) float Cs[kThreads / 32][16 * 16];

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int kp = (K + 15) / 16 * 16;  // K padded with zero columns to the WMMA step
  const uint4 zero = make_uint4(0, 0, 0, 0);
  // The output as 16-byte words, indexed (N % 8 == 0): written through a cast of `out + offset`,
  // nvcc split each 16-byte store into 4-byte ones (PTX st.global.u32).
  uint4* const out16 = reinterpret_cast<uint4*>(out);
  const std::int64_t col_tiles = (N + kBN - 1) / kBN, items = (M + kBM - 1) / kBM * col_tiles;
  const std::int64_t first = std::int64_t(blockIdx.x) * items_per_block;
  const std::int64_t last = first + items_per_block < items ? first + items_per_block : items;
  for (int i = tid; i < experts; i += kThreads) ends[i] = offsets[i];
  const std::int64_t covered = experts > 0 ? offsets[experts - 1] : 0;  // rows past it are zero
  const int wr = warp / 4, wc = warp % 4;  // this warp's 32 x 32 of the tile
  using BLayout = typename std::conditional<kNK, wmma::col_major, wmma::row_major>::type;

  std::int64_t row_tile = -1;
  int lo = 0;  // the first expert whose rows end past the row tile's start
  for (std::int64_t item = first; item < last; ++item) {
    const std::int64_t row0 = item / col_tiles * kBM, col0 = item % col_tiles * kBN;
    const std::int64_t tile_end = row0 + kBM < M ? row0 + kBM : M;
    if (item / col_tiles != row_tile) {
      row_tile = item / col_tiles;
      __syncthreads();  // the previous row tile's A is no longer read; ends[] is complete
      for (int c = tid; c < kBM * (kp / 8); c += kThreads) {
        const int r = c / (kp / 8), k = (c % (kp / 8)) * 8;
        const std::int64_t m = row0 + r;
        *reinterpret_cast<uint4*>(&As[r * kLdA + k]) =
            (m < M && k < K) ? *reinterpret_cast<const uint4*>(a + m * K + k) : zero;
      }
      int hi = experts;
      lo = 0;
      while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (ends[mid] > row0) hi = mid;
        else lo = mid + 1;
      }
    }
    for (int e = lo; e < experts; ++e) {
      const std::int64_t start = e == 0 ? 0 : ends[e - 1];
      if (start >= tile_end) break;
      const std::int64_t rlo = start > row0 ? start : row0;
      const std::int64_t rhi = ends[e] < tile_end ? ends[e] : tile_end;
      if (rlo >= rhi) continue;  // block-uniform: every thread reaches the barriers below

      __syncthreads();  // the previous B tile is no longer read
      const __nv_bfloat16* be = b + std::int64_t(e) * K * N;
      if (kNK) {
        for (int c = tid; c < kBN * (kp / 8); c += kThreads) {
          const int n = c / (kp / 8), k = (c % (kp / 8)) * 8;
          *reinterpret_cast<uint4*>(&Bs[n * kLdBnk + k]) =
              (col0 + n < N && k < K) ? *reinterpret_cast<const uint4*>(be + (col0 + n) * K + k) : zero;
        }
      } else {
        for (int c = tid; c < kp * (kBN / 8); c += kThreads) {
          const int k = c / (kBN / 8), n = (c % (kBN / 8)) * 8;
          *reinterpret_cast<uint4*>(&Bs[k * kLdBkn + n]) =
              (k < K && col0 + n < N) ? *reinterpret_cast<const uint4*>(be + std::int64_t(k) * N + col0 + n) : zero;
        }
      }
      __syncthreads();  // B (and a newly loaded A) visible to every warp

      const std::int64_t wrow = row0 + wr * 32, wcol = col0 + wc * 32;
      if (wrow >= rhi || wrow + 32 <= rlo || wcol >= N) continue;  // warp-uniform; the next barrier is at the loop top
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
      for (int i = 0; i < 2; ++i)
        for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.0f);
      for (int k = 0; k < kp; k += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa[2];
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, BLayout> fb[2];
        for (int i = 0; i < 2; ++i) wmma::load_matrix_sync(fa[i], &As[(wr * 32 + 16 * i) * kLdA + k], kLdA);
        for (int j = 0; j < 2; ++j) {
          const int n = wc * 32 + 16 * j;
          if (kNK) wmma::load_matrix_sync(fb[j], &Bs[n * kLdBnk + k], kLdBnk);
          else wmma::load_matrix_sync(fb[j], &Bs[k * kLdBkn + n], kLdBkn);
        }
        for (int i = 0; i < 2; ++i)
          for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
      }
      // Each fragment through the warp's staging tile: lane = (row, half), 8 columns per store.
      const int rr = lane / 2, cc = (lane % 2) * 8;
      for (int i = 0; i < 2; ++i)
        for (int j = 0; j < 2; ++j) {
          wmma::store_matrix_sync(Cs[warp], acc[i][j], 16, wmma::mem_row_major);
          __syncwarp();
          const std::int64_t m = wrow + 16 * i + rr, n = wcol + 16 * j + cc;
          if (m >= rlo && m < rhi && n < N) {
            const float4 lo = *reinterpret_cast<const float4*>(&Cs[warp][rr * 16 + cc]);
            const float4 hi = *reinterpret_cast<const float4*>(&Cs[warp][rr * 16 + cc + 4]);
            out16[(m * N + n) / 8] =
                make_uint4(bf16x2_bits(lo.x, lo.y), bf16x2_bits(lo.z, lo.w), bf16x2_bits(hi.x, hi.y), bf16x2_bits(hi.z, hi.w));
          }
          __syncwarp();
        }
    }
    const std::int64_t zlo = covered > row0 ? covered : row0;
    for (std::int64_t c = tid; zlo < tile_end && c < (tile_end - zlo) * (kBN / 8); c += kThreads) {
      const std::int64_t m = zlo + c / (kBN / 8), n = col0 + (c % (kBN / 8)) * 8;
      if (n < N) out16[(m * N + n) / 8] = zero;
    }
  }
#endif
}

bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

}  // namespace

cudaError_t small_k_grouped_mm(const void* a, const void* b, bool b_nk, const int* offsets, int experts, void* out,
                               std::int64_t M, std::int64_t N, int K, cudaStream_t s) {
  if (K <= 0 || K > kMaxK || K % 8 || N % 8 || M < 0 || N < 0 || experts < 0 || experts > kMaxExperts)
    return cudaErrorInvalidValue;
  if (!aligned16(a) || !aligned16(b) || !aligned16(out)) return cudaErrorInvalidValue;
  if (M == 0 || N == 0) return cudaSuccess;
  // One wave of blocks (3 per SM, the launch bound), each a run of consecutive items.
  int device = 0, sms = 0;
  cudaError_t rc = cudaGetDevice(&device);
  if (rc == cudaSuccess) rc = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (rc != cudaSuccess) return rc;
  const std::int64_t items = (M + kBM - 1) / kBM * ((N + kBN - 1) / kBN);
  const std::int64_t blocks = std::min<std::int64_t>(items, std::int64_t(std::max(sms, 1)) * 3);
  const std::int64_t per = (items + blocks - 1) / blocks;
  const auto* av = static_cast<const __nv_bfloat16*>(a);
  const auto* bv = static_cast<const __nv_bfloat16*>(b);
  auto* ov = static_cast<__nv_bfloat16*>(out);
  const unsigned grid = static_cast<unsigned>((items + per - 1) / per);
  if (b_nk) small_k_grouped_mm_kernel<true><<<grid, kThreads, 0, s>>>(av, bv, offsets, experts, ov, M, N, K, per);
  else small_k_grouped_mm_kernel<false><<<grid, kThreads, 0, s>>>(av, bv, offsets, experts, ov, M, N, K, per);
  return cudaGetLastError();
}

}  // namespace eo::grouped_mm::cuda
