#include "models/delta_rule.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <atomic>
#include <cmath>
#include <optional>

#include "common/error.h"

#ifdef EO_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common/cuda_check.h"
#include "models/delta_rule_cuda.h"
#endif

// Notation, per (row, value head) and chunk of C tokens, i and j positions in the chunk:
//   b_i   Σ_{t ≤ i} g_t, the chunk-local cumulative log decay (g zeroed at document starts)
//   Γ_i   exp(b_i) if no document starts at or before i in the chunk, else 0: the decay from the
//         state entering the chunk (S₀) to after token i
//   D_ij  exp(b_i − b_j) if j ≤ i in the same document, else 0: the decay from after j to after i
//   A     strictly lower: A_ij = β_i D_ij (k_i · k_j)
//   Tm    (I + A)⁻¹, the UT transform of the chunk's delta-rule updates
//   U     Tm (β ⊙ v),  W = Tm (βΓ ⊙ k)
//   Ṽ     U − W S₀, the values each token writes once the state S₀ predicts its part
//   o     (Γ ⊙ q) S₀ + (q kᵀ ⊙ D) Ṽ
//   S₁    Γ_{C−1} S₀ + (e ⊙ k)ᵀ Ṽ with e_j = D_{C−1,j}: the state leaving the chunk
// Everything except the S₀ → S₁ chain is computed for all chunks at once.

