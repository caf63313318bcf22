// The portable grouped GEMM of the experts (models/grouped_mm.h, expert_gemm_cuda.h), label `cuda`,
// in bf16 and in fp16 (the T4's dtype: sm75's kernel where the build's code is sm_75, e.g. a
// -DCMAKE_CUDA_ARCHITECTURES=75-virtual build JIT-compiled on a newer card; sm80's kernel otherwise):
//  - the build's code on this GPU (expert_gemm_cuda.h kernel_arch) is the architecture CMake built
//    for it, and the kernel takes bf16 from sm_80 code and fp16 from sm_75 code;
//  - against a float64 reference (each group's rows times its matrix, in float64 on the GPU) within
//    the dtype's rounding, for the two expert GEMMs of Qwen3-30B-A3B, OLMoE-1B-7B, Mixtral-8x7B and
//    gpt-oss-20b layers and the expert LoRA's rank-16 GEMMs, with uneven groups, empty experts, one
//    expert taking every row and rows past the last group; torch's op held to the same bound on
//    the same operands;
//  - the backward (dX and the a^T g weight gradient) through grouped_mm's autograd;
//  - every group empty, and no rows at all: zeros written over whatever the memory held;
//  - with no host synchronisation (CUDA's sync debug mode set to error) and captured in a CUDA
//    graph whose replay follows new group sizes written into the same offsets tensor.
// A bf16 test is skipped (and says so) where the build's code for the GPU is older than sm_80.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "models/grouped_mm.h"
#include "runtime/ddp/world.h"

#ifdef EO_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "models/expert_gemm_cuda.h"
#endif

using namespace eo;

#define REQUIRE_CUDA() \
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device (this test runs on the GPU machine: ctest -L cuda)"

