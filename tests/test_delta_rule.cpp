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
#include "tests/ref_support.h"

namespace {

using eo::model::gated_delta_rule;
using eo::model::GatedDeltaRuleOptions;
using eo::testing::rel_err;

// Tolerances, as max |got − want| / max |want| per tensor against the float64 recurrence.
// Measured on these inputs: float64 ~2e-15, fp32 up to ~8e-6 (chunk 64), bf16 up to ~4e-3.
constexpr double kFp64Tol = 1e-10;  // the chunked algorithm itself: exact up to float64 rounding
constexpr double kFp32Tol = 5e-5;   // fp32 inputs and arithmetic
// bf16 inputs (the reference gets the same rounded values): o and the gradients come back in bf16
// (2^-9 relative rounding each), the arithmetic and the state are fp32.
constexpr double kBf16Tol = 1e-2;

constexpr std::int64_t kB = 2, kHk = 2, kHv = 4, kDk = 16, kDv = 12;  // dk ≠ dv, two value heads per key head

struct Inputs {
  at::Tensor q, k, v, g, beta, h0, segment_ids;  // float64, h0 / segment_ids possibly undefined
};

// Random inputs shaped like a Qwen3-Next layer's: g = −exp(A_log) · softplus(a + dt_bias) ≤ 0,
// beta = sigmoid(b).
Inputs random_inputs(std::int64_t T, bool with_state, std::uint64_t seed) {
  at::manual_seed(seed);
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  Inputs in;
  in.q = at::randn({kB, T, kHk, kDk}, f64);
  in.k = at::randn({kB, T, kHk, kDk}, f64);
  in.v = at::randn({kB, T, kHv, kDv}, f64);
  const at::Tensor a_log = at::rand({kHv}, f64) * 2 - 1, dt_bias = at::randn({kHv}, f64);
  in.g = -a_log.exp() * at::softplus(at::randn({kB, T, kHv}, f64) + dt_bias);
  in.beta = at::sigmoid(at::randn({kB, T, kHv}, f64));
  if (with_state) in.h0 = at::randn({kB, kHv, kDk, kDv}, f64) * 0.5;
  return in;
}

// Document ids for packed rows: each row's documents by their lengths.
at::Tensor packed_segments(const std::vector<std::vector<std::int64_t>>& rows) {
  std::vector<at::Tensor> out;
  for (const auto& lengths : rows) {
    std::vector<at::Tensor> docs;
    for (std::size_t d = 0; d < lengths.size(); ++d) docs.push_back(at::full({lengths[d]}, std::int64_t(d), at::kLong));
    out.push_back(at::cat(docs));
  }
  return at::stack(out);
}

// The recurrence token by token in float64, as transformers' torch_recurrent_gated_delta_rule
// writes it, with the state zeroed where the document id changes.
struct Recurrence {
  at::Tensor out, state;
};
Recurrence recurrence(at::Tensor q, at::Tensor k, const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
                      const at::Tensor& h0, const at::Tensor& segment_ids, bool l2norm) {
  const std::int64_t B = q.size(0), T = q.size(1), Hk = q.size(2), dk = q.size(3), Hv = v.size(2), dv = v.size(3);
  if (l2norm) {
    q = q / at::sqrt(q.square().sum(-1, true) + 1e-6);
    k = k / at::sqrt(k.square().sum(-1, true) + 1e-6);
  }
  q = q / std::sqrt(double(dk));
  const at::Tensor key_head = at::arange(Hv, at::kLong).div(Hv / Hk, "floor");  // value head h reads key head h / group
  at::Tensor S = h0.defined() ? h0 : at::zeros({B, Hv, dk, dv}, v.options());
  std::vector<at::Tensor> outs;
  for (std::int64_t t = 0; t < T; ++t) {
    if (segment_ids.defined() && t > 0) {
      const at::Tensor same = (segment_ids.select(1, t) == segment_ids.select(1, t - 1)).to(at::kDouble);
      S = S * same.view({B, 1, 1, 1});
    }
    const at::Tensor qt = q.select(1, t).index_select(1, key_head), kt = k.select(1, t).index_select(1, key_head);
    S = S * g.select(1, t).exp().view({B, Hv, 1, 1});
    const at::Tensor predicted = (S * kt.unsqueeze(-1)).sum(-2);  // Sᵀ k
    const at::Tensor delta = (v.select(1, t) - predicted) * beta.select(1, t).unsqueeze(-1);
    S = S + kt.unsqueeze(-1) * delta.unsqueeze(-2);
    outs.push_back((S * qt.unsqueeze(-1)).sum(-2));
  }
  return {at::stack(outs, 1), S};
}

// Outputs and gradients of the scalar Σ o·wo + Σ S·ws, whose gradient reaches every input.
struct Outcome {
  at::Tensor out, state, dq, dk, dv, dg, dbeta, dh0;
};

template <class Fn>
Outcome run_with_grads(const Inputs& in, at::ScalarType dtype, Fn fn) {
  const auto leaf = [&](const at::Tensor& x, at::ScalarType dt) {
    return x.defined() ? x.to(dt).detach().requires_grad_(true) : at::Tensor();
  };
  const at::Tensor q = leaf(in.q, dtype), k = leaf(in.k, dtype), v = leaf(in.v, dtype), g = leaf(in.g, dtype),
                   beta = leaf(in.beta, dtype), h0 = leaf(in.h0, at::kFloat == dtype ? at::kFloat : at::kDouble);
  auto [out, state] = fn(q, k, v, g, beta, h0);
  at::manual_seed(99);
  const at::Tensor wo = at::randn(out.sizes(), at::kDouble), ws = at::randn(state.sizes(), at::kDouble);
  const at::Tensor loss = (out.to(at::kDouble) * wo).sum() + (state.to(at::kDouble) * ws).sum();
  std::vector<at::Tensor> leaves{q, k, v, g, beta};
  if (h0.defined()) leaves.push_back(h0);
  const auto grads = torch::autograd::grad({loss}, leaves);
  Outcome r{out.detach(), state.detach(), grads[0], grads[1], grads[2], grads[3], grads[4]};
  if (h0.defined()) r.dh0 = grads[5];
  return r;
}

Outcome reference(const Inputs& in, bool l2norm) {
  return run_with_grads(in, at::kDouble, [&](auto q, auto k, auto v, auto g, auto beta, auto h0) {
    const Recurrence r = recurrence(q, k, v, g, beta, h0, in.segment_ids, l2norm);
    return std::make_pair(r.out, r.state);
  });
}

Outcome chunked(const Inputs& in, at::ScalarType dtype, std::int64_t chunk, bool l2norm) {
  return run_with_grads(in, dtype, [&](auto q, auto k, auto v, auto g, auto beta, auto h0) {
    GatedDeltaRuleOptions o;
    o.chunk_size = chunk;
    o.l2norm_qk = l2norm;
    const auto r = gated_delta_rule(q, k, v, g, beta, h0, in.segment_ids, o);
    return std::make_pair(r.out, r.final_state);
  });
}

void expect_close(const Outcome& got, const Outcome& want, double out_tol, double grad_tol, const std::string& what) {
  EXPECT_LE(rel_err(got.out, want.out), out_tol) << what << ": o";
  EXPECT_LE(rel_err(got.state, want.state), out_tol) << what << ": final state";
  EXPECT_LE(rel_err(got.dq, want.dq), grad_tol) << what << ": dq";
  EXPECT_LE(rel_err(got.dk, want.dk), grad_tol) << what << ": dk";
  EXPECT_LE(rel_err(got.dv, want.dv), grad_tol) << what << ": dv";
  EXPECT_LE(rel_err(got.dg, want.dg), grad_tol) << what << ": dg";
  EXPECT_LE(rel_err(got.dbeta, want.dbeta), grad_tol) << what << ": dbeta";
  if (want.dh0.defined()) EXPECT_LE(rel_err(got.dh0, want.dh0), grad_tol) << what << ": d initial_state";
}

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