namespace eo::model {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr double kL2Eps = 1e-6;  // transformers' and fla's l2norm epsilon

// On: test_cuda_delta_rule holds both forms to the float64 recurrence on a GPU (H100, 2026-12-07).
std::atomic<bool> kernels_enabled{true};

at::ScalarType compute_dtype(const at::Tensor& q) { return q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

// [B, T, H, D] → [B, H, N, C, D], zero-padded to N·C tokens. Padded tokens have k = v = β = g = 0,
// so they leave the state as it is.
at::Tensor to_chunks(const at::Tensor& x, std::int64_t C) {
  at::Tensor t = x.transpose(1, 2);
  const std::int64_t T = t.size(2), pad = (C - T % C) % C;
  if (pad) t = at::constant_pad_nd(t, {0, 0, 0, pad});
  return t.reshape({t.size(0), t.size(1), -1, C, t.size(3)});
}
at::Tensor gate_to_chunks(const at::Tensor& x, std::int64_t C) { return to_chunks(x.unsqueeze(-1), C).squeeze(-1); }
// [B, H, N, C, D] → [B, T, H, D]
at::Tensor from_chunks(const at::Tensor& x, std::int64_t T) { return x.flatten(2, 3).narrow(2, 0, T).transpose(1, 2); }
at::Tensor gate_from_chunks(const at::Tensor& x, std::int64_t T) { return from_chunks(x.unsqueeze(-1), T).squeeze(-1); }

// x · rsqrt(Σx² + eps) over the last dimension.
at::Tensor l2_normalise(const at::Tensor& x) { return x * at::rsqrt(x.square().sum(-1, true) + kL2Eps); }
// Its backward: with y = x r, dx = r (dy − y (y · dy)).
at::Tensor l2_normalise_backward(const at::Tensor& x, const at::Tensor& dy) {
  const at::Tensor r = at::rsqrt(x.square().sum(-1, true) + kL2Eps);
  const at::Tensor y = x * r;
  return r * (dy - y * (y * dy).sum(-1, true));
}

// Reverse cumulative sum over the last dimension: out_i = Σ_{t ≥ i} x_t.
at::Tensor reverse_cumsum(const at::Tensor& x) { return x.flip(-1).cumsum(-1).flip(-1); }

struct Settings {
  std::int64_t chunk;
  bool l2norm;
  double scale;
};

#ifdef EO_WITH_CUDA
cudaStream_t stream_of(const at::Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.device().index()).stream(); }
#endif

// (I + a)⁻¹ for strictly lower a [.., C, C]: a kernel for fp32 on a GPU, a triangular solve elsewhere.
at::Tensor unit_lower_inverse(const at::Tensor& a) {
  const std::int64_t C = a.size(-1);
#ifdef EO_WITH_CUDA
  if (a.is_cuda() && a.scalar_type() == at::kFloat && C <= delta_rule::cuda::kMaxInverseC && kernels_enabled) {
    const at::Tensor ac = a.contiguous();
    at::Tensor inv = at::empty_like(ac);
    c10::cuda::CUDAGuard guard(a.device());
    EO_CUDA_CHECK(delta_rule::cuda::unit_lower_inverse(ac.data_ptr<float>(), inv.data_ptr<float>(), ac.numel() / (C * C),
                                                       static_cast<int>(C), stream_of(a)),
                  "gated delta rule UT transform kernel");
    return inv;
  }
#endif
  const at::Tensor eye = at::eye(C, a.options());
  return at::linalg_solve_triangular(a + eye, eye.expand_as(a), /*upper=*/false, /*left=*/true, /*unitriangular=*/true);
}

// One call's inputs in chunks, in the compute dtype, and the intra-chunk quantities above.
struct Chunked {
  std::int64_t T = 0, group = 1;  // tokens, value heads per key head
  at::Tensor q_unit, k_unit;      // [B, T, Hk, dk] after the L2 norm (when on), compute dtype
  at::Tensor q, k, v;             // [B, Hv, N, C, dk | dv]; q scaled
  at::Tensor beta, starts;        // [B, Hv, N, C]; starts [B, 1, N, C] bool (undefined: one document per row)
  at::Tensor gamma, decay, to_end;  // Γ [B, Hv, N, C], D [B, Hv, N, C, C], e [B, Hv, N, C]
  at::Tensor chunk_decay;           // Γ_{C−1} [B, Hv, N, 1, 1]
  at::Tensor kk, qk, inv, u, w;     // k kᵀ, q kᵀ, Tm [.., C, C]; U [.., C, dv]; W [.., C, dk]
  at::Tensor q_gamma, k_end;        // Γ ⊙ q, e ⊙ k [.., C, dk]
};

Chunked prepare(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                const at::Tensor& beta, const std::optional<at::Tensor>& starts, const Settings& s) {
  const at::ScalarType dt = compute_dtype(q);
  const std::int64_t C = s.chunk;
  Chunked c;
  c.T = q.size(1);
  c.group = v.size(2) / k.size(2);
  c.q_unit = q.to(dt);
  c.k_unit = k.to(dt);
  if (s.l2norm) {
    c.q_unit = l2_normalise(c.q_unit);
    c.k_unit = l2_normalise(c.k_unit);
  }
  at::Tensor qh = c.q_unit * s.scale, kh = c.k_unit;
  if (c.group > 1) {
    qh = qh.repeat_interleave(c.group, 2);
    kh = kh.repeat_interleave(c.group, 2);
  }
  c.q = to_chunks(qh, C);
  c.k = to_chunks(kh, C);
  c.v = to_chunks(v.to(dt), C);
  c.beta = gate_to_chunks(beta.to(dt), C);
  at::Tensor gc = gate_to_chunks(g.to(dt), C);

  // Document masks: position-in-document counters within each chunk. A document start's own decay
  // multiplies a state that is reset anyway, so its g is dropped (and gets no gradient).
  const at::Tensor lower = at::ones({C, C}, q.options().dtype(at::kBool)).tril();
  at::Tensor same_doc = lower, before_first_start;
  if (starts) {
    c.starts = gate_to_chunks(starts->unsqueeze(-1), C);  // [B, 1, N, C]
    gc = gc.masked_fill(c.starts, 0);
    const at::Tensor doc = c.starts.to(at::kInt).cumsum(-1);
    same_doc = lower & (doc.unsqueeze(-1) == doc.unsqueeze(-2));
    before_first_start = doc == 0;
  }
  const at::Tensor b = gc.cumsum(-1);
  c.gamma = b.exp();
  if (before_first_start.defined()) c.gamma = c.gamma * before_first_start;
  // exp of −inf where masked: never exp of a positive difference (j > i), which could overflow.
  c.decay = (b.unsqueeze(-1) - b.unsqueeze(-2)).masked_fill(same_doc.logical_not(), -INFINITY).exp();
  c.to_end = c.decay.select(-2, C - 1);
  c.chunk_decay = c.gamma.select(-1, C - 1).unsqueeze(-1).unsqueeze(-1);

  const at::Tensor kt = c.k.transpose(-1, -2);
  c.kk = at::matmul(c.k, kt);
  c.qk = at::matmul(c.q, kt);
  const at::Tensor a = (c.beta.unsqueeze(-1) * c.kk * c.decay).tril(-1);
  c.inv = unit_lower_inverse(a);
  c.u = at::matmul(c.inv, c.v * c.beta.unsqueeze(-1));
  c.w = at::matmul(c.inv, c.k * (c.beta * c.gamma).unsqueeze(-1));
  c.q_gamma = c.q * c.gamma.unsqueeze(-1);
  c.k_end = c.k * c.to_end.unsqueeze(-1);
  return c;
}

// The chain through the chunks, the one part that runs chunk after chunk, in the form both the
// forward's state and the backward's state gradient take (delta_rule_cuda.h): per chunk n, in order
// or `reverse`d, saved[n] = S; y[n] = x[n] + sign_p · P[n] S; S = decay[n] S + z[n] + sign_q · Q[n]ᵀ y[n].
// x [B, Hv, N, C, dv]; P, Q [.., C, dk]; z [.., dk, dv] or undefined; decay [B, Hv, N, 1, 1]; state
// [B, Hv, dk, dv]. One kernel for fp32 on a GPU, batched matmuls per chunk otherwise.
struct Chain {
  at::Tensor saved, y, final_state;
};

Chain chunk_chain(const at::Tensor& x, const at::Tensor& p, double sign_p, const at::Tensor& q, double sign_q,
                  const at::Tensor& z, const at::Tensor& decay, const at::Tensor& state, bool reverse) {
  const std::int64_t B = x.size(0), H = x.size(1), N = x.size(2), C = x.size(3), dv = x.size(4), dk = p.size(4);
  Chain r;
  r.saved = at::empty({B, H, N, dk, dv}, x.options());
#ifdef EO_WITH_CUDA
  const delta_rule::cuda::ChainShape shape{B * H, N, static_cast<int>(C), static_cast<int>(dk), static_cast<int>(dv)};
  // The guard first: chain_fits asks the current device for its shared memory.
  std::optional<c10::cuda::CUDAGuard> guard;
  if (x.is_cuda()) guard.emplace(x.device());
  if (x.is_cuda() && x.scalar_type() == at::kFloat && kernels_enabled && delta_rule::cuda::chain_fits(shape)) {
    const at::Tensor xc = x.contiguous(), pc = p.contiguous(), qc = q.contiguous(),
                     zc = z.defined() ? z.contiguous() : at::Tensor(), dc = decay.reshape({B, H, N}).contiguous(),
                     s0 = state.to(at::kFloat).contiguous();
    r.y = at::empty_like(xc);
    r.final_state = at::empty_like(s0);
    const delta_rule::cuda::ChainArgs args{xc.data_ptr<float>(),
                                           pc.data_ptr<float>(),
                                           qc.data_ptr<float>(),
                                           zc.defined() ? zc.data_ptr<float>() : nullptr,
                                           dc.data_ptr<float>(),
                                           s0.data_ptr<float>(),
                                           r.y.data_ptr<float>(),
                                           r.saved.data_ptr<float>(),
                                           r.final_state.data_ptr<float>(),
                                           static_cast<float>(sign_p),
                                           static_cast<float>(sign_q),
                                           reverse};
    EO_CUDA_CHECK(delta_rule::cuda::chunk_chain(shape, args, stream_of(x)), "gated delta rule chunk chain kernel");
    return r;
  }
#endif
  r.y = at::empty_like(x);
  at::Tensor s = state;
  for (std::int64_t i = 0; i < N; ++i) {
    const std::int64_t n = reverse ? N - 1 - i : i;
    r.saved.select(2, n).copy_(s);
    const at::Tensor yn = at::add(x.select(2, n), at::matmul(p.select(2, n), s), sign_p);
    r.y.select(2, n).copy_(yn);
    at::Tensor next = s * decay.select(2, n);
    if (z.defined()) next = next + z.select(2, n);
    s = at::add(next, at::matmul(q.select(2, n).transpose(-1, -2), yn), sign_q);
  }
  r.final_state = s;
  return r;
}

// The forward chain: each chunk's entry state S₀ [B, Hv, N, dk, dv], its Ṽ = U − W S₀, and the state
// after the last chunk.
struct Scan {
  at::Tensor entry, v_new, final_state;
};

Scan scan(const Chunked& c, const at::Tensor& initial) {
  Chain f = chunk_chain(c.u, c.w, -1, c.k_end, 1, at::Tensor(), c.chunk_decay, initial, /*reverse=*/false);
  return {std::move(f.saved), std::move(f.y), std::move(f.final_state)};
}

at::Tensor initial_or_zeros(const std::optional<at::Tensor>& h0, const Chunked& c) {
  if (h0) return h0->to(c.u.scalar_type());
  return at::zeros({c.u.size(0), c.u.size(1), c.k.size(-1), c.v.size(-1)}, c.u.options());
}

struct GatedDeltaRuleFunction : public torch::autograd::Function<GatedDeltaRuleFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& g, const at::Tensor& beta, const std::optional<at::Tensor>& h0,
                               const std::optional<at::Tensor>& starts, std::int64_t chunk, bool l2norm,
                               double scale) {
    const Settings s{chunk, l2norm, scale};
    const Chunked c = prepare(q, k, v, g, beta, starts, s);
    const Scan r = scan(c, initial_or_zeros(h0, c));
    const at::Tensor o = at::matmul(c.q_gamma, r.entry) + at::matmul(c.qk * c.decay, r.v_new);
    // Only the inputs are kept; the backward recomputes every chunk quantity from them.
    ctx->save_for_backward({q, k, v, g, beta, h0 ? *h0 : at::Tensor(), starts ? *starts : at::Tensor()});
    ctx->saved_data["chunk"] = chunk;
    ctx->saved_data["l2norm"] = l2norm;
    ctx->saved_data["scale"] = scale;
    return {from_chunks(o, c.T).to(q.scalar_type()), r.final_state};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &g = saved[3], &beta = saved[4];
    const std::optional<at::Tensor> h0 = saved[5].defined() ? std::optional<at::Tensor>(saved[5]) : std::nullopt;
    const std::optional<at::Tensor> starts =
        saved[6].defined() ? std::optional<at::Tensor>(saved[6]) : std::nullopt;
    const Settings s{ctx->saved_data["chunk"].toInt(), ctx->saved_data["l2norm"].toBool(),
                     ctx->saved_data["scale"].toDouble()};
    const Chunked c = prepare(q, k, v, g, beta, starts, s);
    const Scan r = scan(c, initial_or_zeros(h0, c));
    const std::int64_t C = s.chunk;

    const at::Tensor d_out = grads[0].defined() ? to_chunks(grads[0].to(c.u.scalar_type()), C) : at::zeros_like(c.u);
    const at::Tensor d_state =
        grads[1].defined() ? grads[1].to(c.u.scalar_type()) : at::zeros_like(r.final_state);

    // The chain backwards: dṼ = (q kᵀ ⊙ D)ᵀ dO + (e ⊙ k) dS₁ and dS₀ = (Γ ⊙ q)ᵀ dO + Γ_{C−1} dS₁ − Wᵀ dṼ.
    // Their dO parts are batched; the chain adds the parts that wait on dS₁.
    const at::Tensor attn = c.qk * c.decay;
    const at::Tensor d_entry_from_out = at::matmul(c.q_gamma.transpose(-1, -2), d_out);
    Chain back = chunk_chain(at::matmul(attn.transpose(-1, -2), d_out), c.k_end, 1, c.w, -1, d_entry_from_out,
                             c.chunk_decay, d_state, /*reverse=*/true);
    const at::Tensor d_v_new = back.y, d_exit = back.saved;  // dṼ, and dS₁ of each chunk
    const at::Tensor d_h0 = back.final_state;

    // Everything else, for all chunks at once.
    const at::Tensor entry_t = r.entry.transpose(-1, -2);
    const at::Tensor d_q_gamma = at::matmul(d_out, entry_t);                      // [.., C, dk]
    const at::Tensor d_attn = at::matmul(d_out, r.v_new.transpose(-1, -2)) * c.decay;  // masked like D
    const at::Tensor d_k_end = at::matmul(r.v_new, d_exit.transpose(-1, -2));     // [.., C, dk]
    const at::Tensor d_chunk_decay = (r.entry * d_exit).sum({-1, -2});            // [B, Hv, N]
    const at::Tensor d_w = -at::matmul(d_v_new, entry_t);
    // Through Tm = (I + A)⁻¹: for Y = Tm X, dX = Tmᵀ dY and dA = −dX Yᵀ (strictly lower).
    const at::Tensor inv_t = c.inv.transpose(-1, -2);
    const at::Tensor d_xu = at::matmul(inv_t, d_v_new), d_xw = at::matmul(inv_t, d_w);
    const at::Tensor d_a =
        -(at::matmul(d_xu, c.u.transpose(-1, -2)) + at::matmul(d_xw, c.w.transpose(-1, -2))).tril(-1);
    const at::Tensor d_a_decay = d_a * c.decay;  // dA ⊙ D
    const at::Tensor d_kk = c.beta.unsqueeze(-1) * d_a_decay;  // d(k kᵀ) through A

    const at::Tensor xw_dot = (d_xw * c.k).sum(-1);  // d(βΓ) per token
    at::Tensor d_q = c.gamma.unsqueeze(-1) * d_q_gamma + at::matmul(d_attn, c.k);
    at::Tensor d_k = at::matmul(d_attn.transpose(-1, -2), c.q) + c.to_end.unsqueeze(-1) * d_k_end +
                     (c.beta * c.gamma).unsqueeze(-1) * d_xw + at::matmul(d_kk + d_kk.transpose(-1, -2), c.k);
    const at::Tensor d_v = c.beta.unsqueeze(-1) * d_xu;
    const at::Tensor d_beta = (d_xu * c.v).sum(-1) + c.gamma * xw_dot + (d_a_decay * c.kk).sum(-1);

    // The decays' gradient, gathered on b (D and Γ are exponentials of differences and values of b):
    // db_i = Γ_i dΓ_i + Σ_j D_ij dD_ij − Σ_j D_ji dD_ji, then dg = the reverse cumsum of db.
    at::Tensor d_gamma = (d_q_gamma * c.q).sum(-1) + c.beta * xw_dot;
    d_gamma.select(-1, C - 1).add_(d_chunk_decay);
    at::Tensor d_decay_d = d_attn * c.qk + d_a_decay * c.beta.unsqueeze(-1) * c.kk;  // dD ⊙ D
    d_decay_d.select(-2, C - 1).add_((d_k_end * c.k).sum(-1) * c.to_end);
    const at::Tensor d_b = c.gamma * d_gamma + d_decay_d.sum(-1) - d_decay_d.sum(-2);
    at::Tensor d_g = reverse_cumsum(d_b);
    // A document start's g is unused: exactly zero rather than a sum that cancels to rounding.
    if (c.starts.defined()) d_g = d_g.masked_fill(c.starts, 0);

    // Back to the callers' layout: unscale q, sum the value heads of each key head, undo the L2 norm.
    const auto per_key_head = [&](at::Tensor x) {
      x = from_chunks(x, c.T);
      if (c.group == 1) return x;
      return x.unflatten(2, {x.size(2) / c.group, c.group}).sum(3);
    };
    at::Tensor dq = per_key_head(d_q) * s.scale, dk = per_key_head(d_k);
    if (s.l2norm) {
      dq = l2_normalise_backward(q.to(dq.scalar_type()), dq);
      dk = l2_normalise_backward(k.to(dk.scalar_type()), dk);
    }
    return {dq.to(q.scalar_type()),
            dk.to(k.scalar_type()),
            from_chunks(d_v, c.T).to(v.scalar_type()),
            gate_from_chunks(d_g, c.T).to(g.scalar_type()),
            gate_from_chunks(d_beta, c.T).to(beta.scalar_type()),
            h0 ? d_h0.to(h0->scalar_type()) : at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor()};
  }
};

}  // namespace

