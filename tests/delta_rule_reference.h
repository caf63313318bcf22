// The gated delta rule's float64 reference for tests (test_delta_rule.cpp on the CPU,
// test_cuda_delta_rule.cpp on a GPU): random inputs shaped like a Qwen3-Next layer's, packed rows'
// document ids, the per-token recurrence written independently of models/delta_rule.cpp, and every
// input's gradient through autograd.
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "models/delta_rule.h"
#include "tests/ref_support.h"

namespace eo::testing::delta_rule {

constexpr std::int64_t kB = 2, kHk = 2, kHv = 4, kDk = 16, kDv = 12;  // dk ≠ dv, two value heads per key head

struct Dims {
  std::int64_t B = kB, Hk = kHk, Hv = kHv, dk = kDk, dv = kDv;
};

struct Inputs {
  at::Tensor q, k, v, g, beta, h0, segment_ids;  // float64, h0 / segment_ids possibly undefined
};

// Random inputs shaped like a Qwen3-Next layer's: g = −exp(A_log) · softplus(a + dt_bias) ≤ 0,
// beta = sigmoid(b).
inline Inputs random_inputs(std::int64_t T, bool with_state, std::uint64_t seed, const Dims& n = {}) {
  at::manual_seed(seed);
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  Inputs in;
  in.q = at::randn({n.B, T, n.Hk, n.dk}, f64);
  in.k = at::randn({n.B, T, n.Hk, n.dk}, f64);
  in.v = at::randn({n.B, T, n.Hv, n.dv}, f64);
  const at::Tensor a_log = at::rand({n.Hv}, f64) * 2 - 1, dt_bias = at::randn({n.Hv}, f64);
  in.g = -a_log.exp() * at::softplus(at::randn({n.B, T, n.Hv}, f64) + dt_bias);
  in.beta = at::sigmoid(at::randn({n.B, T, n.Hv}, f64));
  if (with_state) in.h0 = at::randn({n.B, n.Hv, n.dk, n.dv}, f64) * 0.5;
  return in;
}

// Document ids for packed rows: each row's documents by their lengths.
inline at::Tensor packed_segments(const std::vector<std::vector<std::int64_t>>& rows) {
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
inline Recurrence recurrence(at::Tensor q, at::Tensor k, const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
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

// On `device` (the results come back to the CPU).
template <class Fn>
Outcome run_with_grads(const Inputs& in, at::ScalarType dtype, Fn fn, const at::Device& device = at::kCPU) {
  const auto leaf = [&](const at::Tensor& x, at::ScalarType dt) {
    return x.defined() ? x.to(device, dt).detach().requires_grad_(true) : at::Tensor();
  };
  const at::Tensor q = leaf(in.q, dtype), k = leaf(in.k, dtype), v = leaf(in.v, dtype), g = leaf(in.g, dtype),
                   beta = leaf(in.beta, dtype), h0 = leaf(in.h0, at::kFloat == dtype ? at::kFloat : at::kDouble);
  auto [out, state] = fn(q, k, v, g, beta, h0);
  at::manual_seed(99);
  const at::Tensor wo = at::randn(out.sizes(), at::kDouble).to(device), ws = at::randn(state.sizes(), at::kDouble).to(device);
  const at::Tensor loss = (out.to(at::kDouble) * wo).sum() + (state.to(at::kDouble) * ws).sum();
  std::vector<at::Tensor> leaves{q, k, v, g, beta};
  if (h0.defined()) leaves.push_back(h0);
  const auto grads = torch::autograd::grad({loss}, leaves);
  const auto cpu = [](const at::Tensor& t) { return t.detach().to(at::kCPU); };
  Outcome r{cpu(out), cpu(state), cpu(grads[0]), cpu(grads[1]), cpu(grads[2]), cpu(grads[3]), cpu(grads[4])};
  if (h0.defined()) r.dh0 = cpu(grads[5]);
  return r;
}

inline Outcome reference(const Inputs& in, bool l2norm) {
  return run_with_grads(in, at::kDouble, [&](auto q, auto k, auto v, auto g, auto beta, auto h0) {
    const Recurrence r = recurrence(q, k, v, g, beta, h0, in.segment_ids, l2norm);
    return std::make_pair(r.out, r.state);
  });
}

inline Outcome chunked(const Inputs& in, at::ScalarType dtype, std::int64_t chunk, bool l2norm,
                       const at::Device& device = at::kCPU) {
  const at::Tensor segments = in.segment_ids.defined() ? in.segment_ids.to(device) : at::Tensor();
  return run_with_grads(
      in, dtype,
      [&](auto q, auto k, auto v, auto g, auto beta, auto h0) {
        eo::model::GatedDeltaRuleOptions o;
        o.chunk_size = chunk;
        o.l2norm_qk = l2norm;
        const auto r = eo::model::gated_delta_rule(q, k, v, g, beta, h0, segments, o);
        return std::make_pair(r.out, r.final_state);
      },
      device);
}

// Each output and gradient within its tolerance of `want` (max |got − want| / max |want|).
inline void expect_close(const Outcome& got, const Outcome& want, double out_tol, double grad_tol, const std::string& what) {
  EXPECT_LE(eo::testing::rel_err(got.out, want.out), out_tol) << what << ": o";
  EXPECT_LE(eo::testing::rel_err(got.state, want.state), out_tol) << what << ": final state";
  EXPECT_LE(eo::testing::rel_err(got.dq, want.dq), grad_tol) << what << ": dq";
  EXPECT_LE(eo::testing::rel_err(got.dk, want.dk), grad_tol) << what << ": dk";
  EXPECT_LE(eo::testing::rel_err(got.dv, want.dv), grad_tol) << what << ": dv";
  EXPECT_LE(eo::testing::rel_err(got.dg, want.dg), grad_tol) << what << ": dg";
  EXPECT_LE(eo::testing::rel_err(got.dbeta, want.dbeta), grad_tol) << what << ": dbeta";
  if (want.dh0.defined()) EXPECT_LE(eo::testing::rel_err(got.dh0, want.dh0), grad_tol) << what << ": d initial_state";
}

}  // namespace eo::testing::delta_rule
