// The NF4 grouped GEMM (contract: nf4_expert_gemm_cuda.h; design: docs/design.md, "NF4 inside the
// expert GEMM").
//
// Two launches per call, neither reading anything on the host: a one-block kernel turns the
// cumulative row ends into each group's first tile (a scan of ceil(rows / 128)); the GEMM's grid
// is the bound ceil(M / 128) + min(E, M) row tiles times the column tiles, and a block past the
// real tile count returns at once. A block finds its group by binary search in the scan.
//
// A block computes a 128 x 128 tile of the output with 8 warps (2 x 4, 64 x 32 each: 4 x 4
// mma.sync m16n8k16 per 16 of the contraction), 32 of the contraction per step, two shared-memory
// stages: the next step's activations (16-byte loads) and packed codes (4-byte words, 8 codes each,
// with their block's absmax) are loaded into registers before the current step's MMAs and decoded
// into the other stage after them. The weight tile is held as [weight row][weight column] in
// both products; the forward reads it as mma's column-major B with ldmatrix, the backward as
// row-major B with ldmatrix.trans. The decode is the dequantise kernel's (nf4_cuda.cu): code *
// absmax in fp32, rounded to bf16, so the operands are the bits a dequantised bank would hold.
#include "models/grouped_rows_cuda.cuh"
#include "models/nf4_expert_gemm_cuda.h"

#include <cuda_bf16.h>

#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <atomic>
#include <climits>

