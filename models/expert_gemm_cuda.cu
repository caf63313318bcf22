// The portable grouped GEMM (contract: expert_gemm_cuda.h). One small kernel turns the cumulative
// row ends into CUTLASS's problem table on the device; CUTLASS's grouped kernel, scheduling its
// tiles on the device (GroupScheduleMode::kDeviceOnly: no host-side precompute), then runs them.
// Two tile shapes: 128 x 128 for the expert matrices, 64 x 64 where one side is a LoRA rank.
// Two mainloops: sm80's (mma 16x8x16, cp.async, 4 stages) for bf16 and fp16 where the code that
// runs is sm_80 or newer, sm75's (mma 16x8x8, 2 stages) for fp16 on sm_75 (T4).
#include "models/grouped_rows_cuda.cuh"
#include "models/expert_gemm_cuda.h"

#include <cutlass/cutlass.h>
#include <cutlass/epilogue/thread/linear_combination.h>
#include <cutlass/gemm/device/gemm_grouped.h>
#include <cutlass/gemm/kernel/default_gemm_grouped.h>

#include <algorithm>
#include <atomic>
#include <mutex>

namespace eo::expert_gemm::cuda {
namespace {

using Row = cutlass::layout::RowMajor;
using Col = cutlass::layout::ColumnMajor;
using LongIndex = Row::Stride::LongIndex;
constexpr int kAlign = 8;  // elements per 16-byte access
// Both dtypes are 16 bits wide: the problem table's pointers are computed in 2-byte units and read
// by CUTLASS as its element type.
using Bits = std::uint16_t;

// The mainloop of each architecture: instruction shape and pipeline depth (sm75's mainloop is
// CUTLASS's two-stage MmaPipelined; sm80's is multistage with cp.async).
template <typename Arch>
struct Mainloop;
template <>
struct Mainloop<cutlass::arch::Sm80> {
  using Instruction = cutlass::gemm::GemmShape<16, 8, 16>;
  static constexpr int kStages = 4;  // 64 KiB of shared memory wide: one block per SM on the 100 KiB parts
  static constexpr int kMinArch = 800, kEndArch = 1 << 30;
};
template <>
struct Mainloop<cutlass::arch::Sm75> {
  using Instruction = cutlass::gemm::GemmShape<16, 8, 8>;
  static constexpr int kStages = 2;
  static constexpr int kMinArch = 750, kEndArch = 800;
};

// A kernel's body compiled only into the code of the architectures it is chosen for (__CUDA_ARCH__
// from kMinArch up to kEndArch, the same virtual architecture kernel_arch reads): sm80's would be a
// stub below sm_80 and sm75's is never chosen on sm_80+ (path_for), so neither costs compile time
// or code size where it cannot run.
template <typename Base, int kMinArch, int kEndArch>
struct OnArchs : Base {
  CUTLASS_DEVICE void operator()(typename Base::Params const& params, typename Base::SharedStorage& shared) {
#if defined(__CUDA_ARCH__)
    if constexpr (__CUDA_ARCH__ >= kMinArch && __CUDA_ARCH__ < kEndArch) Base::operator()(params, shared);
#endif
  }
};

template <typename Element, typename Arch, typename LayoutA, typename LayoutB, int kTileM, int kTileN, int kWarpM,
          int kWarpN>
struct Config {
  using M = Mainloop<Arch>;
  using Base = typename cutlass::gemm::kernel::DefaultGemmGrouped<
      Element, LayoutA, cutlass::ComplexTransform::kNone, kAlign, Element, LayoutB, cutlass::ComplexTransform::kNone,
      kAlign, Element, Row, float, cutlass::arch::OpClassTensorOp, Arch, cutlass::gemm::GemmShape<kTileM, kTileN, 32>,
      cutlass::gemm::GemmShape<kWarpM, kWarpN, 32>, typename M::Instruction,
      cutlass::epilogue::thread::LinearCombination<Element, kAlign, float, float,
                                                   cutlass::epilogue::thread::ScaleType::OnlyAlphaScaling>,
      cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<1>, M::kStages,
      cutlass::gemm::kernel::GroupScheduleMode::kDeviceOnly>::GemmKernel;
  using Gemm = cutlass::gemm::device::GemmGrouped<OnArchs<Base, M::kMinArch, M::kEndArch>>;
};
template <typename Element, typename Arch, typename A, typename B>
using Wide = Config<Element, Arch, A, B, 128, 128, 64, 64>;
template <typename Element, typename Arch, typename A, typename B>
using Narrow = Config<Element, Arch, A, B, 64, 64, 32, 32>;

// The problem table in the workspace: E entries of each array, 8-byte aligned.
struct Table {
  cutlass::gemm::GemmCoord* problems;
  Bits **a, **b, **d;
  LongIndex *lda, *ldb, *ldd;
};
std::size_t round8(std::size_t n) { return (n + 7) / 8 * 8; }
Table table_in(void* workspace, int experts) {
  auto* p = static_cast<char*>(workspace);
  Table t{};
  t.problems = reinterpret_cast<cutlass::gemm::GemmCoord*>(p);
  p += round8(sizeof(cutlass::gemm::GemmCoord) * experts);
  t.a = reinterpret_cast<Bits**>(p), p += sizeof(Bits*) * experts;
  t.b = reinterpret_cast<Bits**>(p), p += sizeof(Bits*) * experts;
  t.d = reinterpret_cast<Bits**>(p), p += sizeof(Bits*) * experts;
  t.lda = reinterpret_cast<LongIndex*>(p), p += sizeof(LongIndex) * experts;
  t.ldb = reinterpret_cast<LongIndex*>(p), p += sizeof(LongIndex) * experts;
  t.ldd = reinterpret_cast<LongIndex*>(p);
  return t;
}

__global__ void rows_table(Table t, const Bits* a, const Bits* b, bool b_nk, const int* offsets, int experts, Bits* out,
                           std::int64_t M, std::int64_t N, std::int64_t K) {
  for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < experts; e += gridDim.x * blockDim.x) {
    std::int64_t start, end;
    grouped_rows::cuda::group_rows(offsets, e, M, start, end);
    t.problems[e] = cutlass::gemm::GemmCoord(int(end - start), int(N), int(K));
    t.a[e] = const_cast<Bits*>(a) + start * K;
    t.b[e] = const_cast<Bits*>(b) + std::int64_t(e) * K * N;
    t.d[e] = out + start * N;
    t.lda[e] = K;
    t.ldb[e] = b_nk ? K : N;
    t.ldd[e] = N;
  }
}

__global__ void contract_table(Table t, const Bits* a, const Bits* g, const int* offsets, int experts, Bits* out,
                               std::int64_t M, std::int64_t Ka, std::int64_t N) {
  for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < experts; e += gridDim.x * blockDim.x) {
    std::int64_t start, end;
    grouped_rows::cuda::group_rows(offsets, e, M, start, end);
    const int rows = int(end - start);
    // No rows: no tiles (m = 0); the output was zeroed before the GEMM.
    t.problems[e] = cutlass::gemm::GemmCoord(rows > 0 ? int(Ka) : 0, int(N), rows);
    t.a[e] = const_cast<Bits*>(a) + start * Ka;  // a's rows as the columns of a column-major [Ka, rows]
    t.b[e] = const_cast<Bits*>(g) + start * N;
    t.d[e] = out + std::int64_t(e) * Ka * N;
    t.lda[e] = Ka;
    t.ldb[e] = N;
    t.ldd[e] = N;
  }
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
  using A = typename Gemm::ElementA;
  using B = typename Gemm::ElementB;
  using C = typename Gemm::ElementC;
  static_assert(sizeof(A) == sizeof(Bits) && sizeof(B) == sizeof(Bits) && sizeof(C) == sizeof(Bits));
  C** d = reinterpret_cast<C**>(t.d);
  typename Gemm::Arguments args(t.problems, experts, blocks, {1.0f, 0.0f}, reinterpret_cast<A**>(t.a),
                                reinterpret_cast<B**>(t.b), d, d, t.lda, t.ldb, t.ldd, t.ldd);
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

// Which mainloop serves a dtype on the current device (by kernel_arch: the code that runs there).
enum class Path { kNone, kSm75, kSm80 };
Path path_for(DType dtype) {
  const int arch = kernel_arch();
  if (arch >= 80) return Path::kSm80;
  if (arch >= 75 && dtype == DType::F16) return Path::kSm75;
  return Path::kNone;
}

template <typename Element, typename Arch>
cudaError_t rows_gemm(const Table& t, int experts, bool b_nk, bool narrow, cudaStream_t s) {
  if (b_nk)
    return narrow ? run<typename Narrow<Element, Arch, Row, Col>::Gemm>(t, experts, s)
                  : run<typename Wide<Element, Arch, Row, Col>::Gemm>(t, experts, s);
  return narrow ? run<typename Narrow<Element, Arch, Row, Row>::Gemm>(t, experts, s)
                : run<typename Wide<Element, Arch, Row, Row>::Gemm>(t, experts, s);
}

template <typename Element, typename Arch>
cudaError_t contract_gemm(const Table& t, int experts, bool narrow, cudaStream_t s) {
  return narrow ? run<typename Narrow<Element, Arch, Col, Row>::Gemm>(t, experts, s)
                : run<typename Wide<Element, Arch, Col, Row>::Gemm>(t, experts, s);
}

}  // namespace

