// The portable grouped GEMM (contract: expert_gemm_cuda.h). One small kernel turns the cumulative
// row ends into CUTLASS's problem table on the device; CUTLASS's grouped kernel, scheduling its
// tiles on the device (GroupScheduleMode::kDeviceOnly: no host-side precompute), then runs them.
// Two tile shapes: 128 x 128 for the expert matrices, 64 x 64 where one side is a LoRA rank.
#include "models/expert_gemm_cuda.h"

#include <cutlass/cutlass.h>
#include <cutlass/epilogue/thread/linear_combination.h>
#include <cutlass/gemm/device/gemm_grouped.h>
#include <cutlass/gemm/kernel/default_gemm_grouped.h>

#include <algorithm>
#include <mutex>

// CUTLASS's sm80 bf16 tensor-core kernels compile to a stub that only prints "not implemented"
// below sm_80 (the default build has sm_75 for the T4, whose fp16 runs take libtorch's GEMM per
// expert). The stub is never launched: the host routes only bf16 operands on a card with bf16
// tensor cores here (models/grouped_mm.cpp, bf16_grouped_operands and grouped_mm_contract, both
// behind device_has_bf16_mma). The row-table kernels below run on every architecture.

namespace eo::expert_gemm::cuda {
namespace {

using Element = cutlass::bfloat16_t;
using Row = cutlass::layout::RowMajor;
using Col = cutlass::layout::ColumnMajor;
using LongIndex = Row::Stride::LongIndex;
constexpr int kAlign = 8;  // elements per 16-byte access

template <typename LayoutA, typename LayoutB, int kTileM, int kTileN, int kWarpM, int kWarpN, int kStages>
struct Config {
  using Kernel = typename cutlass::gemm::kernel::DefaultGemmGrouped<
      Element, LayoutA, cutlass::ComplexTransform::kNone, kAlign, Element, LayoutB, cutlass::ComplexTransform::kNone,
      kAlign, Element, Row, float, cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80,
      cutlass::gemm::GemmShape<kTileM, kTileN, 32>, cutlass::gemm::GemmShape<kWarpM, kWarpN, 32>,
      cutlass::gemm::GemmShape<16, 8, 16>,
      cutlass::epilogue::thread::LinearCombination<Element, kAlign, float, float,
                                                   cutlass::epilogue::thread::ScaleType::OnlyAlphaScaling>,
      cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<1>, kStages,
      cutlass::gemm::kernel::GroupScheduleMode::kDeviceOnly>::GemmKernel;
  using Gemm = cutlass::gemm::device::GemmGrouped<Kernel>;
};
// 64 KiB of shared memory at 4 stages: one block per SM even on the 100 KiB parts (sm_86/89/120).
template <typename A, typename B>
using Wide = Config<A, B, 128, 128, 64, 64, 4>;
template <typename A, typename B>
using Narrow = Config<A, B, 64, 64, 32, 32, 4>;

// The problem table in the workspace: E entries of each array, 8-byte aligned.
struct Table {
  cutlass::gemm::GemmCoord* problems;
  Element **a, **b, **d;
  LongIndex *lda, *ldb, *ldd;
};
std::size_t round8(std::size_t n) { return (n + 7) / 8 * 8; }
Table table_in(void* workspace, int experts) {
  auto* p = static_cast<char*>(workspace);
  Table t{};
  t.problems = reinterpret_cast<cutlass::gemm::GemmCoord*>(p);
  p += round8(sizeof(cutlass::gemm::GemmCoord) * experts);
  t.a = reinterpret_cast<Element**>(p), p += sizeof(Element*) * experts;
  t.b = reinterpret_cast<Element**>(p), p += sizeof(Element*) * experts;
  t.d = reinterpret_cast<Element**>(p), p += sizeof(Element*) * experts;
  t.lda = reinterpret_cast<LongIndex*>(p), p += sizeof(LongIndex) * experts;
  t.ldb = reinterpret_cast<LongIndex*>(p), p += sizeof(LongIndex) * experts;
  t.ldd = reinterpret_cast<LongIndex*>(p);
  return t;
}

__device__ __forceinline__ void group_rows(const int* offsets, int e, std::int64_t M, std::int64_t& start,
                                           std::int64_t& end) {
  start = e == 0 ? 0 : offsets[e - 1];
  end = offsets[e];
  start = start < 0 ? 0 : (start > M ? M : start);
  end = end < start ? start : (end > M ? M : end);
}

__global__ void rows_table(Table t, const Element* a, const Element* b, bool b_nk, const int* offsets, int experts,
                           Element* out, std::int64_t M, std::int64_t N, std::int64_t K) {
  for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < experts; e += gridDim.x * blockDim.x) {
    std::int64_t start, end;
    group_rows(offsets, e, M, start, end);
    t.problems[e] = cutlass::gemm::GemmCoord(int(end - start), int(N), int(K));
    t.a[e] = const_cast<Element*>(a) + start * K;
    t.b[e] = const_cast<Element*>(b) + std::int64_t(e) * K * N;
    t.d[e] = out + start * N;
    t.lda[e] = K;
    t.ldb[e] = b_nk ? K : N;
    t.ldd[e] = N;
  }
}

__global__ void contract_table(Table t, const Element* a, const Element* g, const int* offsets, int experts,
                               Element* out, std::int64_t M, std::int64_t Ka, std::int64_t N) {
  for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < experts; e += gridDim.x * blockDim.x) {
    std::int64_t start, end;
    group_rows(offsets, e, M, start, end);
    const int rows = int(end - start);
    // No rows: no tiles (m = 0); the output was zeroed before the GEMM.
    t.problems[e] = cutlass::gemm::GemmCoord(rows > 0 ? int(Ka) : 0, int(N), rows);
    t.a[e] = const_cast<Element*>(a) + start * Ka;  // a's rows as the columns of a column-major [Ka, rows]
    t.b[e] = const_cast<Element*>(g) + start * N;
    t.d[e] = out + std::int64_t(e) * Ka * N;
    t.lda[e] = Ka;
    t.ldb[e] = N;
    t.ldd[e] = N;
  }
}