namespace eo::nf4_gemm::cuda {
namespace {

constexpr int kBM = 128, kBN = 128, kBK = 32, kThreads = 256;
// Rows padded by 16 bytes: 80-byte rows (A, forward W) and 272-byte rows (backward W) put the 8
// rows an ldmatrix reads in 8 different 16-byte bank groups.
constexpr int kLdA = kBK + 8;   // A tile [kBM][kLdA]
constexpr int kLdWf = kBK + 8;  // forward W tile [kBN output rows][kLdWf]
constexpr int kLdWb = kBN + 8;  // backward W tile [kBK contraction rows][kLdWb]
constexpr int kWTile = kBN * kLdWf > kBK * kLdWb ? kBN * kLdWf : kBK * kLdWb;
constexpr int kScanThreads = 1024;

// The GEMM's device helpers exist only where its body does (sm_80 code; sm_75's kernel is a stub).
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
__constant__ float kCode[16] = {
    -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f, -0.28444138169288635f,
    -0.18477343022823334f, -0.09105003625154495f, 0.0f, 0.07958029955625534f, 0.16093020141124725f,
    0.24611230194568634f, 0.33791524171829224f, 0.44070982933044434f, 0.5626170039176941f,
    0.7229568362236023f, 1.0f};
#endif

struct Args {
  const __nv_bfloat16* a;  // [M, Kc]
  const Nf4Source* sources;
  Nf4Layout layout;
  std::int64_t wk;      // the weight's row length (K)
  std::int64_t Kc, Nc;  // the product's contraction and output width
  const int* offsets;
  int experts;
  std::int64_t M;
  __nv_bfloat16* out;     // [M, Nc]
  const int* tile_start;  // [E + 1]
  int n_tiles;
  int block_shift, nested_shift;  // log2 of the (power-of-two) blocksizes: no 64-bit division per chunk
};

// tile_start[e] = sum over e' < e of ceil(rows(e') / kBM); tile_start[E] the total.
__global__ void __launch_bounds__(kScanThreads) tile_table(const int* offsets, int experts, std::int64_t M,
                                                           int* tile_start) {
  using Scan = cub::BlockScan<int, kScanThreads>;
  __shared__ typename Scan::TempStorage temp;
  __shared__ int carry;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (int base = 0; base < experts; base += kScanThreads) {
    const int e = base + static_cast<int>(threadIdx.x);
    int tiles = 0;
    if (e < experts) {
      std::int64_t start, end;
      grouped_rows::cuda::group_rows(offsets, e, M, start, end);
      tiles = static_cast<int>((end - start + kBM - 1) / kBM);
    }
    int before = 0, total = 0;
    Scan(temp).ExclusiveSum(tiles, before, total);
    if (e < experts) tile_start[e] = carry + before;
    __syncthreads();  // every thread has read carry, and the scan's storage is free again
    if (threadIdx.x == 0) carry += total;
    __syncthreads();
  }
  if (threadIdx.x == 0) tile_start[experts] = carry;
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
// fp32 absmax of block b, as nf4_cuda.cu's block_absmax (nested: code * scale, then + offset, two
// roundings).
template <bool kNested>
__device__ __forceinline__ float block_absmax(const Nf4Source& s, const Nf4Layout& l, int nested_shift,
                                              std::int64_t b) {
  if (!kNested) return __ldg(static_cast<const float*>(s.absmax) + b);
  const std::uint8_t code = __ldg(static_cast<const std::uint8_t*>(s.absmax) + b);
  const float scaled = __fmul_rn(__ldg(l.nested_code + code), __ldg(s.nested_absmax + (b >> nested_shift)));
  return __fadd_rn(scaled, s.offset);
}

// 8 codes (4 bytes; byte k holds values 2k in its high nibble and 2k + 1 in its low one) times
// their block's absmax, as 8 bf16 in one 16-byte word (value 0 at the lowest address).
__device__ __forceinline__ uint4 decode8(std::uint32_t word, float am, const float* code) {
  std::uint32_t h[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const std::uint32_t byte = (word >> (8 * k)) & 0xFF;
    const __nv_bfloat162 v = __floats2bfloat162_rn(__fmul_rn(code[byte >> 4], am), __fmul_rn(code[byte & 15], am));
    h[k] = *reinterpret_cast<const std::uint32_t*>(&v);
  }
  return make_uint4(h[0], h[1], h[2], h[3]);
}

__device__ __forceinline__ std::uint32_t smem_addr(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldmatrix_x4(std::uint32_t (&r)[4], std::uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(std::uint32_t (&r)[4], std::uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                                         std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

#endif

struct Smem {
  __nv_bfloat16 a[2][kBM * kLdA];
  __nv_bfloat16 w[2][kWTile];
  float code[16];
};

// One step's operands in registers between their global loads and their shared-memory stores:
// 2 x 8 activations and 2 x 8 codes with their absmax per thread (512 chunks of 8 per tile each).
struct Staged {
  uint4 a[2];
  std::uint32_t w[2];
  float am[2];
};

template <bool kBackward, bool kNested>
__global__ void __launch_bounds__(kThreads, 2) nf4_grouped_gemm(const Args args) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const int t = static_cast<int>(blockIdx.x);
  const int m_lin = t / args.n_tiles, n_tile = t % args.n_tiles;
  if (m_lin >= args.tile_start[args.experts]) return;
  // The group: the last e with tile_start[e] <= m_lin (groups without rows own no tile).
  int lo = 1, hi = args.experts;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (args.tile_start[mid] > m_lin) hi = mid;
    else lo = mid + 1;
  }
  const int e = lo - 1;
  std::int64_t start, end;
  grouped_rows::cuda::group_rows(args.offsets, e, args.M, start, end);
  const std::int64_t row0 = start + static_cast<std::int64_t>(m_lin - args.tile_start[e]) * kBM;
  const int rows = static_cast<int>(min(static_cast<std::int64_t>(kBM), end - row0));
  const std::int64_t n0 = static_cast<std::int64_t>(n_tile) * kBN;

  __shared__ __align__(16) Smem sm;
  if (threadIdx.x < 16) sm.code[threadIdx.x] = kCode[threadIdx.x];

  const Nf4Source src = args.sources[e];
  const std::uint32_t* packed = reinterpret_cast<const std::uint32_t*>(src.packed);
  const __nv_bfloat16* a_rows = args.a + row0 * args.Kc;
  const int tid = static_cast<int>(threadIdx.x);

  // Global loads of step kt into registers; a chunk outside the group's rows, the contraction or
  // the output width reads as zeros (absmax 0, code 7 = 0.0).
  auto load = [&](int kt, Staged& s) {
    const std::int64_t k0 = static_cast<std::int64_t>(kt) * kBK;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int c = tid + i * kThreads;
      const int r = c >> 2, kc = (c & 3) * 8;
      s.a[i] = make_uint4(0, 0, 0, 0);
      if (r < rows && k0 + kc < args.Kc)
        s.a[i] = __ldg(reinterpret_cast<const uint4*>(a_rows + r * args.Kc + k0 + kc));
      // The weight element this chunk starts at: forward W[n0 + r][k0 + kc] (tile rows are output
      // columns), backward W[k0 + r][n0 + col] (tile rows are the contraction).
      std::int64_t wr, wc;
      bool inside;
      if constexpr (kBackward) {
        const int rb = c >> 4, cb = (c & 15) * 8;
        wr = k0 + rb, wc = n0 + cb;
        inside = wr < args.Kc && wc < args.Nc;
      } else {
        wr = n0 + r, wc = k0 + kc;
        inside = wr < args.Nc && wc < args.Kc;
      }
      s.w[i] = 0x77777777u;
      s.am[i] = 0.0f;
      if (inside) {
        const std::int64_t flat = wr * args.wk + wc;
        s.w[i] = __ldg(packed + flat / 8);
        s.am[i] = block_absmax<kNested>(src, args.layout, args.nested_shift, flat >> args.block_shift);
      }
    }
  };
  auto store = [&](const Staged& s, int stage) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int c = tid + i * kThreads;
      *reinterpret_cast<uint4*>(&sm.a[stage][(c >> 2) * kLdA + (c & 3) * 8]) = s.a[i];
      const int w_at = kBackward ? (c >> 4) * kLdWb + (c & 15) * 8 : (c >> 2) * kLdWf + (c & 3) * 8;
      *reinterpret_cast<uint4*>(&sm.w[stage][w_at]) = decode8(s.w[i], s.am[i], sm.code);
    }
  };