#ifdef EO_WITH_CUDA
namespace {

struct Shape {
  std::string name;
  std::int64_t experts, K, N;
  bool b_nk;  // B stored as [E, N, K] (an HF expert weight read as its transpose)
};

enum class Groups { kUneven, kEmptyExperts, kOneExpert, kUncoveredTail };

std::vector<std::int64_t> group_counts(Groups g, std::int64_t experts, std::int64_t rows, std::uint64_t seed) {
  std::vector<std::int64_t> c(static_cast<std::size_t>(experts), 0);
  std::mt19937_64 rng(seed);
  switch (g) {
    case Groups::kOneExpert:
      c[static_cast<std::size_t>(experts / 2)] = rows;
      return c;
    case Groups::kEmptyExperts:  // every third expert empty, the rest skewed
    case Groups::kUneven:
    case Groups::kUncoveredTail: {
      std::vector<double> w(c.size());
      for (std::size_t e = 0; e < w.size(); ++e) {
        const bool empty = g == Groups::kEmptyExperts && e % 3 == 0;
        w[e] = empty ? 0.0 : 1.0 + double(rng() % 1000) / 100.0;  // 1x to 11x
      }
      double sum = 0;
      for (double x : w) sum += x;
      const std::int64_t covered = g == Groups::kUncoveredTail ? rows - 37 : rows;
      std::int64_t given = 0;
      for (std::size_t e = 0; e < c.size(); ++e) given += c[e] = std::int64_t(std::floor(w[e] / sum * double(covered)));
      for (std::size_t e = 0; given < covered; e = (e + 1) % c.size())
        if (w[e] > 0) ++c[e], ++given;
      return c;
    }
  }
  return c;
}

at::Tensor offsets_on(const std::vector<std::int64_t>& counts, const at::Device& dev) {
  return at::tensor(counts, at::kLong).cumsum(0).to(at::kInt).to(dev);
}

// y = a · B_e per group in float64 (GPU), and the same product of |a| and |B_e| (for the bound).
std::pair<at::Tensor, at::Tensor> reference(const at::Tensor& a, const at::Tensor& b, const std::vector<std::int64_t>& counts) {
  const at::Tensor a64 = a.to(at::kDouble), b64 = b.to(at::kDouble);
  at::Tensor y = at::zeros({a.size(0), b.size(2)}, a64.options()), mag = at::zeros_like(y);
  std::int64_t row = 0;
  for (std::size_t e = 0; e < counts.size(); ++e) {
    if (counts[e] > 0) {
      const at::Tensor ae = a64.narrow(0, row, counts[e]);
      y.narrow(0, row, counts[e]).copy_(at::mm(ae, b64[static_cast<std::int64_t>(e)]));
      mag.narrow(0, row, counts[e]).copy_(at::mm(ae.abs(), b64[static_cast<std::int64_t>(e)].abs()));
    }
    row += counts[e];
  }
  return {y, mag};
}

// The dtype under test and its rounding: u, half an ulp relative (bf16 2^-8, fp16 2^-11), and the
// absolute half-ulp below the normal range (fp16's subnormals: 2^-25; bf16 has fp32's range).
struct Kind {
  at::ScalarType dtype;
  const char* name;
  int rounding_bits;
  double subnormal;
  int min_arch;  // the oldest code the kernel takes it on (expert_gemm_cuda.h: takes)
};
const Kind kBf16{at::kBFloat16, "bf16", 8, 0.0, 80};
const Kind kFp16{at::kHalf, "fp16", 11, std::ldexp(1.0, -25), 75};

// Within the dtype's rounding of the float64 value: half an ulp of the result plus fp32
// accumulation over K terms (1e-5 of the magnitudes' product, about 80x fp32's epsilon). Returns the
// worst ratio of error to bound (<= 1 passes) and says where.
double worst_ratio(const at::Tensor& got, const at::Tensor& ref, const at::Tensor& mag, const Kind& kind, std::string* where) {
  const at::Tensor bound = ref.abs() * std::ldexp(1.0, -kind.rounding_bits) + mag * 1e-5 + kind.subnormal + 1e-30;
  const at::Tensor ratio = (got.to(at::kDouble) - ref).abs() / bound;
  const at::Tensor flat = ratio.reshape({-1});
  const std::int64_t i = flat.argmax().item<std::int64_t>();
  const double r = flat[i].item<double>();
  if (where) {
    const std::int64_t cols = ref.size(-1);
    *where = "element (" + std::to_string(i / cols) + ", " + std::to_string(i % cols) + "): got " +
             std::to_string(got.reshape({-1})[i].item<double>()) + ", float64 " + std::to_string(ref.reshape({-1})[i].item<double>());
  }
  return r;
}

// The architecture of the code CMake built for a GPU of compute capability cc (86 for 8.6), from
// a CUDA architecture list (CMAKE_CUDA_ARCHITECTURES with commas): the newest SASS of the GPU's
// major version not newer than it, else the newest PTX not newer than it; 0 where the list does
// not say (native, all).
int built_arch_for(const std::string& list, int cc) {
  int sass = 0, ptx = 0;
  for (std::size_t start = 0; start <= list.size();) {
    const std::size_t end = std::min(list.find(',', start), list.size());
    const std::string entry = list.substr(start, end - start);
    start = end + 1;
    if (entry.empty() || !std::isdigit(static_cast<unsigned char>(entry[0]))) {
      if (!entry.empty()) return 0;
      continue;
    }
    const int a = std::stoi(entry);
    const bool real = entry.find("-virtual") == std::string::npos, virt = entry.find("-real") == std::string::npos;
    if (real && a / 10 == cc / 10 && a <= cc) sass = std::max(sass, a);
    if (virt && a <= cc) ptx = std::max(ptx, a);
  }
  return sass ? sass : ptx;
}

int built_arch() {
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, c10::cuda::current_device()) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, c10::cuda::current_device()) != cudaSuccess)
    return 0;
  return built_arch_for(EO_TEST_CUDA_ARCHS, major * 10 + minor);
}

at::Tensor make_b(const Shape& s, const at::Device& dev, at::ScalarType dtype) {
  // HF-like scale: weights ~ N(0, 0.02); as [E, N, K] read transposed, or [E, K, N].
  if (s.b_nk) return (at::randn({s.experts, s.N, s.K}, at::dtype(at::kFloat).device(dev)) * 0.02).to(dtype).transpose(1, 2);
  return (at::randn({s.experts, s.K, s.N}, at::dtype(at::kFloat).device(dev)) * 0.02).to(dtype);
}

