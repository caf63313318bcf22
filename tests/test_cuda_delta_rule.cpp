// The gated delta rule (models/delta_rule.h) on a GPU, label `cuda`: forward and every input's
// gradient against the float64 recurrence (tests/delta_rule_reference.h) in fp32 and bf16, on rows
// whose length is not a multiple of the chunk, with packed documents and a carried state; with no
// host synchronisation (CUDA's sync debug mode set to error); and captured in a CUDA graph
// (runtime/block_graphs.h, as training captures a block) whose replays follow new inputs.
// Tolerances as on the CPU (test_delta_rule.cpp): max |got − want| / max |want| per tensor. The float64
// comparisons run with the delta rule's CUDA kernels and with its ATen ops alone; the sync and graph
// tests with the kernels.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <string>
#include <vector>

#include "models/delta_rule.h"
#include "runtime/block_graphs.h"
#include "runtime/ddp/world.h"
#include "tests/delta_rule_reference.h"

#ifdef EO_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

using namespace eo::testing::delta_rule;

namespace {

constexpr double kFp32Tol = 5e-5, kBf16Tol = 1e-2;

// Runs with the delta rule's CUDA kernels on or off (models/delta_rule.h), and restores the setting.
struct KernelsSetting {
  explicit KernelsSetting(bool on) : before(eo::model::delta_rule_kernels_enabled()) {
    eo::model::set_delta_rule_kernels_enabled(on);
  }
  ~KernelsSetting() { eo::model::set_delta_rule_kernels_enabled(before); }
  bool before;
};
const char* kernels_name(bool on) { return on ? "kernels" : "ATen ops"; }

#define REQUIRE_GPU()                                                                                        \
  do {                                                                                                       \
    if (!at::hasCUDA()) GTEST_SKIP() << "SKIPPED: no CUDA device (this test runs on the GPU machine: ctest -L cuda)"; \
  } while (0)

// Packed rows of 150 tokens (three documents each, a boundary inside a chunk and on a chunk's edge,
// a one-token document) with a carried state.
Inputs packed_inputs(std::uint64_t seed, bool bf16_values) {
  Inputs in = random_inputs(150, /*with_state=*/true, seed);
  in.segment_ids = packed_segments({{40, 64, 46}, {64, 1, 85}});
  if (bf16_values)  // the reference gets the same rounded values
    for (at::Tensor* t : {&in.q, &in.k, &in.v, &in.g, &in.beta}) *t = t->to(at::kBFloat16).to(at::kDouble);
  return in;
}

TEST(CudaDeltaRule, MatchesTheFloat64RecurrenceOnTheGpu) {
  REQUIRE_GPU();
  const at::Device dev(at::kCUDA, 0);
  for (const bool kernels : {true, false}) {
    const KernelsSetting setting(kernels);
    for (std::int64_t chunk : {16, 64}) {
      const std::string what = std::string(kernels_name(kernels)) + ", chunk " + std::to_string(chunk);
      const Inputs in = packed_inputs(5000 + chunk, false);
      expect_close(chunked(in, at::kFloat, chunk, true, dev), reference(in, true), kFp32Tol, kFp32Tol, "fp32, " + what);
      const Inputs rounded = packed_inputs(6000 + chunk, true);
      expect_close(chunked(rounded, at::kBFloat16, chunk, true, dev), reference(rounded, true), kBf16Tol, kBf16Tol,
                   "bf16, " + what);
    }
  }
}

// The chunk chain's kernel (models/delta_rule_cuda.h) tiles the value columns by 32 and the key rows
// by the block's warps: Qwen3-Next's head sizes (dk = dv = 128, more than one tile each), one row
// with a document start inside a chunk, and dv = 40 (a partial column tile), against float64.
TEST(CudaDeltaRule, MatchesTheFloat64RecurrenceAtTheModelsHeadSizes) {
  REQUIRE_GPU();
  const at::Device dev(at::kCUDA, 0);
  for (const Dims dims : {Dims{1, 1, 2, 128, 128}, Dims{1, 2, 2, 64, 40}}) {
    Inputs in = random_inputs(200, /*with_state=*/true, 9000 + dims.dv, dims);
    in.segment_ids = packed_segments({{90, 110}});
    const Outcome want = reference(in, true);
    for (const bool kernels : {true, false}) {
      const KernelsSetting setting(kernels);
      const std::string what = std::string(kernels_name(kernels)) + ", dk " + std::to_string(dims.dk) + ", dv " +
                               std::to_string(dims.dv);
      expect_close(chunked(in, at::kFloat, 64, true, dev), want, kFp32Tol, kFp32Tol, "fp32, " + what);
    }
  }
}

TEST(CudaDeltaRule, ForwardAndBackwardNeverSyncWithTheHost) {
  REQUIRE_GPU();
#ifdef EO_WITH_CUDA
  const at::Device dev(at::kCUDA, 0);
  const KernelsSetting setting(true);
  const Inputs in = packed_inputs(7000, true);
  (void)chunked(in, at::kBFloat16, 64, true, dev);  // warm-up: lazy library state
  // The inputs on the device first: only the delta rule's own work runs in the checked window.
  const auto leaf = [&](const at::Tensor& t, at::ScalarType dt) { return t.to(dev, dt).detach().requires_grad_(true); };
  const at::Tensor q = leaf(in.q, at::kBFloat16), k = leaf(in.k, at::kBFloat16), v = leaf(in.v, at::kBFloat16),
                   g = leaf(in.g, at::kBFloat16), beta = leaf(in.beta, at::kBFloat16), h0 = leaf(in.h0, at::kFloat);
  const at::Tensor seg = in.segment_ids.to(dev);
  c10::cuda::device_synchronize();
  c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_ERROR);
  std::string error;
  try {
    eo::model::GatedDeltaRuleOptions o;
    o.l2norm_qk = true;
    const auto r = eo::model::gated_delta_rule(q, k, v, g, beta, h0, seg, o);
    const at::Tensor loss = r.out.to(at::kFloat).square().sum() + r.final_state.sum();
    (void)torch::autograd::grad({loss}, {q, k, v, g, beta, h0});
  } catch (const c10::Error& e) {
    error = e.what_without_backtrace();
  }
  c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
  EXPECT_EQ(error, "") << "a host synchronisation in the gated delta rule";
#endif
}

