// The NF4 expert GEMM (models/nf4_expert_gemm.h: the dequantisation inside the grouped GEMM's
// mainloop), label `cuda`:
//  - forward (x · W_e^T) and backward (dy · W_e) against a float64 reference: each expert
//    dequantised by the CPU NF4 path (models/nf4.cpp, bitsandbytes' bits) and taken to float64,
//    each group's rows times it in float64; on random shapes whose out and in are not multiples of
//    the kernel's 128 x 128 x 32 tile nor of the absmax block (blocks straddling rows), plain and
//    nested (double-quantised) absmax, blocksizes 64 and 128, uneven groups, empty experts, one
//    expert taking every row and rows past the last group; and on Qwen3-30B-A3B's expert shapes;
//  - every group empty and no rows at all: zeros written over memory that held NaN;
//  - no host synchronisation (CUDA's sync debug mode set to error), and a CUDA graph captured
//    once whose replay follows new group sizes written into the same offsets tensor;
//  - operands it does not take are refused with a message.
// The bound (bf16 out, bf16 weights, fp32 accumulation), per element, with mag = |a| · |W|:
//   |got - ref| <= 2^-8 |ref| + (2^-8 + 1e-5) mag
// 2^-8 |ref|: the output's rounding to bf16 (half an ulp); 2^-8 mag: each weight's rounding to
// bf16 inside the kernel (half an ulp of each term); 1e-5 mag: fp32 accumulation over K terms.
// A test is skipped (and says so) where the build's code for the GPU is older than sm_80.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "common/error.h"
#include "models/nf4.h"
#include "models/nf4_expert_gemm.h"
#include "models/quantized_weight.h"
#include "runtime/ddp/world.h"

#ifdef EO_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

using namespace eo;

#define REQUIRE_KERNEL()                                                                                  \
  do {                                                                                                    \
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device (this test runs on the GPU machine: ctest -L cuda)"; \
    if (!model::nf4_expert_gemm_runs(at::Device(at::kCUDA, 0)))                                           \
      GTEST_SKIP() << "this build's code for the GPU is older than sm_80 (the kernel's bf16 mma)";        \
  } while (0)