at::Tensor randn_as(std::int64_t rows, std::int64_t cols, const at::Device& dev, at::ScalarType dtype) {
  return at::randn({rows, cols}, at::dtype(at::kFloat).device(dev)).to(dtype);
}

const std::vector<Shape>& layer_shapes() {
  static const std::vector<Shape> shapes = {
      {"qwen3-30b-a3b gate_up", 128, 2048, 1536, true},  {"qwen3-30b-a3b down", 128, 768, 2048, true},
      {"olmoe-1b-7b gate_up", 64, 2048, 2048, true},     {"olmoe-1b-7b down", 64, 1024, 2048, true},
      {"mixtral-8x7b gate_up", 8, 4096, 28672, true},    {"mixtral-8x7b down", 8, 14336, 4096, true},
      {"gpt-oss-20b gate_up", 32, 2880, 5760, false},    {"gpt-oss-20b down", 32, 2880, 2880, false},
      {"qwen3 expert lora A (r 16)", 128, 2048, 16, true}, {"qwen3 expert lora B (r 16)", 128, 16, 1536, true},
      {"backward dX of gate_up", 128, 1536, 2048, false},
  };
  return shapes;
}

struct Restore {
  ~Restore() {
    model::set_expert_gemm(model::ExpertGemm::kTorch);
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
  }
};

// Whether the build's code for this GPU takes the dtype; a test of one it does not take is skipped.
bool built_for(const Kind& kind, std::string* why) {
  const int arch = built_arch();
  if (arch >= kind.min_arch) return true;
  *why = std::string("this build's code for the GPU is ") + (arch ? "sm_" + std::to_string(arch) : "unknown") + " (" +
         EO_TEST_CUDA_ARCHS + "): the " + kind.name + " kernel needs sm_" + std::to_string(kind.min_arch) + " code";
  return false;
}

#define REQUIRE_KERNEL(kind)                               \
  do {                                                     \
    std::string why_not;                                   \
    if (!built_for(kind, &why_not)) GTEST_SKIP() << why_not; \
  } while (0)

void layers_against_float64(const Kind& kind) {
  Restore restore;
  const at::Device dev(at::kCUDA, 0);
  const std::int64_t tokens = 512;
  at::manual_seed(11);
  for (const Shape& s : layer_shapes()) {
    const std::int64_t top_k = s.experts >= 32 ? (s.experts == 32 ? 4 : 8) : 2;
    const std::int64_t M = tokens * top_k;
    const at::Tensor a = randn_as(M, s.K, dev, kind.dtype);
    const at::Tensor b = make_b(s, dev, kind.dtype);
    for (const Groups g : {Groups::kUneven, Groups::kEmptyExperts, Groups::kOneExpert, Groups::kUncoveredTail}) {
      const auto counts = group_counts(g, s.experts, M, 5 + static_cast<int>(g));
      const at::Tensor off = offsets_on(counts, dev);
      const auto [ref, mag] = reference(a, b, counts);
      const std::string what = std::string(kind.name) + " " + s.name + " groups " + std::to_string(static_cast<int>(g));
      model::set_expert_gemm(model::ExpertGemm::kPortable);
      ASSERT_TRUE(model::portable_grouped_mm_applies(a, b)) << what;
      const at::Tensor portable = model::grouped_mm_product(a, b, off);
      ASSERT_EQ(portable.scalar_type(), kind.dtype) << what;
      std::string where;
      EXPECT_LE(worst_ratio(portable, ref, mag, kind, &where), 1.0) << what << ": portable, " << where;
      if (g == Groups::kUncoveredTail)
        EXPECT_EQ(portable.narrow(0, M - 37, 37).abs().max().item<float>(), 0.0f) << what << ": rows past the last group";
      // torch's op on the same operands, the same bound (bf16: its device-scheduled kernel on an
      // sm_90 card; fp16: its loop of one mm per group).
      model::set_expert_gemm(model::ExpertGemm::kTorch);
      const at::Tensor torch_out = model::grouped_mm_product(a, b, off);
      const at::Tensor covered = torch_out.narrow(0, 0, M - (g == Groups::kUncoveredTail ? 37 : 0));
      EXPECT_LE(worst_ratio(covered, ref.narrow(0, 0, covered.size(0)), mag.narrow(0, 0, covered.size(0)), kind, &where), 1.0)
          << what << ": torch, " << where;
    }
  }
}