TEST(CudaDeltaRule, ReplaysInACapturedGraphWithNewInputs) {
  REQUIRE_GPU();
  const at::Device dev(at::kCUDA, 0);
  const KernelsSetting setting(true);
  eo::BlockGraphs graphs(dev, /*enabled=*/true);
  // One use: the inputs' values in, the output, final state and every gradient out.
  const auto use = [&](const std::vector<at::Tensor>& x) {
    const auto leaf = [](const at::Tensor& t) { return t.detach().requires_grad_(true); };
    const at::Tensor q = leaf(x[0]), k = leaf(x[1]), v = leaf(x[2]), g = leaf(x[3]), beta = leaf(x[4]), h0 = leaf(x[5]);
    eo::model::GatedDeltaRuleOptions o;
    o.l2norm_qk = true;
    const auto r = eo::model::gated_delta_rule(q, k, v, g, beta, h0, x[6], o);
    const at::Tensor loss = (r.out.to(at::kFloat) * x[7]).sum() + (r.final_state * x[8]).sum();
    std::vector<at::Tensor> out{r.out.detach(), r.final_state.detach()};
    for (const at::Tensor& d : torch::autograd::grad({loss}, {q, k, v, g, beta, h0})) out.push_back(d);
    return out;
  };
  for (int round = 0; round < 4; ++round) {  // eager warm-up, capture, then two replays on new values
    const Inputs in = packed_inputs(8000 + round, true);
    at::manual_seed(round);
    const at::Tensor wo = at::randn({kB, 150, kHv, kDv}, at::kFloat), ws = at::randn({kB, kHv, kDk, kDv}, at::kFloat);
    std::vector<at::Tensor> x;
    for (const at::Tensor& t : {in.q, in.k, in.v, in.g, in.beta}) x.push_back(t.to(dev, at::kBFloat16));
    x.push_back(in.h0.to(dev, at::kFloat));
    x.push_back(in.segment_ids.to(dev));
    x.push_back(wo.to(dev));
    x.push_back(ws.to(dev));
    const std::vector<at::Tensor> got = graphs.run("delta rule", x, use);
    const std::vector<at::Tensor> eager = use(x);
    ASSERT_EQ(got.size(), eager.size());
    for (std::size_t i = 0; i < got.size(); ++i)
      EXPECT_TRUE(at::equal(got[i], eager[i])) << "round " << round << ": output " << i << " differs from the eager use";
  }
  EXPECT_EQ(graphs.graphs(), 1) << "the use was not captured (the log says why graphs turned off)";
  EXPECT_GE(graphs.replays(), 2);
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  eo::ddp::World::init(&argc, &argv);
  return RUN_ALL_TESTS();
}