#ifdef EO_WITH_CUDA
namespace {

// A MoE block's experts on the GPU, and the CPU path's dequantisation of copies of them (fp32,
// which is exact in float64: the reference's weights), kept on the GPU as [E, out, in].
struct Experts {
  std::vector<QuantizedWeight> gpu;
  at::Tensor w32;
  model::Nf4ExpertTable table;
};

QuantizedWeight to_device(const QuantizedWeight& q, const at::Device& dev) {
  QuantizedWeight d = q;
  d.packed = q.packed.to(dev);
  if (q.absmax.defined()) d.absmax = q.absmax.to(dev);
  if (q.nested) {
    d.nested->absmax_codes = q.nested->absmax_codes.to(dev);
    d.nested->nested_absmax = q.nested->nested_absmax.to(dev);
    d.nested->nested_code = q.nested->nested_code.to(dev);
  }
  return d;
}

// Quantised on the GPU (the CUDA quantiser gives the CPU's bits: test_cuda's Nf4 tests), so the
// 128 experts of a real layer take no minutes of CPU; dequantised for the reference on the CPU.
Experts make_experts(std::int64_t E, std::int64_t out, std::int64_t in, int blocksize, bool nested,
                     const at::Device& dev) {
  Experts x;
  x.gpu.reserve(static_cast<std::size_t>(E));
  x.w32 = at::empty({E, out, in}, at::dtype(at::kFloat).device(dev));
  for (std::int64_t e = 0; e < E; ++e) {
    // HF-like scale, rows scaled 1x to 8x so neighbouring absmax blocks differ.
    const at::Tensor raw = at::randn({out, in}, at::dtype(at::kFloat).device(dev)) * 0.02 *
                           (1 + 7 * at::rand({out, 1}, at::dtype(at::kFloat).device(dev)));
    x.gpu.push_back(nf4::quantize(raw, blocksize, nested));
    x.w32[e].copy_(eo::dequantize(to_device(x.gpu.back(), at::kCPU), at::kFloat));
  }
  std::vector<const QuantizedWeight*> ptrs;
  for (const QuantizedWeight& q : x.gpu) ptrs.push_back(&q);
  x.table = model::nf4_expert_table(ptrs);
  return x;
}

enum class Groups { kUneven, kEmptyExperts, kOneExpert, kUncoveredTail, kRandom };
const char* name_of(Groups g) {
  switch (g) {
    case Groups::kUneven: return "uneven";
    case Groups::kEmptyExperts: return "empty experts";
    case Groups::kOneExpert: return "one expert";
    case Groups::kUncoveredTail: return "rows past the last group";
    case Groups::kRandom: return "random";
  }
  return "?";
}

std::vector<std::int64_t> group_counts(Groups g, std::int64_t experts, std::int64_t rows, std::uint64_t seed) {
  std::vector<std::int64_t> c(static_cast<std::size_t>(experts), 0);
  std::mt19937_64 rng(seed);
  if (g == Groups::kOneExpert) {
    c[static_cast<std::size_t>(experts / 2)] = rows;
    return c;
  }
  const std::int64_t covered = g == Groups::kUncoveredTail ? rows - std::min<std::int64_t>(rows, 37) : rows;
  std::vector<double> w(c.size());
  for (std::size_t e = 0; e < w.size(); ++e) {
    const bool empty = (g == Groups::kEmptyExperts && e % 3 == 0) || (g == Groups::kRandom && rng() % 4 == 0);
    w[e] = empty ? 0.0 : 1.0 + double(rng() % 1000) / 100.0;  // 1x to 11x
  }
  double sum = 0;
  for (double x : w) sum += x;
  if (sum == 0) w[0] = sum = 1;
  std::int64_t given = 0;
  for (std::size_t e = 0; e < c.size(); ++e) given += c[e] = std::int64_t(std::floor(w[e] / sum * double(covered)));
  for (std::size_t e = 0; given < covered; e = (e + 1) % c.size())
    if (w[e] > 0) ++c[e], ++given;
  return c;
}

at::Tensor offsets_on(const std::vector<std::int64_t>& counts, const at::Device& dev) {
  return at::tensor(counts, at::kLong).cumsum(0).to(at::kInt).to(dev);
}

// float64 (on the GPU, for speed): forward a · W_e^T, backward a · W_e, per group; and the same
// product of the magnitudes, for the bound. Rows past the last group zero.
std::pair<at::Tensor, at::Tensor> reference(const at::Tensor& a, const at::Tensor& w32, bool backward,
                                            const std::vector<std::int64_t>& counts) {
  const at::Tensor a64 = a.to(at::kDouble);
  const std::int64_t width = backward ? w32.size(2) : w32.size(1);
  at::Tensor y = at::zeros({a.size(0), width}, a64.options()), mag = at::zeros_like(y);
  std::int64_t row = 0;
  for (std::size_t e = 0; e < counts.size(); ++e) {
    if (counts[e] > 0) {
      const at::Tensor ae = a64.narrow(0, row, counts[e]);
      const at::Tensor w64 = w32[static_cast<std::int64_t>(e)].to(at::kDouble);
      const at::Tensor we = backward ? w64 : w64.t();
      y.narrow(0, row, counts[e]).copy_(at::mm(ae, we));
      mag.narrow(0, row, counts[e]).copy_(at::mm(ae.abs(), we.abs()));
    }
    row += counts[e];
  }
  return {y, mag};
}

// The worst ratio of error to the bound in the header (<= 1 passes), and where it is.
double worst_ratio(const at::Tensor& got, const at::Tensor& ref, const at::Tensor& mag, std::string* where) {
  if (ref.numel() == 0) return 0;
  const double half_ulp = std::ldexp(1.0, -8);
  const at::Tensor bound = ref.abs() * half_ulp + mag * (half_ulp + 1e-5) + 1e-30;
  const at::Tensor ratio = ((got.to(at::kDouble) - ref).abs() / bound).reshape({-1});
  const std::int64_t i = ratio.argmax().item<std::int64_t>();
  const std::int64_t cols = ref.size(-1);
  *where = "element (" + std::to_string(i / cols) + ", " + std::to_string(i % cols) + "): got " +
           std::to_string(got.reshape({-1})[i].item<double>()) + ", float64 " +
           std::to_string(ref.reshape({-1})[i].item<double>());
  return ratio[i].item<double>();
}

at::Tensor randn_bf16(std::int64_t rows, std::int64_t cols, const at::Device& dev) {
  return at::randn({rows, cols}, at::dtype(at::kFloat).device(dev)).to(at::kBFloat16);
}

// Both products of one block's experts for one grouping, against float64.
// M: the rows (the groups may cover fewer).
void check_products(const Experts& x, const std::vector<std::int64_t>& counts, std::int64_t M, const std::string& what,
                    const at::Device& dev) {
  const at::Tensor off = offsets_on(counts, dev);
  for (const bool backward : {false, true}) {
    const at::Tensor a = randn_bf16(M, backward ? x.table.out : x.table.in, dev);
    (void)at::full({M, backward ? x.table.in : x.table.out}, NAN, a.options());  // what the output's memory held
    const at::Tensor got =
        backward ? model::nf4_grouped_mm_dx(a, x.table, off) : model::nf4_grouped_mm(a, x.table, off);
    const std::string which = what + (backward ? ", dy · W" : ", x · W^T");
    ASSERT_EQ(got.scalar_type(), at::kBFloat16) << which;
    ASSERT_EQ(got.sizes(), at::IntArrayRef({M, backward ? x.table.in : x.table.out})) << which;
    const auto [ref, mag] = reference(a, x.w32, backward, counts);
    std::string where;
    EXPECT_LE(worst_ratio(got, ref, mag, &where), 1.0) << which << ": " << where;
  }
}

}  // namespace
#endif