// Rows [offsets[E-1], M) of out, which no group covers, to zero (a few blocks: usually none).
__global__ void zero_uncovered(uint4* out, const int* offsets, int experts, std::int64_t M, std::int64_t N) {
  std::int64_t covered = experts > 0 ? offsets[experts - 1] : 0;
  covered = covered < 0 ? 0 : (covered > M ? M : covered);
  const std::int64_t first = covered * N / 8, words = M * N / 8;
  for (std::int64_t i = first + blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < words;
       i += std::int64_t(gridDim.x) * blockDim.x)
    out[i] = make_uint4(0, 0, 0, 0);
}

// One wave of blocks at the kernel's occupancy, computed once per kernel and device.
template <typename Gemm>
int threadblocks() {
  static std::mutex mu;
  static int count[64] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) return 0;
  std::lock_guard<std::mutex> lock(mu);
  if (count[device] == 0) count[device] = Gemm::sufficient();
  return count[device];
}

template <typename Gemm>
cudaError_t run(const Table& t, int experts, cudaStream_t s) {
  const int blocks = threadblocks<Gemm>();
  if (blocks <= 0) return cudaErrorLaunchOutOfResources;
  typename Gemm::Arguments args(t.problems, experts, blocks, {1.0f, 0.0f}, t.a, t.b, t.d, t.d, t.lda, t.ldb, t.ldd,
                                t.ldd);
  Gemm gemm;
  if (gemm.initialize(args, nullptr, s) != cutlass::Status::kSuccess) return cudaErrorInvalidConfiguration;
  if (gemm.run(s) != cutlass::Status::kSuccess) {
    const cudaError_t rc = cudaGetLastError();
    return rc == cudaSuccess ? cudaErrorLaunchFailure : rc;
  }
  return cudaSuccess;
}

bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }
unsigned table_blocks(int experts) { return unsigned((experts + 255) / 256); }

}  // namespace

cudaError_t probe_kernel_image() {
  cudaFuncAttributes attributes{};
  return cudaFuncGetAttributes(&attributes, rows_table);
}

std::size_t workspace_bytes(int experts) {
  const std::size_t e = experts > 0 ? std::size_t(experts) : 0;
  return round8(sizeof(cutlass::gemm::GemmCoord) * e) + 3 * sizeof(void*) * e + 3 * sizeof(LongIndex) * e;
}

cudaError_t grouped_rows(const void* a, const void* b, bool b_nk, const int* offsets, int experts, void* out,
                         std::int64_t M, std::int64_t N, std::int64_t K, void* workspace, cudaStream_t s) {
  if (M < 0 || N < 0 || K < 0 || experts < 0 || K % kAlign || N % kAlign || M > INT32_MAX || N > INT32_MAX ||
      K > INT32_MAX)
    return cudaErrorInvalidValue;
  if (!aligned16(a) || !aligned16(b) || !aligned16(out) || !aligned16(workspace)) return cudaErrorInvalidValue;
  if (M == 0 || N == 0) return cudaSuccess;
  auto* o = static_cast<Element*>(out);
  zero_uncovered<<<32, 256, 0, s>>>(static_cast<uint4*>(out), offsets, experts, M, N);
  if (experts == 0 || K == 0) {
    if (K == 0) return cudaMemsetAsync(out, 0, std::size_t(M) * N * sizeof(Element), s);
    return cudaGetLastError();
  }
  const Table t = table_in(workspace, experts);
  rows_table<<<table_blocks(experts), 256, 0, s>>>(t, static_cast<const Element*>(a), static_cast<const Element*>(b),
                                                   b_nk, offsets, experts, o, M, N, K);
  if (const cudaError_t rc = cudaGetLastError(); rc != cudaSuccess) return rc;
  const bool narrow = N <= 64;
  if (b_nk) return narrow ? run<Narrow<Row, Col>::Gemm>(t, experts, s) : run<Wide<Row, Col>::Gemm>(t, experts, s);
  return narrow ? run<Narrow<Row, Row>::Gemm>(t, experts, s) : run<Wide<Row, Row>::Gemm>(t, experts, s);
}

cudaError_t grouped_contract(const void* a, const void* g, const int* offsets, int experts, void* out, std::int64_t M,
                             std::int64_t Ka, std::int64_t N, void* workspace, cudaStream_t s) {
  if (M < 0 || Ka < 0 || N < 0 || experts < 0 || Ka % kAlign || N % kAlign || M > INT32_MAX || Ka > INT32_MAX ||
      N > INT32_MAX)
    return cudaErrorInvalidValue;
  if (!aligned16(a) || !aligned16(g) || !aligned16(out) || !aligned16(workspace)) return cudaErrorInvalidValue;
  if (experts == 0 || Ka == 0 || N == 0) return cudaSuccess;
  if (const cudaError_t rc = cudaMemsetAsync(out, 0, std::size_t(experts) * Ka * N * sizeof(Element), s);
      rc != cudaSuccess || M == 0)
    return rc;
  const Table t = table_in(workspace, experts);
  contract_table<<<table_blocks(experts), 256, 0, s>>>(t, static_cast<const Element*>(a),
                                                       static_cast<const Element*>(g), offsets, experts,
                                                       static_cast<Element*>(out), M, Ka, N);
  if (const cudaError_t rc = cudaGetLastError(); rc != cudaSuccess) return rc;
  const bool narrow = Ka <= 64 || N <= 64;
  return narrow ? run<Narrow<Col, Row>::Gemm>(t, experts, s) : run<Wide<Col, Row>::Gemm>(t, experts, s);
}

}  // namespace eo::expert_gemm::cuda