// grouped_mm's autograd with the portable kernel: dX (a 2-D x 3-D product) and dB (a^T g per group)
// against float64, for an expert LoRA shape (B [E, 2048, 16]) and a full expert matrix.
void backward_against_float64(const Kind& kind) {
  Restore restore;
  const at::Device dev(at::kCUDA, 0);
  at::manual_seed(12);
  for (const Shape& s : {Shape{"lora A", 128, 2048, 16, true}, Shape{"lora B", 128, 16, 1536, true},
                         Shape{"expert", 64, 1024, 2048, false}}) {
    for (const Groups g : {Groups::kUneven, Groups::kEmptyExperts, Groups::kOneExpert}) {
      const std::int64_t M = 4096;
      const auto counts = group_counts(g, s.experts, M, 21 + static_cast<int>(g));
      const at::Tensor off = offsets_on(counts, dev);
      const at::Tensor a = randn_as(M, s.K, dev, kind.dtype).requires_grad_(true);
      const at::Tensor b = make_b(s, dev, kind.dtype).detach().requires_grad_(true);
      const at::Tensor w = randn_as(M, s.N, dev, kind.dtype);
      model::set_expert_gemm(model::ExpertGemm::kPortable);
      const at::Tensor y = model::grouped_mm(a, b, off);
      y.backward(w);
      // float64: da = w · B_e^T over each group's rows; dB_e = a_e^T · w_e.
      const at::Tensor a64 = a.detach().to(at::kDouble), b64 = b.detach().to(at::kDouble), w64 = w.to(at::kDouble);
      at::Tensor da = at::zeros_like(a64), da_mag = at::zeros_like(a64);
      at::Tensor db = at::zeros_like(b64), db_mag = at::zeros_like(b64);
      std::int64_t row = 0;
      for (std::size_t e = 0; e < counts.size(); ++e) {
        const std::int64_t n = counts[e], ei = static_cast<std::int64_t>(e);
        if (n > 0) {
          const at::Tensor we = w64.narrow(0, row, n), ae = a64.narrow(0, row, n);
          da.narrow(0, row, n).copy_(at::mm(we, b64[ei].t()));
          da_mag.narrow(0, row, n).copy_(at::mm(we.abs(), b64[ei].t().abs()));
          db[ei].copy_(at::mm(ae.t(), we));
          db_mag[ei].copy_(at::mm(ae.t().abs(), we.abs()));
        }
        row += n;
      }
      const std::string what = std::string(kind.name) + " " + s.name + " groups " + std::to_string(static_cast<int>(g));
      ASSERT_EQ(a.grad().scalar_type(), kind.dtype) << what;
      ASSERT_EQ(b.grad().scalar_type(), kind.dtype) << what;
      std::string where;
      EXPECT_LE(worst_ratio(a.grad(), da, da_mag, kind, &where), 1.0) << what << ": dX, " << where;
      EXPECT_LE(worst_ratio(b.grad().contiguous().view({-1, s.N}), db.contiguous().view({-1, s.N}),
                            db_mag.contiguous().view({-1, s.N}), kind, &where),
                1.0)
          << what << ": dB, " << where;
    }
  }
}