// Shapes that are not multiples of the tile (128 x 128 x 32) nor of the absmax block, plain and
// nested absmax, every grouping; then random ones.
TEST(CudaNf4ExpertGemm, MatchesFloat64OnOddShapes) {
  REQUIRE_KERNEL();
#ifdef EO_WITH_CUDA
  const at::Device dev(at::kCUDA, 0);
  at::manual_seed(31);
  struct Case {
    std::int64_t E, out, in;
    int blocksize;
    bool nested;
    std::int64_t M;
  };
  for (const Case& c : {Case{6, 136, 200, 64, false, 700}, Case{5, 264, 72, 64, true, 1000},
                        Case{3, 8, 40, 128, true, 129}, Case{9, 392, 256, 128, false, 2000},
                        Case{1, 128, 128, 64, true, 128}, Case{4, 24, 1048, 64, false, 333}}) {
    const Experts x = make_experts(c.E, c.out, c.in, c.blocksize, c.nested, dev);
    for (const Groups g : {Groups::kUneven, Groups::kEmptyExperts, Groups::kOneExpert, Groups::kUncoveredTail}) {
      const std::string what = std::to_string(c.E) + " experts [" + std::to_string(c.out) + ", " +
                               std::to_string(c.in) + "] blocksize " + std::to_string(c.blocksize) +
                               (c.nested ? " nested" : "") + ", " + name_of(g);
      check_products(x, group_counts(g, c.E, c.M, 7 + static_cast<int>(g)), c.M, what, dev);
    }
  }
  std::mt19937_64 rng(5);
  for (int i = 0; i < 8; ++i) {
    auto below = [&](std::uint64_t n) { return static_cast<std::int64_t>(rng() % n); };
    const std::int64_t E = 1 + below(12), out = 8 * (1 + below(50)), in = 8 * (1 + below(50)), M = below(900);
    const bool nested = rng() % 2;
    const Experts x = make_experts(E, out, in, 64, nested, dev);
    check_products(x, group_counts(Groups::kRandom, E, M, rng()), M,
                   "random " + std::to_string(E) + " experts [" + std::to_string(out) + ", " + std::to_string(in) +
                       "]" + (nested ? " nested" : "") + " M " + std::to_string(M),
                   dev);
  }
#endif
}

// Qwen3-30B-A3B's experts (128; gate_up [1536, 2048], down [2048, 768]), nested as eo quantises
// them by default, 512 tokens routed top-8.
TEST(CudaNf4ExpertGemm, MatchesFloat64OnQwen3Experts) {
  REQUIRE_KERNEL();
#ifdef EO_WITH_CUDA
  const at::Device dev(at::kCUDA, 0);
  at::manual_seed(32);
  const std::int64_t M = 512 * 8;
  for (const auto& [name, out, in] : {std::tuple<const char*, std::int64_t, std::int64_t>{"gate_up", 1536, 2048},
                                      std::tuple<const char*, std::int64_t, std::int64_t>{"down", 2048, 768}}) {
    const Experts x = make_experts(128, out, in, 64, true, dev);
    for (const Groups g : {Groups::kUneven, Groups::kEmptyExperts, Groups::kOneExpert})
      check_products(x, group_counts(g, 128, M, 50 + static_cast<int>(g)), M,
                     std::string("qwen3-30b-a3b ") + name + ", " + name_of(g), dev);
  }
#endif
}

TEST(CudaNf4ExpertGemm, EmptyGroupsGiveZeros) {
  REQUIRE_KERNEL();
#ifdef EO_WITH_CUDA
  const at::Device dev(at::kCUDA, 0);
  at::manual_seed(33);
  const Experts x = make_experts(16, 136, 200, 64, true, dev);
  const at::Tensor none = at::zeros({16}, at::dtype(at::kInt).device(dev));
  for (const std::int64_t M : {std::int64_t(300), std::int64_t(0)}) {
    for (const bool backward : {false, true}) {
      const at::Tensor a = randn_bf16(M, backward ? x.table.out : x.table.in, dev);
      (void)at::full({M, backward ? x.table.in : x.table.out}, NAN, a.options());
      const at::Tensor y =
          backward ? model::nf4_grouped_mm_dx(a, x.table, none) : model::nf4_grouped_mm(a, x.table, none);
      EXPECT_EQ(y.size(0), M);
      EXPECT_EQ(at::count_nonzero(y).item<std::int64_t>(), 0) << "M " << M << (backward ? " dy · W" : " x · W^T");
    }
  }
#endif
}