void set_delta_rule_kernels_enabled(bool on) { kernels_enabled = on; }
bool delta_rule_kernels_enabled() { return kernels_enabled; }

GatedDeltaRuleOutput gated_delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& g, const at::Tensor& beta, const at::Tensor& initial_state,
                                      const at::Tensor& segment_ids, const GatedDeltaRuleOptions& options) {
  EO_CHECK(q.dim() == 4 && k.sizes() == q.sizes(), "gated_delta_rule: q and k must be [B, T, Hk, dk] alike, got ",
           q.sizes(), " and ", k.sizes());
  const std::int64_t B = q.size(0), T = q.size(1), Hk = q.size(2), dk = q.size(3);
  EO_CHECK(v.dim() == 4 && v.size(0) == B && v.size(1) == T, "gated_delta_rule: v must be [B, T, Hv, dv] with q's B, T, got ",
           v.sizes());
  const std::int64_t Hv = v.size(2), dv = v.size(3);
  EO_CHECK(T > 0 && Hk > 0 && Hv % Hk == 0, "gated_delta_rule: value heads (", Hv,
           ") must be a multiple of key heads (", Hk, ") and T (", T, ") positive");
  EO_CHECK(g.sizes() == at::IntArrayRef({B, T, Hv}) && beta.sizes() == g.sizes(),
           "gated_delta_rule: g and beta must be [B, T, Hv] = [", B, ", ", T, ", ", Hv, "], got ", g.sizes(), " and ",
           beta.sizes());
  EO_CHECK(!initial_state.defined() || initial_state.sizes() == at::IntArrayRef({B, Hv, dk, dv}),
           "gated_delta_rule: initial_state must be [B, Hv, dk, dv] = [", B, ", ", Hv, ", ", dk, ", ", dv, "]");
  EO_CHECK(!segment_ids.defined() || segment_ids.sizes() == at::IntArrayRef({B, T}),
           "gated_delta_rule: segment_ids must be [B, T]");
  EO_CHECK(options.chunk_size > 0, "gated_delta_rule: chunk_size must be positive, got ", options.chunk_size);
  for (const at::Tensor* t : {&q, &k, &v, &g, &beta})
    EO_CHECK(at::isFloatingType(t->scalar_type()) && t->device() == q.device(),
             "gated_delta_rule: inputs must be floating point on one device");

  std::optional<at::Tensor> h0, starts;
  if (initial_state.defined()) h0 = initial_state;
  if (segment_ids.defined() && T > 1) {
    const at::Tensor changed = segment_ids.narrow(1, 1, T - 1) != segment_ids.narrow(1, 0, T - 1);
    starts = at::cat({at::zeros({B, 1}, changed.options()), changed}, 1);
  }
  const double scale = options.scale != 0 ? options.scale : 1.0 / std::sqrt(double(dk));
  const variable_list outs =
      GatedDeltaRuleFunction::apply(q, k, v, g, beta, h0, starts, options.chunk_size, options.l2norm_qk, scale);
  return {outs[0], outs[1]};
}

}  // namespace eo::model