// Every group empty (all offsets 0, so every row lies past the last group) and no rows at all: the
// product and a^T g are zeros, written over memory the allocator last held NaN in.
void empty_groups_give_zeros(const Kind& kind) {
  Restore restore;
  const at::Device dev(at::kCUDA, 0);
  at::manual_seed(14);
  model::set_expert_gemm(model::ExpertGemm::kPortable);
  const Shape s{"qwen3 down", 128, 768, 2048, true};
  const at::Tensor b = make_b(s, dev, kind.dtype);
  const at::Tensor none = at::zeros({s.experts}, at::dtype(at::kInt).device(dev));
  for (const std::int64_t M : {std::int64_t(300), std::int64_t(0)}) {
    const at::Tensor a = randn_as(M, s.K, dev, kind.dtype), g = randn_as(M, s.N, dev, kind.dtype);
    // The caching allocator hands the freed NaN blocks to the next allocations of their sizes.
    (void)at::full({M, s.N}, NAN, a.options());
    (void)at::full({s.experts, s.K, s.N}, NAN, a.options());
    const at::Tensor y = model::grouped_mm_product(a, b, none);
    const at::Tensor dw = model::grouped_mm_contract(a, g, none);
    const std::string what = std::string(kind.name) + " M " + std::to_string(M);
    ASSERT_EQ(y.sizes(), at::IntArrayRef({M, s.N})) << what;
    ASSERT_EQ(dw.sizes(), at::IntArrayRef({s.experts, s.K, s.N})) << what;
    EXPECT_EQ(at::count_nonzero(y).item<std::int64_t>(), 0) << what << ": the product";
    EXPECT_EQ(at::count_nonzero(dw).item<std::int64_t>(), 0) << what << ": a^T g";
  }
}

// Sizes read on the device: no host synchronisation (sync debug mode errors on one), and a CUDA
// graph captured once follows new group sizes written into its offsets tensor.
void graph_replays_new_groups(const Kind& kind) {
  Restore restore;
  const at::Device dev(at::kCUDA, 0);
  at::manual_seed(13);
  model::set_expert_gemm(model::ExpertGemm::kPortable);
  const Shape s{"qwen3 gate_up", 128, 2048, 1536, true};
  const std::int64_t M = 2048;
  const at::Tensor a = randn_as(M, s.K, dev, kind.dtype);
  const at::Tensor b = make_b(s, dev, kind.dtype);
  const at::Tensor g = randn_as(M, s.N, dev, kind.dtype);
  const at::Tensor off = offsets_on(group_counts(Groups::kUneven, s.experts, M, 1), dev);
  c10::cuda::device_synchronize();
  c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_ERROR);
  std::string error;
  try {
    (void)model::grouped_mm_product(a, b, off);
    (void)model::grouped_mm_contract(a, g, off);
  } catch (const c10::Error& e) {
    error = e.what_without_backtrace();
  }
  c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
  EXPECT_EQ(error, "") << kind.name << ": a host synchronisation in the portable grouped GEMM";

  at::cuda::CUDAGraph graph;
  at::Tensor y, dw;
  {
    const c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(false, dev.index());
    c10::cuda::CUDAStreamGuard guard(side);
    (void)model::grouped_mm_product(a, b, off);  // warm-up off the capture (occupancy query, allocator)
    (void)model::grouped_mm_contract(a, g, off);
    c10::cuda::device_synchronize();
    graph.capture_begin();
    y = model::grouped_mm_product(a, b, off);
    dw = model::grouped_mm_contract(a, g, off);
    graph.capture_end();
  }
  for (const Groups groups : {Groups::kOneExpert, Groups::kEmptyExperts, Groups::kUncoveredTail}) {
    const auto counts = group_counts(groups, s.experts, M, 40 + static_cast<int>(groups));
    off.copy_(offsets_on(counts, dev));
    graph.replay();
    const at::Tensor eager_y = model::grouped_mm_product(a, b, off);
    const at::Tensor eager_dw = model::grouped_mm_contract(a, g, off);
    c10::cuda::device_synchronize();
    const std::string what = std::string(kind.name) + " groups " + std::to_string(static_cast<int>(groups));
    EXPECT_TRUE(at::equal(y, eager_y)) << what << ": the replay used other sizes";
    EXPECT_TRUE(at::equal(dw, eager_dw)) << what << ": the replay used other sizes (a^T g)";
    const auto [ref, mag] = reference(a, b, counts);
    std::string where;
    EXPECT_LE(worst_ratio(y, ref, mag, kind, &where), 1.0) << what << ": " << where;
  }
}

}  // namespace
#endif

