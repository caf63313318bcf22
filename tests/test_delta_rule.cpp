// The chunked gated delta rule (models/delta_rule.h) against a per-token recurrence written here in
// float64 (outputs, final state, and every input's gradient by autograd through that recurrence),
// and against transformers' own torch_chunk_gated_delta_rule (tests/ref/delta_rule_ref.py).
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <cmath>
#include <string>
#include <vector>

#include "models/delta_rule.h"
#include "models/safetensors.h"
#include "tests/delta_rule_reference.h"
#include "tests/ref_support.h"

namespace {

using eo::model::gated_delta_rule;
using eo::model::GatedDeltaRuleOptions;
using eo::testing::rel_err;
using namespace eo::testing::delta_rule;

// Tolerances, as max |got − want| / max |want| per tensor against the float64 recurrence.
// Measured on these inputs: float64 ~2e-15, fp32 up to ~8e-6 (chunk 64), bf16 up to ~4e-3.
constexpr double kFp64Tol = 1e-10;  // the chunked algorithm itself: exact up to float64 rounding
constexpr double kFp32Tol = 5e-5;   // fp32 inputs and arithmetic
// bf16 inputs (the reference gets the same rounded values): o and the gradients come back in bf16
// (2^-9 relative rounding each), the arithmetic and the state are fp32.
constexpr double kBf16Tol = 1e-2;


struct Case {
  std::int64_t chunk, T;
};
class GatedDeltaRule : public ::testing::TestWithParam<Case> {};

std::string name(const Case& c) { return "chunk " + std::to_string(c.chunk) + ", T " + std::to_string(c.T); }

TEST_P(GatedDeltaRule, Float64EqualsTheRecurrence) {
  const Case c = GetParam();
  const Inputs in = random_inputs(c.T, /*with_state=*/true, 1000 + c.T);
  expect_close(chunked(in, at::kDouble, c.chunk, true), reference(in, true), kFp64Tol, kFp64Tol, name(c));
}

TEST_P(GatedDeltaRule, Float32WithinTolerance) {
  const Case c = GetParam();
  const Inputs in = random_inputs(c.T, /*with_state=*/true, 2000 + c.T);
  expect_close(chunked(in, at::kFloat, c.chunk, true), reference(in, true), kFp32Tol, kFp32Tol, name(c));
}

TEST_P(GatedDeltaRule, Bfloat16WithinTolerance) {
  const Case c = GetParam();
  Inputs in = random_inputs(c.T, /*with_state=*/false, 3000 + c.T);
  for (at::Tensor* t : {&in.q, &in.k, &in.v, &in.g, &in.beta}) *t = t->to(at::kBFloat16).to(at::kDouble);
  expect_close(chunked(in, at::kBFloat16, c.chunk, true), reference(in, true), kBf16Tol, kBf16Tol, name(c));
}

INSTANTIATE_TEST_SUITE_P(ChunksAndLengths, GatedDeltaRule,
                         ::testing::ValuesIn([] {
                           std::vector<Case> cases;
                           for (std::int64_t chunk : {16, 32, 64})
                             for (std::int64_t T : {1, 63, 64, 65, 200}) cases.push_back({chunk, T});
                           return cases;
                         }()),
                         [](const auto& info) {
                           return "chunk" + std::to_string(info.param.chunk) + "_T" + std::to_string(info.param.T);
                         });

// Packed rows, three documents each, boundaries inside a chunk, on a chunk edge, and a one-token
// document; the carried state enters each row's first document.
TEST(GatedDeltaRulePacked, ResetsTheStateAtEachDocument) {
  Inputs in = random_inputs(150, /*with_state=*/true, 4000);
  in.segment_ids = packed_segments({{40, 64, 46}, {64, 1, 85}});
  const Outcome want = reference(in, true);
  for (std::int64_t chunk : {16, 32, 64}) {
    expect_close(chunked(in, at::kDouble, chunk, true), want, kFp64Tol, kFp64Tol, "float64, chunk " + std::to_string(chunk));
    expect_close(chunked(in, at::kFloat, chunk, true), want, kFp32Tol, kFp32Tol, "fp32, chunk " + std::to_string(chunk));
  }
  // A document's output does not depend on the one before it: the recurrence itself is checked.
  Inputs alone = in;
  alone.segment_ids = at::Tensor();
  const Outcome leaky = reference(alone, true);
  EXPECT_GT(rel_err(leaky.out.narrow(1, 40, 110), want.out.narrow(1, 40, 110)), 1e-3);
}

// Without the L2 norm (keys kept small so the recurrence stays bounded) and with an explicit scale.
TEST(GatedDeltaRuleSettings, WithoutL2NormAndWithScale) {
  Inputs in = random_inputs(100, /*with_state=*/true, 5000);
  in.k = in.k * 0.2;
  const Outcome want = reference(in, false);
  expect_close(chunked(in, at::kDouble, 32, false), want, kFp64Tol, kFp64Tol, "no l2norm");
  GatedDeltaRuleOptions o;
  o.scale = 0.5;
  const auto got = gated_delta_rule(in.q, in.k, in.v, in.g, in.beta, in.h0, at::Tensor(), o);
  const auto base = gated_delta_rule(in.q * (0.5 * std::sqrt(double(kDk))), in.k, in.v, in.g, in.beta, in.h0,
                                     at::Tensor(), {});
  EXPECT_LE(rel_err(got.out, base.out), kFp64Tol);
}

TEST(GatedDeltaRuleSettings, RefusesMismatchedShapes) {
  const Inputs in = random_inputs(8, false, 6000);
  EXPECT_THROW(gated_delta_rule(in.q, in.k, in.v.narrow(2, 0, 3), in.g.narrow(2, 0, 3), in.beta.narrow(2, 0, 3),
                                at::Tensor(), at::Tensor()),
               std::exception);  // 3 value heads over 2 key heads
  EXPECT_THROW(gated_delta_rule(in.q, in.k, in.v, in.g, in.beta, at::zeros({kB, kHv, kDv, kDk}, at::kDouble), at::Tensor()),
               std::exception);  // state transposed
}

// transformers' torch_chunk_gated_delta_rule on the same inputs (fp32, its chunk of 64, L2 norm on,
// GVA, an initial state), gradients by autograd through it; packed rows as per-document calls,
// which is what fla's cu_seqlens gives.
TEST(GatedDeltaRuleTransformers, MatchesTorchChunkGatedDeltaRule) {
  const std::string dir = eo::testing::python_fixture("delta_rule_ref.py", "delta_rule_ref", "qwen3_next");
  const auto ref = eo::st::File::open(dir + "/ref.safetensors");
  for (const std::string prefix : {"plain.", "packed."}) {
    const auto t = [&](const std::string& n) { return ref->load(prefix + n); };
    const at::Tensor seg = prefix == "packed." ? t("segment_ids") : at::Tensor();
    const at::Tensor q = t("q").requires_grad_(), k = t("k").requires_grad_(), v = t("v").requires_grad_(),
                     g = t("g").requires_grad_(), beta = t("beta").requires_grad_(), h0 = t("h0").requires_grad_();
    GatedDeltaRuleOptions o;
    o.l2norm_qk = true;
    const auto r = gated_delta_rule(q, k, v, g, beta, h0, seg, o);
    EXPECT_LE(rel_err(r.out, t("out")), kFp32Tol) << prefix << "out";
    EXPECT_LE(rel_err(r.final_state, t("final_state")), kFp32Tol) << prefix << "final_state";
    const at::Tensor loss = (r.out * t("w_out")).sum() + (r.final_state * t("w_state")).sum();
    const auto grads = torch::autograd::grad({loss}, {q, k, v, g, beta, h0});
    const char* names[] = {"grad.q", "grad.k", "grad.v", "grad.g", "grad.beta", "grad.h0"};
    for (int i = 0; i < 6; ++i) EXPECT_LE(rel_err(grads[i], t(names[i])), kFp32Tol) << prefix << names[i];
  }
}

}  // namespace