cudaError_t probe_kernel_image() {
  cudaFuncAttributes attributes{};
  return cudaFuncGetAttributes(&attributes, rows_table);
}

int kernel_arch() {
  static std::atomic<int> arch[64];  // per device: 0 not asked yet, -1 no image
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) return 0;
  int a = arch[device].load(std::memory_order_relaxed);
  if (a == 0) {
    // The virtual architecture the running code was compiled from, as CUB's PtxVersion reads it:
    // 75 for compute_75 PTX JIT-compiled on a newer card, the SASS's architecture otherwise.
    cudaFuncAttributes attributes{};
    a = cudaFuncGetAttributes(&attributes, rows_table) == cudaSuccess ? attributes.ptxVersion : -1;
    if (a <= 0) (void)cudaGetLastError(), a = -1;
    arch[device].store(a, std::memory_order_relaxed);
  }
  return a > 0 ? a : 0;
}

bool takes(DType dtype) { return path_for(dtype) != Path::kNone; }

std::size_t workspace_bytes(int experts) {
  const std::size_t e = experts > 0 ? std::size_t(experts) : 0;
  return round8(sizeof(cutlass::gemm::GemmCoord) * e) + 3 * sizeof(void*) * e + 3 * sizeof(LongIndex) * e;
}

cudaError_t grouped_rows(DType dtype, const void* a, const void* b, bool b_nk, const int* offsets, int experts,
                         void* out, std::int64_t M, std::int64_t N, std::int64_t K, void* workspace, cudaStream_t s) {
  if (M < 0 || N < 0 || K < 0 || experts < 0 || K % kAlign || N % kAlign || M > INT32_MAX || N > INT32_MAX ||
      K > INT32_MAX)
    return cudaErrorInvalidValue;
  if (!aligned16(a) || !aligned16(b) || !aligned16(out) || !aligned16(workspace)) return cudaErrorInvalidValue;
  const Path path = path_for(dtype);
  if (path == Path::kNone) return cudaErrorNoKernelImageForDevice;
  if (M == 0 || N == 0) return cudaSuccess;
  grouped_rows::cuda::zero_uncovered<<<32, 256, 0, s>>>(static_cast<uint4*>(out), offsets, experts, M, N);
  if (experts == 0 || K == 0) {
    if (K == 0) return cudaMemsetAsync(out, 0, std::size_t(M) * N * sizeof(Bits), s);
    return cudaGetLastError();
  }
  const Table t = table_in(workspace, experts);
  rows_table<<<table_blocks(experts), 256, 0, s>>>(t, static_cast<const Bits*>(a), static_cast<const Bits*>(b), b_nk,
                                                   offsets, experts, static_cast<Bits*>(out), M, N, K);
  if (const cudaError_t rc = cudaGetLastError(); rc != cudaSuccess) return rc;
  const bool narrow = N <= 64;
  if (path == Path::kSm75) return rows_gemm<cutlass::half_t, cutlass::arch::Sm75>(t, experts, b_nk, narrow, s);
  if (dtype == DType::F16) return rows_gemm<cutlass::half_t, cutlass::arch::Sm80>(t, experts, b_nk, narrow, s);
  return rows_gemm<cutlass::bfloat16_t, cutlass::arch::Sm80>(t, experts, b_nk, narrow, s);
}

