// The gated delta-rule layer of Qwen3-Next and Qwen3.5 (transformers 5.24's Qwen3NextGatedDeltaNet
// and Qwen3_5GatedDeltaNet): training's path with packed rows (the conv1d's window and the recurrent
// state restart at each document of a row, as fla's cu_seqlens kernels do), or decoding with a cache
// (models/kv_cache.h: the conv's last inputs and the state carried between forwards).
#include <ATen/ATen.h>

#include "models/delta_rule.h"
#include "models/kv_cache.h"
#include "models/moe_model.h"

namespace eo::model {
namespace {

// Document index of each token of a row (0, 0, 1, 1, 1, 2 ...): counts the id changes, so a
// document id that comes back later in the row is still a new document.
at::Tensor document_index(const at::Tensor& segment_ids) {
  const auto T = segment_ids.size(1);
  const at::Tensor starts = segment_ids.narrow(1, 1, T - 1) != segment_ids.narrow(1, 0, T - 1);
  return at::cat({at::zeros({segment_ids.size(0), 1}, segment_ids.options().dtype(at::kLong)), starts.to(at::kLong).cumsum(1)}, 1);
}

// transformers' causal_conv1d_fn (depthwise conv1d of K taps, K - 1 zeros of left padding, then
// SiLU) on x [B, T, C] with w [C, K]: out_t = Σ_j w[:, K-1-j] · x_{t-j}, each tap a shifted product
// so a tap that would reach into the previous document of a packed row reads zero instead.
at::Tensor causal_conv_silu(const at::Tensor& x, const at::Tensor& w, const at::Tensor& segment_ids) {
  const auto T = x.size(1), K = w.size(1);
  const at::Tensor wx = w.to(x.scalar_type());
  const at::Tensor doc = segment_ids.defined() && T > 1 ? document_index(segment_ids) : at::Tensor();
  at::Tensor y = x * wx.select(1, K - 1);
  for (std::int64_t j = 1; j < K && j < T; ++j) {
    at::Tensor tap = x.narrow(1, 0, T - j) * wx.select(1, K - 1 - j);  // x_{t-j} for t >= j
    if (doc.defined())
      tap = tap * (doc.narrow(1, j, T - j) == doc.narrow(1, 0, T - j)).unsqueeze(-1).to(x.scalar_type());
    y = y + at::constant_pad_nd(tap, {0, 0, j, 0});
  }
  return at::silu(y);
}

// Qwen3NextRMSNormGated: weight · RMSNorm(o) (fp32 statistics, rounded back first) · silu(z) in
// fp32, then the input dtype. o, z [..., dv].
at::Tensor gated_rms_norm(const at::Tensor& o, const at::Tensor& z, const at::Tensor& weight, double eps) {
  const at::Tensor of = o.to(at::kFloat);
  const at::Tensor normed = (of * at::rsqrt(of.pow(2).mean({-1}, true) + eps)).to(o.scalar_type());
  return ((weight * normed).to(at::kFloat) * at::silu(z.to(at::kFloat))).to(o.scalar_type());
}

}  // namespace

at::Tensor DecoderBlock::linear_attention(const at::Tensor& input, const BlockContext& ctx) const {
  const LinearAttention& a = *cfg_->linear_attn;
  const bool tr = ctx.training;
  const auto B = input.size(0), T = input.size(1);
  const std::int64_t Hk = a.k_heads, Hv = a.v_heads, dk = a.k_dim, dv = a.v_dim, per = Hv / Hk;
  const at::Tensor x = ctx.token_mask.defined() ? input * ctx.token_mask : input;
  at::Tensor mixed, z, b, g_in;
  if (a.split_projections) {  // Qwen3.5: [q; k; v], z, b, a each their own projection
    mixed = w_.in_qkvz.forward(x, tr);
    z = w_.in_z.forward(x, tr).view({B, T, Hv, dv});
    b = w_.in_ba.forward(x, tr);
    g_in = w_.in_a.forward(x, tr);
  } else {  // Qwen3-Next: fix_query_key_value_ordering, grouped per key head
    const at::Tensor qkvz = w_.in_qkvz.forward(x, tr).view({B, T, Hk, 2 * dk + 2 * per * dv});
    const at::Tensor ba = w_.in_ba.forward(x, tr).view({B, T, Hk, 2 * per});
    mixed = at::cat({qkvz.narrow(-1, 0, dk).reshape({B, T, Hk * dk}), qkvz.narrow(-1, dk, dk).reshape({B, T, Hk * dk}),
                     qkvz.narrow(-1, 2 * dk, per * dv).reshape({B, T, Hv * dv})},
                    -1);
    z = qkvz.narrow(-1, 2 * dk + per * dv, per * dv).reshape({B, T, Hv, dv});
    b = ba.narrow(-1, 0, per).reshape({B, T, Hv});
    g_in = ba.narrow(-1, per, per).reshape({B, T, Hv});
  }
  at::Tensor conv;
  if (ctx.cache) {  // decoding: the conv reads the cached last K - 1 inputs before these (zeros at first)
    const auto K = w_.conv_w.size(1);
    at::Tensor& held = ctx.cache->conv_state(w_.index);
    if (!held.defined()) held = at::zeros({B, K - 1, mixed.size(-1)}, mixed.options());
    const at::Tensor window = at::cat({held, mixed}, 1);
    conv = causal_conv_silu(window, w_.conv_w, at::Tensor()).narrow(1, K - 1, T);
    held = window.narrow(1, T, K - 1).contiguous();
  } else {
    conv = causal_conv_silu(mixed, w_.conv_w, ctx.segment_ids);
  }
  const at::Tensor q = conv.narrow(-1, 0, Hk * dk).view({B, T, Hk, dk});
  const at::Tensor k = conv.narrow(-1, Hk * dk, Hk * dk).view({B, T, Hk, dk});
  const at::Tensor v = conv.narrow(-1, 2 * Hk * dk, Hv * dv).view({B, T, Hv, dv});
  const at::Tensor beta = at::sigmoid(b);
  // In fp32 whatever the compute dtype (transformers: "A might be -inf" in fp16 otherwise).
  const at::Tensor g = -at::exp(w_.a_log.to(at::kFloat)) * at::softplus(g_in.to(at::kFloat) + w_.dt_bias.to(at::kFloat));
  GatedDeltaRuleOptions opt;
  opt.l2norm_qk = true;
  at::Tensor o;  // [B, T, Hv, dv]
  if (ctx.cache) {  // decoding: the recurrence goes on from the cached state
    at::Tensor& state = ctx.cache->recurrent_state(w_.index);
    GatedDeltaRuleOutput r = gated_delta_rule(q, k, v, g, beta, state, at::Tensor(), opt);
    o = r.out;
    state = r.final_state;
  } else {
    o = gated_delta_rule(q, k, v, g, beta, at::Tensor(), ctx.segment_ids, opt).out;
  }
  const at::Tensor normed = gated_rms_norm(o, z, w_.gated_norm, cfg_->rms_eps);
  return w_.o.forward(normed.reshape({B, T, Hv * dv}), tr);
}

}  // namespace eo::model