  const int lane = tid & 31, warp = tid >> 5;
  const int wm = (warp >> 2) * 64, wn = (warp & 3) * 32;  // the warp's 64 x 32 of the tile
  float acc[4][4][4] = {};

  const int steps = static_cast<int>((args.Kc + kBK - 1) / kBK);
  Staged staged;
  load(0, staged);
  __syncthreads();  // sm.code
  store(staged, 0);
  __syncthreads();
  for (int kt = 0; kt < steps; ++kt) {
    const int stage = kt & 1;
    if (kt + 1 < steps) load(kt + 1, staged);
#pragma unroll
    for (int ks = 0; ks < kBK; ks += 16) {
      std::uint32_t af[4][4];
#pragma unroll
      for (int mi = 0; mi < 4; ++mi) {
        // Matrices 0..3 of x4: rows 0-7 / 8-15 at k 0-7, then at k 8-15 (mma's a0..a3).
        const int row = wm + mi * 16 + (lane & 15), col = ks + (lane >> 4) * 8;
        ldmatrix_x4(af[mi], smem_addr(&sm.a[stage][row * kLdA + col]));
      }
      std::uint32_t bf[4][2];
#pragma unroll
      for (int p = 0; p < 2; ++p) {
        std::uint32_t r[4];
        if constexpr (kBackward) {
          // Tile [k][n]: matrices k 0-7 / 8-15 of n-block 0, then of n-block 1, transposed.
          const int k = ks + (lane & 7) + ((lane >> 3) & 1) * 8, n = wn + p * 16 + (lane >> 4) * 8;
          ldmatrix_x4_trans(r, smem_addr(&sm.w[stage][k * kLdWb + n]));
        } else {
          // Tile [n][k]: matrices k 0-7 / 8-15 of n-block 0, then of n-block 1.
          const int n = wn + p * 16 + (lane & 7) + (lane >> 4) * 8, k = ks + ((lane >> 3) & 1) * 8;
          ldmatrix_x4(r, smem_addr(&sm.w[stage][n * kLdWf + k]));
        }
        bf[2 * p][0] = r[0], bf[2 * p][1] = r[1], bf[2 * p + 1][0] = r[2], bf[2 * p + 1][1] = r[3];
      }
#pragma unroll
      for (int mi = 0; mi < 4; ++mi)
#pragma unroll
        for (int nj = 0; nj < 4; ++nj) mma_bf16(acc[mi][nj], af[mi], bf[nj][0], bf[nj][1]);
    }
    // The other stage was last read in step kt - 1, before the barrier that ended it.
    if (kt + 1 < steps) store(staged, stage ^ 1);
    __syncthreads();
  }

  // Accumulator (mi, nj): rows g and g + 8 of its 16, columns 2 (lane % 4) and + 1 of its 8.
  const int g = lane >> 2, c2 = (lane & 3) * 2;
#pragma unroll
  for (int mi = 0; mi < 4; ++mi)
#pragma unroll
    for (int nj = 0; nj < 4; ++nj) {
      const std::int64_t col = n0 + wn + nj * 8 + c2;
      if (col >= args.Nc) continue;  // Nc % 8 == 0: col + 1 is inside with col
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = wm + mi * 16 + g + h * 8;
        if (r < rows)
          *reinterpret_cast<__nv_bfloat162*>(args.out + (row0 + r) * args.Nc + col) =
              __floats2bfloat162_rn(acc[mi][nj][2 * h], acc[mi][nj][2 * h + 1]);
      }
    }
#endif
}