cudaError_t grouped_contract(DType dtype, const void* a, const void* g, const int* offsets, int experts, void* out,
                             std::int64_t M, std::int64_t Ka, std::int64_t N, void* workspace, cudaStream_t s) {
  if (M < 0 || Ka < 0 || N < 0 || experts < 0 || Ka % kAlign || N % kAlign || M > INT32_MAX || Ka > INT32_MAX ||
      N > INT32_MAX)
    return cudaErrorInvalidValue;
  if (!aligned16(a) || !aligned16(g) || !aligned16(out) || !aligned16(workspace)) return cudaErrorInvalidValue;
  const Path path = path_for(dtype);
  if (path == Path::kNone) return cudaErrorNoKernelImageForDevice;
  if (experts == 0 || Ka == 0 || N == 0) return cudaSuccess;
  if (const cudaError_t rc = cudaMemsetAsync(out, 0, std::size_t(experts) * Ka * N * sizeof(Bits), s);
      rc != cudaSuccess || M == 0)
    return rc;
  const Table t = table_in(workspace, experts);
  contract_table<<<table_blocks(experts), 256, 0, s>>>(t, static_cast<const Bits*>(a), static_cast<const Bits*>(g),
                                                       offsets, experts, static_cast<Bits*>(out), M, Ka, N);
  if (const cudaError_t rc = cudaGetLastError(); rc != cudaSuccess) return rc;
  const bool narrow = Ka <= 64 || N <= 64;
  if (path == Path::kSm75) return contract_gemm<cutlass::half_t, cutlass::arch::Sm75>(t, experts, narrow, s);
  if (dtype == DType::F16) return contract_gemm<cutlass::half_t, cutlass::arch::Sm80>(t, experts, narrow, s);
  return contract_gemm<cutlass::bfloat16_t, cutlass::arch::Sm80>(t, experts, narrow, s);
}

}  // namespace eo::expert_gemm::cuda
