// The portable grouped GEMM of the experts (models/grouped_mm.h, expert_gemm_cuda.h), label `cuda`:
//  - against a float64 reference (each group's rows times its matrix, in float64 on the GPU) within
//    bf16 rounding, for the two expert GEMMs of Qwen3-30B-A3B, OLMoE-1B-7B, Mixtral-8x7B and
//    gpt-oss-20b layers and the expert LoRA's rank-16 GEMMs, with uneven groups, empty experts, one
//    expert taking every row and rows past the last group; torch's kernel held to the same bound on
//    the same operands;
//  - the backward (dX and the a^T g weight gradient) through grouped_mm's autograd;
//  - with no host synchronisation (CUDA's sync debug mode set to error) and captured in a CUDA
//    graph whose replay follows new group sizes written into the same offsets tensor.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "models/grouped_mm.h"
#include "runtime/dist/world.h"

#ifdef EO_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
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

// Within bf16 rounding of the float64 value: half a bf16 ulp of the result (2^-8 relative) plus fp32
// accumulation over K terms (1e-5 of the magnitudes' product, about 170x fp32's epsilon). Returns the
// worst ratio of error to bound (<= 1 passes) and says where.
double worst_ratio(const at::Tensor& got, const at::Tensor& ref, const at::Tensor& mag, std::string* where) {
  const at::Tensor bound = ref.abs() * std::ldexp(1.0, -8) + mag * 1e-5 + 1e-30;
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

at::Tensor make_b(const Shape& s, const at::Device& dev) {
  // HF-like scale: weights ~ N(0, 0.02); as [E, N, K] read transposed, or [E, K, N].
  if (s.b_nk) return (at::randn({s.experts, s.N, s.K}, at::dtype(at::kFloat).device(dev)) * 0.02).to(at::kBFloat16).transpose(1, 2);
  return (at::randn({s.experts, s.K, s.N}, at::dtype(at::kFloat).device(dev)) * 0.02).to(at::kBFloat16);
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

}  // namespace
#endif

TEST(CudaExpertGemm, MatchesFloat64AndTorchOnModelLayers) {
  REQUIRE_CUDA();
#ifdef EO_WITH_CUDA
  Restore restore;
  const at::Device dev(at::kCUDA, 0);
  const std::int64_t tokens = 512;
  at::manual_seed(11);
  for (const Shape& s : layer_shapes()) {
    const std::int64_t top_k = s.experts >= 32 ? (s.experts == 32 ? 4 : 8) : 2;
    const std::int64_t M = tokens * top_k;
    const at::Tensor a = at::randn({M, s.K}, at::dtype(at::kFloat).device(dev)).to(at::kBFloat16);
    const at::Tensor b = make_b(s, dev);
    for (const Groups g : {Groups::kUneven, Groups::kEmptyExperts, Groups::kOneExpert, Groups::kUncoveredTail}) {
      const auto counts = group_counts(g, s.experts, M, 5 + static_cast<int>(g));
      const at::Tensor off = offsets_on(counts, dev);
      const auto [ref, mag] = reference(a, b, counts);
      const std::string what = s.name + " groups " + std::to_string(static_cast<int>(g));
      model::set_expert_gemm(model::ExpertGemm::kPortable);
      const at::Tensor portable = model::grouped_mm_product(a, b, off);
      ASSERT_TRUE(model::portable_grouped_mm_applies(a, b)) << what;
      std::string where;
      EXPECT_LE(worst_ratio(portable, ref, mag, &where), 1.0) << what << ": portable, " << where;
      if (g == Groups::kUncoveredTail)
        EXPECT_EQ(portable.narrow(0, M - 37, 37).abs().max().item<float>(), 0.0f) << what << ": rows past the last group";
      // torch's kernel (device-scheduled on this H200) on the same operands, the same bound.
      model::set_expert_gemm(model::ExpertGemm::kTorch);
      const at::Tensor torch_out = model::grouped_mm_product(a, b, off);
      const at::Tensor covered = torch_out.narrow(0, 0, M - (g == Groups::kUncoveredTail ? 37 : 0));
      EXPECT_LE(worst_ratio(covered, ref.narrow(0, 0, covered.size(0)), mag.narrow(0, 0, covered.size(0)), &where), 1.0)
          << what << ": torch, " << where;
    }
  }
#endif
}

// grouped_mm's autograd with the portable kernel: dX (a 2-D x 3-D product) and dB (a^T g per group)
// against float64, for an expert LoRA shape (B [E, 2048, 16]) and a full expert matrix.
TEST(CudaExpertGemm, BackwardMatchesFloat64) {
  REQUIRE_CUDA();
#ifdef EO_WITH_CUDA
  Restore restore;
  const at::Device dev(at::kCUDA, 0);
  at::manual_seed(12);
  for (const Shape& s : {Shape{"lora A", 128, 2048, 16, true}, Shape{"lora B", 128, 16, 1536, true},
                         Shape{"expert", 64, 1024, 2048, false}}) {
    for (const Groups g : {Groups::kUneven, Groups::kEmptyExperts, Groups::kOneExpert}) {
      const std::int64_t M = 4096;
      const auto counts = group_counts(g, s.experts, M, 21 + static_cast<int>(g));
      const at::Tensor off = offsets_on(counts, dev);
      const at::Tensor a = at::randn({M, s.K}, at::dtype(at::kFloat).device(dev)).to(at::kBFloat16).requires_grad_(true);
      const at::Tensor b = make_b(s, dev).detach().requires_grad_(true);
      const at::Tensor w = at::randn({M, s.N}, at::dtype(at::kFloat).device(dev)).to(at::kBFloat16);
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
      const std::string what = s.name + " groups " + std::to_string(static_cast<int>(g));
      std::string where;
      EXPECT_LE(worst_ratio(a.grad(), da, da_mag, &where), 1.0) << what << ": dX, " << where;
      EXPECT_LE(worst_ratio(b.grad().contiguous().view({-1, s.N}), db.contiguous().view({-1, s.N}),
                            db_mag.contiguous().view({-1, s.N}), &where),
                1.0)
          << what << ": dB, " << where;
    }
  }
#endif
}

// Sizes read on the device: no host synchronisation (sync debug mode errors on one), and a CUDA
// graph captured once follows new group sizes written into its offsets tensor.
TEST(CudaExpertGemm, RunsWithoutHostSyncAndReplaysInAGraphWithNewGroups) {
  REQUIRE_CUDA();
#ifdef EO_WITH_CUDA
  Restore restore;
  const at::Device dev(at::kCUDA, 0);
  at::manual_seed(13);
  model::set_expert_gemm(model::ExpertGemm::kPortable);
  const Shape s{"qwen3 gate_up", 128, 2048, 1536, true};
  const std::int64_t M = 2048;
  const at::Tensor a = at::randn({M, s.K}, at::dtype(at::kFloat).device(dev)).to(at::kBFloat16);
  const at::Tensor b = make_b(s, dev);
  const at::Tensor g = at::randn({M, s.N}, at::dtype(at::kFloat).device(dev)).to(at::kBFloat16);
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
  EXPECT_EQ(error, "") << "a host synchronisation in the portable grouped GEMM";

  at::cuda::CUDAGraph graph;
  at::Tensor y, dw;
  {
    const c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(false, dev.index());
    c10::cuda::CUDAStreamGuard guard(side);
    (void)model::grouped_mm_product(a, b, off);  // warm-up off the capture (occupancy query, allocator)
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
    EXPECT_TRUE(at::equal(y, eager_y)) << "groups " << static_cast<int>(groups) << ": the replay used other sizes";
    EXPECT_TRUE(at::equal(dw, eager_dw)) << "groups " << static_cast<int>(groups) << ": the replay used other sizes (a^T g)";
    const auto [ref, mag] = reference(a, b, counts);
    std::string where;
    EXPECT_LE(worst_ratio(y, ref, mag, &where), 1.0) << "groups " << static_cast<int>(groups) << ": " << where;
  }
#endif
}

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  eo::dist::World::init(&argc, &argv);
  return RUN_ALL_TESTS();
}