TEST(CudaNf4ExpertGemm, RunsWithoutHostSyncAndReplaysInAGraphWithNewGroups) {
  REQUIRE_KERNEL();
#ifdef EO_WITH_CUDA
  const at::Device dev(at::kCUDA, 0);
  at::manual_seed(34);
  const std::int64_t E = 32, M = 2048;
  const Experts x = make_experts(E, 264, 200, 64, true, dev);
  const at::Tensor a = randn_bf16(M, x.table.in, dev), g = randn_bf16(M, x.table.out, dev);
  const at::Tensor off = offsets_on(group_counts(Groups::kUneven, E, M, 1), dev);
  c10::cuda::device_synchronize();
  c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_ERROR);
  std::string error;
  try {
    (void)model::nf4_grouped_mm(a, x.table, off);
    (void)model::nf4_grouped_mm_dx(g, x.table, off);
  } catch (const c10::Error& e) {
    error = e.what_without_backtrace();
  }
  c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
  EXPECT_EQ(error, "") << "a host synchronisation in the NF4 expert GEMM";

  at::cuda::CUDAGraph graph;
  at::Tensor y, dx;
  {
    const c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(false, dev.index());
    c10::cuda::CUDAStreamGuard guard(side);
    (void)model::nf4_grouped_mm(a, x.table, off);  // warm-up off the capture (allocator)
    (void)model::nf4_grouped_mm_dx(g, x.table, off);
    c10::cuda::device_synchronize();
    graph.capture_begin();
    y = model::nf4_grouped_mm(a, x.table, off);
    dx = model::nf4_grouped_mm_dx(g, x.table, off);
    graph.capture_end();
  }
  for (const Groups groups : {Groups::kOneExpert, Groups::kEmptyExperts, Groups::kUncoveredTail, Groups::kRandom}) {
    const auto counts = group_counts(groups, E, M, 40 + static_cast<int>(groups));
    off.copy_(offsets_on(counts, dev));
    graph.replay();
    const at::Tensor eager_y = model::nf4_grouped_mm(a, x.table, off);
    const at::Tensor eager_dx = model::nf4_grouped_mm_dx(g, x.table, off);
    c10::cuda::device_synchronize();
    const std::string what = std::string("groups ") + name_of(groups);
    EXPECT_TRUE(at::equal(y, eager_y)) << what << ": the replay used other sizes (x · W^T)";
    EXPECT_TRUE(at::equal(dx, eager_dx)) << what << ": the replay used other sizes (dy · W)";
    std::string where;
    const auto [ref, mag] = reference(a, x.w32, false, counts);
    EXPECT_LE(worst_ratio(y, ref, mag, &where), 1.0) << what << ", x · W^T: " << where;
    const auto [ref_dx, mag_dx] = reference(g, x.w32, true, counts);
    EXPECT_LE(worst_ratio(dx, ref_dx, mag_dx, &where), 1.0) << what << ", dy · W: " << where;
  }
#endif
}

TEST(CudaNf4ExpertGemm, RefusesWhatItDoesNotTake) {
  REQUIRE_KERNEL();
#ifdef EO_WITH_CUDA
  const at::Device dev(at::kCUDA, 0);
  at::manual_seed(35);
  const Experts x = make_experts(4, 136, 200, 64, false, dev);
  const at::Tensor off = offsets_on({10, 10, 10, 10}, dev);
  EXPECT_THROW(model::nf4_grouped_mm(randn_bf16(40, 136, dev), x.table, off), Error);  // width is `in` (200)
  EXPECT_THROW(model::nf4_grouped_mm(randn_bf16(40, 200, dev).to(at::kHalf), x.table, off), Error);
  EXPECT_THROW(model::nf4_grouped_mm(randn_bf16(40, 200, dev), x.table, off.to(at::kLong)), Error);
  EXPECT_THROW(model::nf4_grouped_mm(randn_bf16(40, 200, dev), x.table, off.narrow(0, 0, 3)), Error);
  // in = 204: not a multiple of 8.
  const QuantizedWeight odd = to_device(nf4::quantize(at::randn({8, 204}), 64), dev);
  EXPECT_THROW(model::nf4_expert_table({&odd}), Error);
  // Experts that differ in shape.
  const QuantizedWeight other = to_device(nf4::quantize(at::randn({8, 200}), 64), dev);
  EXPECT_THROW(model::nf4_expert_table({&x.gpu[0], &other}), Error);
#endif
}

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  eo::ddp::World::init(&argc, &argv);
  return RUN_ALL_TESTS();
}