// The code that runs is what CMake built for this GPU (so a skip below is the build's, not a
// misread architecture), and the kernel takes each dtype exactly where that code has its mma.
TEST(CudaExpertGemm, KernelArchIsTheBuildsCodeForThisGpu) {
  REQUIRE_CUDA();
#ifdef EO_WITH_CUDA
  const at::Device dev(at::kCUDA, 0);
  const int want = built_arch();
  if (want == 0) GTEST_SKIP() << "CMAKE_CUDA_ARCHITECTURES " << EO_TEST_CUDA_ARCHS << " does not name the architectures";
  c10::cuda::CUDAGuard guard(dev);
  EXPECT_EQ(expert_gemm::cuda::kernel_arch(), want) << "architectures " << EO_TEST_CUDA_ARCHS;
  EXPECT_EQ(model::portable_kernel_takes(at::kBFloat16, dev), want >= 80);
  EXPECT_EQ(model::portable_kernel_takes(at::kHalf, dev), want >= 75);
  EXPECT_FALSE(model::portable_kernel_takes(at::kFloat, dev));
  // built_arch_for itself: the default list, one card's, PTX only, and a list that does not say.
  const std::string all = "75-real,80-real,86-real,89-real,90-real,100-real,120-real,120-virtual";
  EXPECT_EQ(built_arch_for(all, 90), 90);
  EXPECT_EQ(built_arch_for(all, 87), 86);
  EXPECT_EQ(built_arch_for(all, 75), 75);
  EXPECT_EQ(built_arch_for(all, 130), 120);
  EXPECT_EQ(built_arch_for("75-virtual", 90), 75);
  EXPECT_EQ(built_arch_for("90", 90), 90);
  EXPECT_EQ(built_arch_for("80-real,90-virtual", 86), 80);
  EXPECT_EQ(built_arch_for("80-real,90-virtual", 100), 90);
  EXPECT_EQ(built_arch_for("native", 90), 0);
#endif
}

TEST(CudaExpertGemm, MatchesFloat64AndTorchOnModelLayers) {
  REQUIRE_CUDA();
#ifdef EO_WITH_CUDA
  REQUIRE_KERNEL(kBf16);
  layers_against_float64(kBf16);
#endif
}

TEST(CudaExpertGemm, Fp16MatchesFloat64AndTorchOnModelLayers) {
  REQUIRE_CUDA();
#ifdef EO_WITH_CUDA
  REQUIRE_KERNEL(kFp16);
  layers_against_float64(kFp16);
#endif
}

TEST(CudaExpertGemm, BackwardMatchesFloat64) {
  REQUIRE_CUDA();
#ifdef EO_WITH_CUDA
  REQUIRE_KERNEL(kBf16);
  backward_against_float64(kBf16);
#endif
}

TEST(CudaExpertGemm, Fp16BackwardMatchesFloat64) {
  REQUIRE_CUDA();
#ifdef EO_WITH_CUDA
  REQUIRE_KERNEL(kFp16);
  backward_against_float64(kFp16);
#endif
}

TEST(CudaExpertGemm, EmptyGroupsGiveZeros) {
  REQUIRE_CUDA();
#ifdef EO_WITH_CUDA
  for (const Kind* kind : {&kBf16, &kFp16}) {
    std::string why_not;
    if (!built_for(*kind, &why_not)) continue;  // said by the tests above
    empty_groups_give_zeros(*kind);
  }
#endif
}

TEST(CudaExpertGemm, RunsWithoutHostSyncAndReplaysInAGraphWithNewGroups) {
  REQUIRE_CUDA();
#ifdef EO_WITH_CUDA
  REQUIRE_KERNEL(kBf16);
  graph_replays_new_groups(kBf16);
#endif
}

TEST(CudaExpertGemm, Fp16RunsWithoutHostSyncAndReplaysInAGraphWithNewGroups) {
  REQUIRE_CUDA();
#ifdef EO_WITH_CUDA
  REQUIRE_KERNEL(kFp16);
  graph_replays_new_groups(kFp16);
#endif
}

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  eo::ddp::World::init(&argc, &argv);
  return RUN_ALL_TESTS();
}