template <bool kBackward>
cudaError_t launch_gemm(const Args& args, unsigned blocks, cudaStream_t s) {
  if (args.layout.nested)
    nf4_grouped_gemm<kBackward, true><<<blocks, kThreads, 0, s>>>(args);
  else
    nf4_grouped_gemm<kBackward, false><<<blocks, kThreads, 0, s>>>(args);
  return cudaGetLastError();
}

bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }
// log2(n) for a power of two, else -1.
int log2_exact(int n) {
  if (n <= 0 || (n & (n - 1))) return -1;
  int shift = 0;
  while ((1 << shift) < n) ++shift;
  return shift;
}

}  // namespace

cudaError_t available() {
  static std::atomic<int> arch[64];  // per device: 0 not asked yet, -1 no image
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) return cudaErrorNoKernelImageForDevice;
  int a = arch[device].load(std::memory_order_relaxed);
  if (a == 0) {
    // ptxVersion: the virtual architecture the running code came from (a compute_75 PTX build
    // JIT-compiled on a newer card gives 75, whose kernel is a stub).
    cudaFuncAttributes attributes{};
    a = cudaFuncGetAttributes(&attributes, nf4_grouped_gemm<false, false>) == cudaSuccess ? attributes.ptxVersion : -1;
    if (a <= 0) (void)cudaGetLastError(), a = -1;
    arch[device].store(a, std::memory_order_relaxed);
  }
  return a >= 80 ? cudaSuccess : cudaErrorNoKernelImageForDevice;
}

std::size_t workspace_bytes(int experts) {
  const std::size_t e = experts > 0 ? std::size_t(experts) : 0;
  return (sizeof(int) * (e + 1) + 15) / 16 * 16;
}

cudaError_t grouped(Product product, const void* a, const Nf4Source* sources, const Nf4Layout& layout, std::int64_t N,
                    std::int64_t K, const int* offsets, int experts, void* out, std::int64_t M, void* workspace,
                    cudaStream_t stream) {
  if (M < 0 || N < 0 || K < 0 || experts < 0 || N % 8 || K % 8 || N > INT32_MAX || K > INT32_MAX ||
      layout.n != N * K || log2_exact(layout.blocksize) < 3 ||
      (layout.nested && (layout.nested_code == nullptr || log2_exact(layout.nested_blocksize) < 0)))
    return cudaErrorInvalidValue;
  if (!aligned16(a) || !aligned16(out) || !aligned16(workspace)) return cudaErrorInvalidValue;
  if (const cudaError_t rc = available(); rc != cudaSuccess) return rc;
  const bool backward = product == Product::kBackward;
  const std::int64_t Kc = backward ? N : K, Nc = backward ? K : N;
  if (M == 0 || Nc == 0) return cudaSuccess;
  if (experts == 0 || Kc == 0) return cudaMemsetAsync(out, 0, std::size_t(M) * Nc * sizeof(__nv_bfloat16), stream);
  grouped_rows::cuda::zero_uncovered<<<32, 256, 0, stream>>>(static_cast<uint4*>(out), offsets, experts, M, Nc);
  int* tile_start = static_cast<int*>(workspace);
  tile_table<<<1, kScanThreads, 0, stream>>>(offsets, experts, M, tile_start);
  if (const cudaError_t rc = cudaGetLastError(); rc != cudaSuccess) return rc;
  // Every group adds at most one partial row tile to ceil(M / kBM), and only a group with rows.
  const std::int64_t n_tiles = (Nc + kBN - 1) / kBN;
  const std::int64_t m_tiles = (M + kBM - 1) / kBM + std::min<std::int64_t>(experts, M);
  if (m_tiles * n_tiles > INT_MAX) return cudaErrorInvalidValue;
  Args args{};
  args.a = static_cast<const __nv_bfloat16*>(a);
  args.sources = sources;
  args.layout = layout;
  args.wk = K;
  args.Kc = Kc;
  args.Nc = Nc;
  args.offsets = offsets;
  args.experts = experts;
  args.M = M;
  args.out = static_cast<__nv_bfloat16*>(out);
  args.tile_start = tile_start;
  args.n_tiles = static_cast<int>(n_tiles);
  args.block_shift = log2_exact(layout.blocksize);
  args.nested_shift = layout.nested ? log2_exact(layout.nested_blocksize) : 0;
  const auto blocks = static_cast<unsigned>(m_tiles * n_tiles);
  return backward ? launch_gemm<true>(args, blocks, stream) : launch_gemm<false>(args, blocks, stream);
}

}  // namespace eo::nf4_gemm::cuda
