// Decoder forward: attention (RoPE, GQA, q/k norms), router + token-sorted expert dispatch,
// dense / shared-expert MLPs, final head, loss and router aux loss. Semantics follow the
// transformers 5.x modeling files of each family (design.md §3.3).
#include "models/moe_model.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>
#include <tuple>

#include "common/error.h"
#include "models/attention_path.h"
#include "models/fused.h"
#include "models/kv_cache.h"
#include "models/linear4bit.h"
#include "models/lm_loss.h"
#include "models/merge_aware.h"

namespace eo::model {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  // On a GPU libtorch's fused kernel: one pass forward and one backward instead of the seven
  // elementwise passes below, with fp32 statistics; it multiplies by the weight before the one
  // rounding to x's dtype (transformers rounds, then multiplies), a difference within bf16 rounding.
  // An undefined weight: the norm without a scale (Gemma's v_norm and router norm).
  if (x.is_cuda())
    return std::get<0>(at::_fused_rms_norm(x, {x.size(-1)}, weight.defined() ? std::optional<at::Tensor>(weight) : std::nullopt, eps));
  // fp32 statistics, cast back, then × weight (HF order: the product is in the input dtype).
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor normed = xf * at::rsqrt(xf.pow(2).mean({-1}, true) + eps);
  return weight.defined() ? weight * normed.to(x.scalar_type()) : normed.to(x.scalar_type());
}

at::Tensor FrozenLinear::nvfp4_grid() const {
  if (q) return q->format == QuantFormat::Nvfp4 ? q->global_scale : at::Tensor();
  return nvfp4_global;
}

at::Tensor FrozenLinear::forward(const at::Tensor& x, bool training) const {
  if (lora && merge_aware && merge_aware->load(std::memory_order_relaxed)) {
    // axolotl's merge_aware_linear.py: the delta in the LoRA's dtype (fp32 masters), cast to the
    // weight's, scaled there; the GEMM on the snapped weight (dX through it), A and B through W_eff.
    const at::Tensor w = q ? eo::dequantize(*q, x.scalar_type()) : weight;
    const at::Tensor w_eff = w + at::matmul(lora->B(), lora->A()).to(w.scalar_type()) * lora->scaling();
    at::Tensor y = at::linear(x, snap_nvfp4_ste(w_eff, nvfp4_grid()).to(x.scalar_type()));
    if (bias.defined()) y = y + bias;
    if (training && lora->dropout() > 0) {
      // Dropout acts on the low-rank branch only: its residual scaling · (dropout(x) - x) A^T B^T
      // is zero-mean and gone at eval, so the snapped term alone is what the merge keeps.
      const at::Tensor r = (at::dropout(x, lora->dropout(), true) - x).to(lora->A().scalar_type());
      y = y + (at::linear(at::linear(r, lora->A()), lora->B()) * lora->scaling()).to(y.scalar_type());
    }
    return y;
  }
  at::Tensor y = q ? linear4bit(x, WeightHandle{nullptr, -1, -1, ExpertMatrix::Gate, q.get()}) : at::linear(x, weight);
  if (bias.defined()) y = y + bias;
  if (lora) y = lora->add_to(y, x, training);
  return y;
}

at::Tensor gated_activation(const at::Tensor& gate, const at::Tensor& up, Activation act) {
  // transformers' gelu_pytorch_tanh is torch's gelu with approximate="tanh".
  return act == Activation::GeluTanh ? at::gelu(gate, "tanh") * up : swiglu(gate, up);
}

at::Tensor Mlp::forward(const at::Tensor& x, bool training) const {
  return down.forward(gated_activation(gate.forward(x, training), up.forward(x, training), act), training);
}

namespace {

at::Tensor rotate_half(const at::Tensor& x) {
  const auto half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

// RoPE on the first rope.dim channels of x [B, heads, T, D] (partial rotary: the rest pass
// through), in ATen ops: the interleaved and latent-attention paths. DeepSeek rotates interleaved
// pairs (x0, x1), (x2, x3), ...: gathering the evens then the odds turns that into the half-split
// rotation, which is transformers' interleaved formula (its output is in that gathered order too;
// q and k share it, so q·k is unchanged). The half-split layouts of [B, T, heads, D] projections
// take the fused kernel instead (models/fused.h, rope()).
at::Tensor apply_rope(const at::Tensor& x, const BlockContext& ctx, const Rope& rope) {
  const auto D = x.size(-1), R = rope.dim;
  at::Tensor r = R == D ? x : x.narrow(-1, 0, R);
  if (rope.interleaved) r = r.unflatten(-1, {R / 2, 2}).transpose(-1, -2).flatten(-2);
  r = r * ctx.cos.unsqueeze(1) + rotate_half(r) * ctx.sin.unsqueeze(1);  // tables [B, T, R] -> [B, 1, T, R]
  return R == D ? r : at::cat({r, x.narrow(-1, R, D - R)}, -1);
}

// Whether layer `layer` attends through flash's variable-length form for this context: packed rows'
// documents were given (MoeModel::context, where it runs) and the layer's path is Varlen.
bool takes_varlen(const ModelConfig& c, int layer, const BlockContext& ctx, std::int64_t T) {
  return ctx.document_starts.defined() && attention_path(c, layer, T, /*packed=*/true) == AttentionPath::Varlen;
}

// The window a sliding layer hands to flash (its local window), or 0: the layer slides, has no
// sinks, the context lets flash take windows and nothing is cached (keys beyond the queries).
std::int64_t flash_window(const ModelConfig& c, int layer, const BlockContext& ctx) {
  const bool takes = c.is_sliding_layer(layer) && !c.attention_sinks && ctx.flash_windows && ctx.cache == nullptr &&
                     c.head_dim_at(layer) <= 256;
  return takes ? c.sliding_window : 0;
}

// Softmax attention of q [B, h, T, Dq] over k [B, hk, T, Dq], v [B, hk, T, Dv] → [B, T, h·Dv].
// GQA: query head i reads kv head i / (h / hk). Plain causal attention passes the grouping to the
// fused kernel (flash attention on a GPU); with a packing mask the kv heads are repeated, which
// the memory-efficient kernel accepts together with a mask. `varlen` (the layer's path is Varlen,
// models/attention_path.h): packed rows' documents each causal on their own through flash's
// variable-length form, over the B·T tokens as one sequence of documents (GQA native, no mask).
// `window` > 0 (flash_window): flash's local window, a query at i seeing keys i - window < j <= i
// (transformers' sliding_window_overlay), in either form.
at::Tensor attend(const at::Tensor& q, at::Tensor k, at::Tensor v, const BlockContext& ctx, double scale,
                  bool varlen = false, std::int64_t window = 0) {
  const auto B = q.size(0), T = q.size(2), h = q.size(1), hk = k.size(1);
  const std::optional<std::int64_t> left = window > 0 ? std::optional<std::int64_t>(window - 1) : std::nullopt;
  const std::optional<std::int64_t> right = window > 0 ? std::optional<std::int64_t>(0) : std::nullopt;
  if (varlen) {
    auto tokens = [&](const at::Tensor& t) { return t.transpose(1, 2).reshape({B * T, t.size(1), t.size(3)}); };
    // max_q = max_k = T: an upper bound (the grid's extent), the same every step for CUDA graphs.
    const at::Tensor o = std::get<0>(at::_flash_attention_forward(tokens(q), tokens(k), tokens(v), ctx.document_starts,
                                                                  ctx.document_starts, T, T, 0.0, true, false, scale, left, right));
    return o.view({B, T, h * v.size(-1)});
  }
  if (window > 0) {  // flash's dense form: [B, T, heads, D], GQA native
    const at::Tensor o = std::get<0>(at::_flash_attention_forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                                  std::nullopt, std::nullopt, T, T, 0.0, true, false, scale,
                                                                  left, right));
    return o.reshape({B, T, h * v.size(-1)});
  }
  const bool gqa = hk != h;
  // Heads wider than flash's 256 (Gemma 4's full layers) on a GPU: the memory-efficient kernel takes
  // them but not grouped kv heads; with enable_gqa PyTorch would give them the math path (fp32 GEMMs
  // off the tensor cores, the [T, T] scores written out), so the kv heads are repeated as for a mask.
  const bool wide = q.is_cuda() && q.size(-1) > 256;
  if (gqa && (ctx.attn_mask.defined() || wide)) {
    k = k.repeat_interleave(h / hk, 1);
    v = v.repeat_interleave(h / hk, 1);
  }
  const std::optional<at::Tensor> mask = ctx.attn_mask.defined() ? std::optional<at::Tensor>(ctx.attn_mask) : std::nullopt;
  const at::Tensor o = at::scaled_dot_product_attention(q, k, v, mask, 0.0, !mask.has_value(), scale,
                                                        gqa && !mask.has_value() && !wide);
  return o.transpose(1, 2).reshape({B, T, h * v.size(-1)});
}

// gpt-oss attention: a sliding window on some layers and a sink logit per head. The sink joins
// the softmax as one more key whose score is exactly the sink: q gets an extra channel of 1, that
// key holds sink / scale there (zeros elsewhere, value 0), every real key 0 there. So the fused
// SDPA kernels run it (with a mask); the channel count is padded to a multiple of 8 for them.
at::Tensor attend_with_sinks(const at::Tensor& q, at::Tensor k, at::Tensor v, const BlockContext& ctx, double scale,
                             const at::Tensor& sinks, std::int64_t window) {
  // Tk > T with a kv cache: the queries are the last T of Tk positions.
  const auto B = q.size(0), h = q.size(1), T = q.size(2), D = q.size(3), hk = k.size(1), Tk = k.size(2);
  const auto opt = at::TensorOptions().dtype(at::kBool).device(q.device());
  at::Tensor mask = ctx.attn_mask.defined() ? ctx.attn_mask : at::ones({T, Tk}, opt).tril(Tk - T).view({1, 1, T, Tk});
  if (window > 0) {  // transformers' sliding_window_overlay: key j is seen from query i when j > i - window
    const at::Tensor i = at::arange(Tk - T, Tk, opt.dtype(at::kLong)).view({T, 1}), j = at::arange(Tk, opt.dtype(at::kLong)).view({1, Tk});
    mask = mask & (j > i - window).view({1, 1, T, Tk});
  }
  if (!sinks.defined()) {
    BlockContext masked;
    masked.cos = ctx.cos;
    masked.sin = ctx.sin;
    masked.attn_mask = mask;
    masked.training = ctx.training;
    return attend(q, k, v, masked, scale);
  }
  if (hk != h) {  // each query head has its own sink key
    k = k.repeat_interleave(h / hk, 1);
    v = v.repeat_interleave(h / hk, 1);
  }
  const auto pad = (D + 1 + 7) / 8 * 8 - D;  // the extra channel and alignment
  const auto o = q.options();
  const at::Tensor q_aug = at::cat({q, at::ones({B, h, T, 1}, o), at::zeros({B, h, T, pad - 1}, o)}, -1);
  const at::Tensor sink_key = at::cat({at::zeros({B, h, 1, D}, o), (sinks.to(q.scalar_type()) / scale).view({1, h, 1, 1}).expand({B, h, 1, 1}),
                                       at::zeros({B, h, 1, pad - 1}, o)}, -1);
  const at::Tensor k_aug = at::cat({sink_key, at::cat({k, at::zeros({B, h, Tk, pad}, o)}, -1)}, 2);
  const at::Tensor v_aug = at::cat({at::zeros({B, h, 1, v.size(3)}, o), v}, 2);
  const at::Tensor mask_aug = at::cat({at::ones({mask.size(0), 1, T, 1}, opt), mask.expand({mask.size(0), 1, T, Tk})}, -1);
  const at::Tensor out = at::scaled_dot_product_attention(q_aug, k_aug, v_aug, mask_aug, 0.0, false, scale, false);
  return out.transpose(1, 2).reshape({B, T, h * v.size(-1)});
}

// DeepSeek's q_a_layernorm / kv_a_layernorm are built with RMSNorm's default eps, not rms_norm_eps.
constexpr double kLatentNormEps = 1e-6;

}  // namespace

at::Tensor DecoderBlock::attention(const at::Tensor& x, const BlockContext& ctx) const {
  const ModelConfig& c = *cfg_;
  if (c.mla) return latent_attention(x, ctx);
  if (c.is_linear_attention_layer(w_.index)) return linear_attention(x, ctx);
  const auto B = x.size(0), T = x.size(1);
  const std::int64_t D = c.head_dim_at(w_.index), KV = c.kv_heads_at(w_.index);
  const bool varlen = takes_varlen(c, w_.index, ctx, T);
  at::Tensor q = w_.q.forward(x, ctx.training), k = w_.k.forward(x, ctx.training);
  at::Tensor gate;  // attn_output_gate: each head's [query | gate] (Qwen3NextAttention)
  if (c.attn_output_gate) {
    const at::Tensor qg = q.view({B, T, c.heads, 2 * D});
    gate = qg.narrow(-1, D, D).reshape({B, T, c.heads * D});
    q = qg.narrow(-1, 0, D).contiguous();
  }
  // Gemma 4's full layers with attention_k_eq_v: the values are k_proj's output (before k_norm).
  at::Tensor v = c.has_v_proj(w_.index) ? w_.v.forward(x, ctx.training) : k;
  if (c.qk_norm == QkNorm::Whole) {  // olmoe: over the whole projection, before the split
    q = rms_norm(q, w_.q_norm, c.rms_eps);
    k = rms_norm(k, w_.k_norm, c.rms_eps);
  }
  if (c.clip_qkv) {
    q = q.clamp(-*c.clip_qkv, *c.clip_qkv);
    k = k.clamp(-*c.clip_qkv, *c.clip_qkv);
    v = v.clamp(-*c.clip_qkv, *c.clip_qkv);
  }
  q = q.view({B, T, c.heads, D});
  k = k.view({B, T, KV, D});
  v = v.view({B, T, KV, D});
  if (c.qk_norm == QkNorm::PerHead && !c.qk_norm_after_rope) {  // qwen3, glm4_moe use_qk_norm, gemma4: per head, after the view
    q = rms_norm(q, w_.q_norm, c.rms_eps);
    k = rms_norm(k, w_.k_norm, c.rms_eps);
  }
  if (c.llama4) {  // Llama4TextAttention: RoPE or NoPE, then the L2 norm or the temperature
    const bool rope_layer = c.uses_rope(w_.index);
    q = rope_layer ? apply_rope(q.transpose(1, 2), ctx, c.rope) : q.transpose(1, 2);
    k = rope_layer ? apply_rope(k.transpose(1, 2), ctx, c.rope) : k.transpose(1, 2);
    if (c.qk_norm == QkNorm::L2 && rope_layer) {
      q = rms_norm(q, at::Tensor(), c.rms_eps);
      k = rms_norm(k, at::Tensor(), c.rms_eps);
    }
    // The fp32 scale times q, rounded back to q's dtype, as transformers' promotion does.
    if (!rope_layer && ctx.q_scale.defined()) q = (q * ctx.q_scale).to(q.scalar_type());
    at::Tensor vt = v.transpose(1, 2);
    cache_keys_values(ctx, w_.index, k, vt);
    if (!c.is_chunked_layer(w_.index) || !ctx.chunk_mask.defined())
      return w_.o.forward(attend(q, k, vt, ctx, c.attn_scale, varlen), ctx.training);
    BlockContext chunked = ctx;
    chunked.attn_mask = ctx.chunk_mask;
    return w_.o.forward(attend(q, k, vt, chunked, c.attn_scale), ctx.training);
  }
  if (c.gemma) {
    v = rms_norm(v, at::Tensor(), c.rms_eps);  // v_norm: no scale
    // This layer type's RoPE table: the sliding layers' first, then the full layers' (context()).
    const bool full = c.is_full_gemma_layer(w_.index);
    const std::int64_t off = full ? c.rope.dim : 0, R = full ? c.gemma->full_rope.dim : c.rope.dim;
    q = rope(q, ctx.cos.narrow(-1, off, R), ctx.sin.narrow(-1, off, R)).transpose(1, 2);
    k = rope(k, ctx.cos.narrow(-1, off, R), ctx.sin.narrow(-1, off, R)).transpose(1, 2);
  } else if (c.rope.interleaved) {
    q = apply_rope(q.transpose(1, 2), ctx, c.rope);
    k = apply_rope(k.transpose(1, 2), ctx, c.rope);
  } else {  // the fused kernel on the projection's own layout, then [B, heads, T, D] views for SDPA
    q = rope(q, ctx.cos, ctx.sin).transpose(1, 2);
    k = rope(k, ctx.cos, ctx.sin).transpose(1, 2);
  }
  if (c.qk_norm_after_rope) {  // Hunyuan: per head, on the rotated q and k
    q = rms_norm(q, w_.q_norm, c.rms_eps);
    k = rms_norm(k, w_.k_norm, c.rms_eps);
  }
  at::Tensor vt = v.transpose(1, 2);
  cache_keys_values(ctx, w_.index, k, vt);
  const std::int64_t window = c.is_sliding_layer(w_.index) ? c.sliding_window : 0, flash = flash_window(c, w_.index, ctx);
  if (c.attention_sinks || (window > 0 && flash == 0))
    return w_.o.forward(attend_with_sinks(q, k, vt, ctx, c.attn_scale, w_.sinks, window), ctx.training);
  const at::Tensor o = attend(q, k, vt, ctx, c.attn_scale, varlen, flash);
  return w_.o.forward(gate.defined() ? o * at::sigmoid(gate) : o, ctx.training);
}

// Multi-head latent attention (modeling_deepseek_v3.py DeepseekV3Attention): each head's query
// and key are [nope | rope]; the keys' nope part and the values come from one kv latent per
// token through kv_b_proj, the keys' rope part is one head shared by all heads.
at::Tensor DecoderBlock::latent_attention(const at::Tensor& x, const BlockContext& ctx) const {
  const ModelConfig& c = *cfg_;
  const Mla& a = *c.mla;
  const auto B = x.size(0), T = x.size(1), H = c.heads;
  const bool tr = ctx.training;
  const at::Tensor q_in = a.q_lora_rank > 0 ? rms_norm(w_.q_a.forward(x, tr), w_.q_a_norm, kLatentNormEps) : x;
  const at::Tensor q = w_.q.forward(q_in, tr).view({B, T, H, a.qk_dim()}).transpose(1, 2);
  const at::Tensor kv_a = w_.kv_a.forward(x, tr);  // [B, T, kv_lora_rank + rope]
  const at::Tensor latent = rms_norm(kv_a.narrow(-1, 0, a.kv_lora_rank), w_.kv_a_norm, kLatentNormEps);
  const at::Tensor k_rot = apply_rope(kv_a.narrow(-1, a.kv_lora_rank, a.rope_dim).unsqueeze(1), ctx, c.rope);  // [B, 1, T, R]
  at::Tensor q_full = at::cat({q.narrow(-1, 0, a.nope_dim), apply_rope(q.narrow(-1, a.nope_dim, a.rope_dim), ctx, c.rope)}, -1);
  if (ctx.q_scale.defined()) q_full = q_full * ctx.q_scale;  // Mistral 4, after RoPE as Mistral4Attention
  const at::Tensor kv = w_.kv_b.forward(latent, tr).view({B, T, H, a.nope_dim + a.v_dim}).transpose(1, 2);
  at::Tensor k = at::cat({kv.narrow(-1, 0, a.nope_dim), k_rot.expand({B, H, T, a.rope_dim})}, -1);
  at::Tensor v = kv.narrow(-1, a.nope_dim, a.v_dim);
  cache_keys_values(ctx, w_.index, k, v);
  return w_.o.forward(attend(q_full, k, v, ctx, c.attn_scale, takes_varlen(c, w_.index, ctx, T)), tr);
}

namespace {

// gpt-oss's clamped activation (GptOssExperts._apply_gate).
at::Tensor clamped_swiglu(const at::Tensor& gate, const at::Tensor& up, const SwigluClamp& s) {
  const at::Tensor g = gate.clamp_max(s.limit);
  return (up.clamp(-s.limit, s.limit) + 1) * (g * at::sigmoid(g * s.alpha));
}

}  // namespace

at::Tensor DecoderBlock::expert(int e, const at::Tensor& x, bool training, const ExpertLoraSlices& lora) const {
  auto linear = [&](ExpertMatrix m, const at::Tensor& in) {
    const int mi = static_cast<int>(m);
    at::Tensor y = w_.quantized ? linear4bit(in, WeightHandle{provider_, w_.index, e, m, nullptr}) : at::linear(in, w_.experts[mi][e]);
    if (w_.expert_bias[mi].defined()) y = y + w_.expert_bias[mi][e];
    if (const auto& l = w_.expert_lora[mi]) y = l->add_to(lora[mi], e, y, in, training);
    return y;
  };
  at::Tensor gate = linear(ExpertMatrix::Gate, x), up = linear(ExpertMatrix::Up, x);
  if (w_.gate_up_lora) {
    // The fused [gate; up] output takes one LoRA delta (shared A), then splits as transformers'
    // gate_up_proj(...).chunk(2) does.
    const auto I = gate.size(-1);
    const at::Tensor gu = w_.gate_up_lora->add_to(lora[3], e, at::cat({gate, up}, -1), x, training);
    gate = gu.narrow(-1, 0, I);
    up = gu.narrow(-1, I, I);
  }
  return linear(ExpertMatrix::Down, cfg_->swiglu_clamp ? clamped_swiglu(gate, up, *cfg_->swiglu_clamp)
                                                       : gated_activation(gate, up, cfg_->act));
}

bool DecoderBlock::merge_aware_now() const { return merge_aware_ && merge_aware_->load(std::memory_order_relaxed); }

at::Tensor DecoderBlock::experts_merge_aware(const at::Tensor& x_sorted, const at::Tensor& expert_of, bool training) const {
  const ModelConfig& c = *cfg_;
  const auto E = c.experts;
  const at::ScalarType dt = x_sorted.scalar_type();
  EO_CHECK(provider_->expert_group_size() == 0, "nvfp4_merge_aware reads a block's experts whole: not with expert groups");
  // Each matrix's bank [E, out, in] in the compute dtype and its per-expert global scales [E].
  auto bank = [&](ExpertMatrix m) {
    std::vector<const QuantizedWeight*> qs;
    std::vector<at::Tensor> globals;
    for (int e = 0; e < E; ++e) {
      qs.push_back(&provider_->expert_weight(w_.index, e, m));
      globals.push_back(qs.back()->global_scale.reshape({1}));
    }
    return std::make_pair(eo::dequantize_stack(qs, dt), at::cat(globals).to(x_sorted.device()));
  };
  // axolotl's _merge_aware_wfq: A and B cast to the weight's dtype, the scaling folded into A,
  // W + bmm(B, A · scaling), then Q on the base's per-expert global scales.
  auto delta = [&](const ExpertLora& l) { return l.delta_weight(dt); };
  auto [gate, g_gate] = bank(ExpertMatrix::Gate);
  auto [up, g_up] = bank(ExpertMatrix::Up);
  auto [down, g_down] = bank(ExpertMatrix::Down);
  const auto I = gate.size(1);
  if (w_.gate_up_lora) {
    // The fused [gate; up] as transformers 5 and axolotl hold it, on one grid per expert: the
    // larger global scale of the two (axolotl's fuse_nvfp4_experts, "base_fused_max"). Blocks
    // run along the input dim, so they never straddle gate and up.
    const at::Tensor w = snap_nvfp4_ste(at::cat({gate, up}, 1) + delta(*w_.gate_up_lora), at::maximum(g_gate, g_up));
    gate = w.narrow(1, 0, I);
    up = w.narrow(1, I, I);
  }
  if (const auto& l = w_.expert_lora[static_cast<int>(ExpertMatrix::Gate)]) gate = snap_nvfp4_ste(gate + delta(*l), g_gate);
  if (const auto& l = w_.expert_lora[static_cast<int>(ExpertMatrix::Up)]) up = snap_nvfp4_ste(up + delta(*l), g_up);
  if (const auto& l = w_.expert_lora[static_cast<int>(ExpertMatrix::Down)]) down = snap_nvfp4_ste(down + delta(*l), g_down);
  (void)training;  // no dropout: peft's ParamWrapper refuses it, and per-expert dropout is refused with merge-aware
  // unbind: one autograd node whose backward stacks the experts' gradients (not E full-size ones).
  const std::vector<at::Tensor> wg = gate.unbind(0), wu = up.unbind(0), wd = down.unbind(0);
  const at::Tensor host_counts = at::zeros({E}, expert_of.options()).scatter_add(0, expert_of, at::ones_like(expert_of)).to(at::kCPU);
  const auto* count = host_counts.data_ptr<std::int64_t>();
  std::vector<at::Tensor> outs;
  std::int64_t offset = 0;
  for (int e = 0; e < E; ++e) {
    if (count[e] == 0) continue;
    const at::Tensor xe = x_sorted.narrow(0, offset, count[e]);
    offset += count[e];
    auto with_bias = [&](at::Tensor y, ExpertMatrix m) {
      const auto& b = w_.expert_bias[static_cast<int>(m)];
      return b.defined() ? y + b[e] : y;
    };
    const at::Tensor g = with_bias(at::linear(xe, wg[e]), ExpertMatrix::Gate), u = with_bias(at::linear(xe, wu[e]), ExpertMatrix::Up);
    const at::Tensor a = c.swiglu_clamp ? clamped_swiglu(g, u, *c.swiglu_clamp) : gated_activation(g, u, c.act);
    outs.push_back(with_bias(at::linear(a, wd[e]), ExpertMatrix::Down));
  }
  return at::cat(outs, 0);
}

bool DecoderBlock::expert_lora_grouped_ok() const {
  for (const auto& l : w_.expert_lora)
    if (l && !l->grouped_ok()) return false;
  return !w_.gate_up_lora || w_.gate_up_lora->grouped_ok();
}

bool MoeModel::expert_lora_grouped_ok() const {
  for (const auto& b : blocks_)
    if (!b->expert_lora_grouped_ok()) return false;
  return true;
}

DecoderBlock::ExpertsOutput DecoderBlock::experts_forward(const at::Tensor& x_sorted, const at::Tensor& x_lora,
                                                          const at::Tensor& expert_of, bool training) const {
  const ModelConfig& c = *cfg_;
  // Per-expert row counts, on the device: scatter_add (bincount would read its max on the host).
  if (merge_aware_now()) return {experts_merge_aware(x_sorted, expert_of, training), at::Tensor()};
  const at::Tensor counts = at::zeros({c.experts}, expert_of.options()).scatter_add(0, expert_of, at::ones_like(expert_of));
  if (grouped_gemm_available(x_sorted) && expert_lora_grouped_ok()) {
    // GPU: one grouped GEMM per matrix over all experts, and the expert LoRA as two more over
    // the same rows and offsets; offsets stay on the device, so the block runs without a host
    // synchronisation.
    const at::Tensor offsets = counts.cumsum(0).to(at::kInt);
    // Expert biases (gpt-oss): each sorted row's expert, from the device counts (no host sync).
    const at::Tensor row_expert =
        c.expert_bias ? at::repeat_interleave(at::arange(c.experts, counts.options()), counts, 0, x_sorted.size(0)) : at::Tensor();
    // A block streamed in groups (the provider's expert_group_size) runs its base GEMMs group by
    // group: experts [first, first + n) on their rows, with offsets local to those rows. A kept
    // bank would keep every group's, so none is kept then.
    const int group = w_.quantized && provider_ ? provider_->expert_group_size() : 0;
    auto linear_on = [&](ExpertMatrix m, const at::Tensor& in, int first, int n, const at::Tensor& offs, const at::Tensor& rows_expert) {
      ExpertBank b;
      b.layer = w_.index;
      b.first = first;
      b.experts = n;
      b.matrix = m;
      if (w_.quantized) {
        b.provider = provider_;
        b.max_bytes = w_.bank_bytes;
        b.keep_for_backward = group == 0 && at::GradMode::is_enabled() &&
                              (bank_reuse_ == BankReuse::All || (bank_reuse_ == BankReuse::Down && m == ExpertMatrix::Down));
      } else {
        b.dense = w_.experts[static_cast<int>(m)];
      }
      at::Tensor y = grouped_expert_linear(in, offs, b);
      if (const auto& bias = w_.expert_bias[static_cast<int>(m)]; bias.defined()) y = y + bias.index_select(0, rows_expert);
      return y;
    };
    auto linear = [&](ExpertMatrix m, const at::Tensor& in) {
      return linear_on(m, in, 0, static_cast<int>(c.experts), offsets, row_expert);
    };
    const auto& gate_lora = w_.expert_lora[static_cast<int>(ExpertMatrix::Gate)];
    const auto& up_lora = w_.expert_lora[static_cast<int>(ExpertMatrix::Up)];
    const auto& down_lora = w_.expert_lora[static_cast<int>(ExpertMatrix::Down)];
    const bool by_group = group > 0 && group < c.experts;
    at::Tensor gate, up;
    if (!by_group) {
      gate = linear(ExpertMatrix::Gate, x_sorted);
      up = linear(ExpertMatrix::Up, x_sorted);
    }
    // The LoRA deltas are added where the sums are read: in the SwiGLU kernel for gate and up,
    // in the combine for down (no [N, I] or [N, H] sum is written, no scaling pass). They read no
    // expert weight, so a block streamed in groups forms them over all rows at once too.
    at::Tensor gate_delta, up_delta;
    if (gate_lora && up_lora && gate_lora->can_pair_with(*up_lora, training)) {
      // Gate's and up's A over the same rows as one GEMM (x read once, one dX and one dA in backward).
      std::tie(gate_delta, up_delta) = ExpertLora::delta_grouped_pair(*gate_lora, *up_lora, x_lora, offsets, training);
    } else {
      if (gate_lora) gate_delta = gate_lora->delta_grouped(x_lora, offsets, training);
      if (up_lora) up_delta = up_lora->delta_grouped(x_lora, offsets, training);
    }
    if (w_.gate_up_lora) {  // the fused [gate; up]'s delta as its two halves
      const auto [gd, ud] = w_.gate_up_lora->delta_grouped_halves(x_lora, offsets, training);
      gate_delta = gate_delta.defined() ? gate_delta + gd : gd;
      up_delta = up_delta.defined() ? up_delta + ud : ud;
    }
    // act_lora: act again for the down LoRA, whose gradient the SwiGLU backward sums in its kernel.
    auto activation = [&](const at::Tensor& g, const at::Tensor& u, const at::Tensor& gd, const at::Tensor& ud) {
      if (c.swiglu_clamp) {  // gpt-oss: its clamps read the sums, so they are formed
        const at::Tensor a = clamped_swiglu(gd.defined() ? g + gd : g, ud.defined() ? u + ud : u, *c.swiglu_clamp);
        return std::make_pair(a, a);
      }
      if (c.act != Activation::Silu) {  // Gemma's GELU: ATen ops on the formed sums
        const at::Tensor a = gated_activation(gd.defined() ? g + gd : g, ud.defined() ? u + ud : u, c.act);
        return std::make_pair(a, a);
      }
      return swiglu_twice(g, u, gd, ud);
    };
    ExpertsOutput out;
    at::Tensor act_lora;
    if (!by_group) {
      at::Tensor act;
      std::tie(act, act_lora) = activation(gate, up, gate_delta, up_delta);
      out.y = linear(ExpertMatrix::Down, act);
    } else {
      // Group by group (gate, up, activation, down of one group, then the next), so each group's
      // bytes are read in one stint; the rows are split by the routing counts, read on the host.
      // Row-wise the outputs are the whole-block path's, concatenated in the same order.
      const at::Tensor host_counts = counts.to(at::kCPU);
      const auto* count = host_counts.data_ptr<std::int64_t>();
      std::vector<std::int64_t> rows;
      for (std::int64_t first = 0; first < c.experts; first += group)
        rows.push_back(std::accumulate(count + first, count + std::min<std::int64_t>(c.experts, first + group), std::int64_t(0)));
      auto split = [&](const at::Tensor& t) { return t.defined() ? t.split_with_sizes(rows) : std::vector<at::Tensor>(rows.size()); };
      const auto xs = split(x_sorted), gds = split(gate_delta), uds = split(up_delta), res = split(row_expert);
      std::vector<at::Tensor> ys, acts_lora;
      std::int64_t r0 = 0;
      for (std::size_t g = 0; g < rows.size(); ++g) {
        if (rows[g] == 0) continue;  // no row routed here: the group is not read
        const int first = static_cast<int>(g) * group, n = static_cast<int>(std::min<std::int64_t>(group, c.experts - first));
        const at::Tensor offs = offsets.narrow(0, first, n) - r0;  // the group's rows from 0
        const at::Tensor gg = linear_on(ExpertMatrix::Gate, xs[g], first, n, offs, res[g]);
        const at::Tensor ug = linear_on(ExpertMatrix::Up, xs[g], first, n, offs, res[g]);
        const auto [a, al] = activation(gg, ug, gds[g], uds[g]);
        ys.push_back(linear_on(ExpertMatrix::Down, a, first, n, offs, res[g]));
        acts_lora.push_back(al);
        r0 += rows[g];
      }
      out.y = at::cat(ys, 0);
      if (down_lora) act_lora = at::cat(acts_lora, 0);
    }
    if (down_lora) out.delta = down_lora->delta_grouped(act_lora, offsets, training);
    return out;
  }
  // CPU (and on a GPU: fp32, fp16 without the portable kernel, or r not a multiple of 8): each
  // routed expert once on its slice; the counts are read on the host. The stacked LoRA is cut into
  // per-expert views once.
  const at::Tensor host_counts = counts.to(at::kCPU);
  const auto* count = host_counts.data_ptr<std::int64_t>();
  ExpertLoraSlices lora;
  for (int mi = 0; mi < 3; ++mi)
    if (w_.expert_lora[mi]) lora[mi] = w_.expert_lora[mi]->slices();
  if (w_.gate_up_lora) lora[3] = w_.gate_up_lora->slices();
  std::vector<at::Tensor> outs;
  std::int64_t offset = 0;
  for (int e = 0; e < c.experts; ++e) {
    if (count[e] == 0) continue;
    outs.push_back(expert(e, x_sorted.narrow(0, offset, count[e]), training, lora));
    offset += count[e];
  }
  return {at::cat(outs, 0), at::Tensor()};
}

std::pair<at::Tensor, at::Tensor> DecoderBlock::route(const at::Tensor& flat, const BlockContext& ctx) const {
  const ModelConfig& c = *cfg_;
  const Router& r = c.router;
  const auto N = flat.size(0), E = c.experts;
  // The router's weight is in the compute dtype, or fp32 where the loader keeps it in fp32 (the
  // families that do, and fp16 compute); its input follows it, and the scores are fp32.
  const bool fp32_router = w_.router.scalar_type() == at::kFloat;
  if (c.gemma) {
    // Gemma4TextRouter: a scale-free RMSNorm, x scale x hidden^-1/2, softmax (fp32), top-k
    // renormalised, x per_expert_scale of each chosen expert.
    const at::Tensor in = rms_norm(flat, at::Tensor(), c.rms_eps) * w_.router_scale * std::pow(static_cast<double>(c.hidden), -0.5);
    const at::Tensor logits = at::linear(fp32_router ? in.to(at::kFloat) : in, w_.router);
    if (ctx.router_logits) ctx.router_logits->push_back(logits);
    auto [top_w, top_idx] = at::topk(at::softmax(logits, -1, at::kFloat), c.top_k, -1);
    top_w = top_w / top_w.sum(-1, true);
    return {top_w * w_.per_expert_scale.index_select(0, top_idx.reshape({-1})).view_as(top_idx), top_idx};
  }
  const at::Tensor logits = at::linear(fp32_router ? flat.to(at::kFloat) : flat, w_.router, w_.router_b);
  if (ctx.router_logits) ctx.router_logits->push_back(logits);
  if (r.score == RouterScore::SoftmaxTopK) {  // gpt-oss: the softmax runs over the k chosen logits only
    auto [top_logits, idx] = at::topk(logits, c.top_k, -1);
    return {at::softmax(top_logits, -1, at::kFloat), idx};
  }
  const at::Tensor scores =
      r.score == RouterScore::Sigmoid ? at::sigmoid(logits.to(at::kFloat)) : at::softmax(logits, -1, at::kFloat);
  // The choice: scores plus the correction bias (choice only), limited to the best groups.
  at::Tensor choice = r.correction_bias ? scores + w_.router_bias : scores;
  if (r.group != GroupScore::None) {
    const auto G = r.n_group;
    const at::Tensor grouped = choice.view({N, G, E / G});
    const at::Tensor group_score = r.group == GroupScore::Max ? std::get<0>(grouped.max(-1))
                                                              : std::get<0>(grouped.topk(2, -1)).sum(-1);
    const at::Tensor best = std::get<1>(group_score.topk(r.topk_group, -1));
    const at::Tensor keep = at::zeros({N, G}, flat.options().dtype(at::kBool))
                                .scatter(1, best, true).unsqueeze(-1).expand({N, G, E / G}).reshape({N, E});
    // The values transformers fills in: -inf for the sigmoid choice, 0 for DeepSeek-V2's softmax.
    choice = choice.masked_fill(~keep, r.score == RouterScore::Sigmoid ? -INFINITY : 0.0);
  }
  auto [top_w, top_idx] = at::topk(choice, c.top_k, -1);
  if (r.correction_bias) top_w = scores.gather(1, top_idx);  // the weights come from the unbiased scores
  // (+1e-20 as in transformers' sigmoid routers; it cannot change a softmax top-k sum, >= k/E.)
  if (c.norm_topk_prob) top_w = top_w / (top_w.sum(-1, true) + 1e-20);
  if (r.scaling != 1.0) top_w = top_w * r.scaling;
  return {top_w, top_idx};
}

at::Tensor DecoderBlock::moe(const at::Tensor& x, const BlockContext& ctx, const at::Tensor& router_in) const {
  const ModelConfig& c = *cfg_;
  const auto H = x.size(-1);
  const at::Tensor flat = x.reshape({-1, H});
  const auto N = flat.size(0);

  auto [top_w, top_idx] = route(router_in.defined() ? router_in.reshape({-1, H}) : flat, ctx);
  top_w = top_w.to(x.scalar_type());

  // Token-sorted dispatch: order the (token, slot) pairs by expert, run each expert on its
  // contiguous slice, scale by the routing weight, scatter-add back to the tokens.
  const at::Tensor flat_expert = top_idx.reshape({-1});
  // Sorted on the narrowest integer that holds an expert index: a radix sort makes one pass per
  // key byte (8 for int64), and a stable sort of the same keys gives the same order.
  const at::Tensor sort_key = flat_expert.to(c.experts <= 256 ? at::kByte : c.experts <= 32767 ? at::kShort : at::kLong);
  const at::Tensor order = at::argsort(sort_key, /*stable=*/true, 0, false);
  const at::Tensor token_of = at::floor_divide(order, c.top_k);
  at::Tensor out;
  // The GPU's dispatch and combine (gathers both ways), also wherever the grouped path runs.
  // Merge-aware experts take the loop's dispatch: their LoRA is inside the snapped weights, so
  // there is no second set of consumers (x_lora) and no delta for the combine.
  if ((flat.is_cuda() || grouped_gemm_available(flat)) && !merge_aware_now()) {
    // position[(t, k)] = where pair (token t, slot k) sits in expert order (order's inverse).
    // Dispatch and combine are gathers both ways (gather_rows): no atomics, deterministic.
    const at::Tensor position = at::empty_like(order).scatter_(0, order, at::arange(order.size(0), order.options()));
    // Two outputs over one buffer: the expert GEMMs' and the expert LoRA's gradients meet in
    // the dispatch's backward gather instead of an add of their own.
    auto [x_sorted, x_lora] = gather_rows_twice(flat, token_of, position, c.top_k);
    if (c.llama4) {  // Llama4TextMoe: each expert's input × its routing weight, the outputs summed
      // The LoRA's rows scaled apart, so the two gradients still meet in the dispatch's gather, in
      // one order whatever order the expert GEMMs' backward runs in (groups: expert_group_size).
      const at::Tensor w = top_w.reshape({-1}).index_select(0, order).unsqueeze(1);
      x_sorted = x_sorted * w;
      x_lora = x_lora * w;
    }
    const ExpertsOutput y = experts_forward(x_sorted, x_lora, flat_expert, ctx.training);
    // Combine: each token's routing-weighted sum of its k rows (with the down LoRA's delta
    // added on the way), read where they sit in expert order.
    out = combine_rows(y.y, y.delta, c.llama4 ? at::ones_like(top_w) : top_w, position, token_of, order);
  } else {
    const at::Tensor weight_sorted = top_w.reshape({-1}).index_select(0, order);
    at::Tensor x_sorted = flat.index_select(0, token_of);
    if (c.llama4) x_sorted = x_sorted * weight_sorted.unsqueeze(1);  // Llama 4 weights the experts' input
    // The per-expert loop runs here (no grouped path), and it adds its LoRA deltas itself.
    const ExpertsOutput ey = experts_forward(x_sorted, x_sorted, flat_expert, ctx.training);
    EO_CHECK(!ey.delta.defined(), "moe: the per-expert path left a LoRA delta for the combine");
    const at::Tensor& y = ey.y;
    out = at::zeros_like(flat).index_add(0, token_of, c.llama4 ? y : y * weight_sorted.unsqueeze(1));
  }

  if (w_.has_shared) {
    const at::Tensor shared = w_.shared.forward(flat, ctx.training);
    out = out + (c.shared_expert_gated ? at::sigmoid(w_.shared_gate.forward(flat, ctx.training)) * shared : shared);
  }
  return out.view(x.sizes());
}

// Gemma4TextDecoderLayer.forward (the block's layout: hf_config.h, Gemma4Block).
at::Tensor DecoderBlock::gemma_forward(const at::Tensor& hidden, const BlockContext& ctx) const {
  const double eps = cfg_->rms_eps;
  const at::Tensor h = hidden + rms_norm(attention(rms_norm(hidden, w_.input_norm, eps), ctx), w_.post_norm, eps);
  const at::Tensor dense = rms_norm(w_.dense.forward(rms_norm(h, w_.pre_ff_norm, eps), ctx.training), w_.post_ff_norm_1, eps);
  const at::Tensor routed = rms_norm(moe(rms_norm(h, w_.pre_ff_norm_2, eps), ctx, h), w_.post_ff_norm_2, eps);
  return (h + rms_norm(dense + routed, w_.post_ff_norm, eps)) * w_.layer_scalar;
}

at::Tensor DecoderBlock::forward(const at::Tensor& hidden, const BlockContext& ctx) const {
  if (cfg_->gemma) return gemma_forward(hidden, ctx);
  at::Tensor h = hidden + attention(rms_norm(hidden, w_.input_norm, cfg_->rms_eps), ctx);
  const at::Tensor normed = rms_norm(h, w_.post_norm, cfg_->rms_eps);
  return h + (w_.moe ? moe(normed, ctx) : w_.dense.forward(normed, ctx.training));
}

at::Tensor rope_inv_freq(const Rope& rope, double theta, const at::Device& device) {
  // transformers' _compute_default_rope_parameters / _compute_yarn_parameters, step for step in fp32.
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  const auto R = rope.dim;
  if (rope.proportional_pairs > 0) {  // _compute_proportional_rope_parameters: the rest of the pairs do not turn
    const at::Tensor j = at::arange(0, 2 * rope.proportional_pairs, 2, f32.dtype(at::kLong)).to(at::kFloat);
    const at::Tensor inv = 1.0 / at::pow(theta, j / static_cast<double>(R));
    return at::cat({inv, at::zeros({R / 2 - rope.proportional_pairs}, f32)}) / rope.factor;
  }
  const at::Tensor j = at::arange(0, R, 2, f32.dtype(at::kLong)).to(at::kFloat);
  const at::Tensor pos_freqs = at::pow(theta, j / static_cast<double>(R));
  if (rope.llama3) {  // _compute_llama3_parameters, op for op
    const at::Tensor inv = 1.0 / pos_freqs;
    const double old_len = rope.original_max_positions;
    const double low_wavelen = old_len / rope.low_freq_factor, high_wavelen = old_len / rope.high_freq_factor;
    const at::Tensor wavelen = 2 * M_PI / inv;
    const at::Tensor llama = at::where(wavelen > low_wavelen, inv / rope.factor, inv);
    const at::Tensor smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor);
    const at::Tensor smoothed = (1 - smooth) * llama / rope.factor + smooth * llama;
    const at::Tensor medium = (wavelen >= high_wavelen).logical_and(wavelen <= low_wavelen);
    return at::where(medium, smoothed, llama);
  }
  if (!rope.yarn) return 1.0 / pos_freqs;
  // YaRN: interpolate (÷ factor) the low frequencies, keep the high ones, ramp between the
  // dimensions that turn beta_slow and beta_fast times over the original context.
  auto correction_dim = [&](double rotations) {
    return (static_cast<double>(R) * std::log(rope.original_max_positions / (rotations * 2 * M_PI))) / (2 * std::log(theta));
  };
  double low = correction_dim(rope.beta_fast), high = correction_dim(rope.beta_slow);
  if (rope.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(R - 1));
  if (low == high) high += 0.001;  // transformers' guard against a zero-width ramp
  const at::Tensor ramp = ((at::arange(R / 2, f32) - low) / (high - low)).clamp(0, 1);
  const at::Tensor extrapolation = 1 - ramp;
  const at::Tensor inv_extra = 1.0 / pos_freqs, inv_inter = 1.0 / (rope.factor * pos_freqs);
  return inv_inter * (1 - extrapolation) + inv_extra * extrapolation;
}

MoeModel::MoeModel(ModelConfig cfg, LoadOptions opts, ModelWeights w)
    : cfg_(std::move(cfg)), opts_(std::move(opts)), embed_(std::move(w.embed)), final_norm_(std::move(w.final_norm)),
      lm_head_(std::move(w.lm_head)) {
  for (BlockWeights& b : w.blocks) blocks_.push_back(std::make_unique<DecoderBlock>(cfg_, std::move(b)));
  set_weight_provider(std::move(w.provider));
}

void MoeModel::set_weight_provider(std::shared_ptr<WeightProvider> provider) {
  EO_CHECK(provider != nullptr, "set_weight_provider: null provider");
  provider_ = std::move(provider);
  for (auto& b : blocks_) b->set_weight_provider(provider_.get());
}

at::Tensor MoeModel::embed(const at::Tensor& input_ids) const {
  at::Tensor rows = embed_rows(input_ids);
  // Gemma: × sqrt(hidden_size) rounded to the compute dtype first, as its scaled embedding does.
  if (cfg_.embed_scaled) rows = rows * at::scalar_tensor(std::sqrt(static_cast<double>(cfg_.hidden)), rows.options().dtype(at::kFloat)).to(rows.scalar_type());
  return rows;
}

at::Tensor MoeModel::embed_rows(const at::Tensor& input_ids) const {
  EO_CHECK(input_ids.dim() == 2, "input_ids must be [batch, seq], got ", input_ids.sizes());
  // Checked where it is free: ids on the host. Training data is checked against the vocabulary
  // when it is read, so device batches skip the check rather than synchronise every step.
  if (input_ids.is_cpu() && input_ids.numel()) {
    const auto mx = input_ids.max().item<std::int64_t>(), mn = input_ids.min().item<std::int64_t>();
    EO_CHECK(mn >= 0 && mx < cfg_.vocab, "token id out of range [0, ", cfg_.vocab, "): min ", mn, ", max ", mx);
  }
  if (embed_.is_cpu() && opts_.device.is_cuda()) {
    // Host-held table: gather the rows here, copy only them (through pinned memory, async).
    const at::Tensor rows = at::embedding(embed_, input_ids.to(at::kCPU));
    return rows.pin_memory().to(opts_.device, /*non_blocking=*/true);
  }
  // Host ids for a device table: through pinned memory, so the copy does not wait for the stream.
  if (input_ids.is_cpu() && embed_.is_cuda())
    return at::embedding(embed_, input_ids.contiguous().pin_memory().to(embed_.device(), /*non_blocking=*/true));
  return at::embedding(embed_, input_ids.to(embed_.device()));
}

BlockContext MoeModel::context(const Batch& batch, bool training) const {
  const auto B = batch.input_ids.size(0), T = batch.input_ids.size(1);
  const auto dev = final_norm_.device();  // the compute device (the embedding table may be host-held)
  BlockContext ctx;
  ctx.training = training;
  at::Tensor pos = batch.positions.defined() ? batch.positions.to(dev, at::kLong)
                                             : at::arange(T, at::TensorOptions().dtype(at::kLong).device(dev)).expand({B, T});
  // RoPE tables in fp32, × the YaRN attention factor, cast to the compute dtype.
  auto tables = [&](const Rope& rope, double theta) {
    const at::Tensor freqs = pos.to(at::kFloat).unsqueeze(-1) * rope_inv_freq(rope, theta, dev);  // [B, T, R/2]
    const at::Tensor emb = at::cat({freqs, freqs}, -1);                                         // [B, T, R]
    const double f = rope.attention_factor;
    return std::make_pair((f == 1.0 ? emb.cos() : emb.cos() * f).to(opts_.dtype), (f == 1.0 ? emb.sin() : emb.sin() * f).to(opts_.dtype));
  };
  std::tie(ctx.cos, ctx.sin) = tables(cfg_.rope, cfg_.rope_theta);
  if (cfg_.gemma) {  // Gemma 4: the full layers' table after the sliding layers' (BlockContext)
    const auto [cos_full, sin_full] = tables(cfg_.gemma->full_rope, cfg_.gemma->full_rope_theta);
    ctx.cos = at::cat({ctx.cos, cos_full}, -1);
    ctx.sin = at::cat({ctx.sin, sin_full}, -1);
  }
  if (cfg_.llama4_beta != 0) {  // get_llama_4_attn_scale in fp32, then the compute dtype
    const at::Tensor s = 1 + cfg_.llama4_beta * at::log(1 + at::floor(pos.to(at::kFloat) / cfg_.llama4_positions));
    ctx.q_scale = s.view({B, 1, T, 1}).to(opts_.dtype);
  }

  // Packed rows through flash's variable-length form where it runs (models/attention_path.h); the
  // packing mask only where some layer still needs it (sinks, chunks, latent attention).
  const bool flash = flash_attention_runs(dev, opts_.dtype);
  bool varlen_everywhere = false;
  if (batch.document_starts.defined() && !batch.attention_mask.defined() && flash) {
    ctx.document_starts = batch.document_starts.to(dev);
    varlen_everywhere = true;
    for (int l = 0; l < cfg_.layers; ++l)
      varlen_everywhere = varlen_everywhere && (cfg_.is_linear_attention_layer(l) ||
                                                attention_path(cfg_, l, T, true) == AttentionPath::Varlen);
  }
  if (batch.attention_mask.defined() || (batch.segment_ids.defined() && !varlen_everywhere)) {
    const auto opt = at::TensorOptions().dtype(at::kBool).device(dev);
    at::Tensor mask = at::ones({T, T}, opt).tril().expand({B, 1, T, T});
    if (batch.attention_mask.defined())
      mask = mask & batch.attention_mask.to(dev).to(at::kBool).view({B, 1, 1, T});
    if (batch.segment_ids.defined()) {
      const at::Tensor seg = batch.segment_ids.to(dev);
      mask = mask & (seg.view({B, 1, T, 1}) == seg.view({B, 1, 1, T}));
    }
    // A padded query row would attend to nothing (NaN); let it see itself. Its output is unused.
    ctx.attn_mask = mask | at::eye(T, opt).view({1, 1, T, T});
  }
  // Sliding layers take flash's local window where flash runs and no mask applies to them: no
  // padding, and packed rows only as documents through the variable-length form.
  ctx.flash_windows = flash && !batch.attention_mask.defined() && (!batch.segment_ids.defined() || ctx.document_starts.defined());
  if (cfg_.linear_attn) {  // the delta-rule layers' documents and padding (BlockContext)
    if (batch.segment_ids.defined()) ctx.segment_ids = batch.segment_ids.to(dev, at::kLong);
    if (batch.attention_mask.defined()) ctx.token_mask = batch.attention_mask.to(dev, opts_.dtype).view({B, T, 1});
  }
  if (cfg_.llama4) {
    const Llama4Block& l4 = *cfg_.llama4;
    // The NoPE layers' query temperature (fp32), from each token's position: within its own
    // document when packed, as its RoPE.
    if (l4.temperature_tuning)
      ctx.q_scale = (at::log1p(at::floor((pos.to(at::kFloat) + 1.0) / l4.floor_scale)) * l4.attn_scale + 1.0).view({B, 1, T, 1});
    // Chunked layers: a key is seen only from queries in its chunk of attention_chunk_size
    // positions (transformers' chunked_overlay), on top of the causal / packing mask. Positions
    // below the chunk size all share chunk 0, so short sequences need no mask of their own.
    bool chunked = false;
    for (int l = 0; l < cfg_.layers; ++l) chunked = chunked || cfg_.is_chunked_layer(l);
    if (chunked && T > l4.chunk) {
      const auto opt = at::TensorOptions().dtype(at::kBool).device(dev);
      const at::Tensor base = ctx.attn_mask.defined() ? ctx.attn_mask : at::ones({T, T}, opt).tril().expand({B, 1, T, T});
      const at::Tensor chunk = at::floor_divide(pos, l4.chunk);
      ctx.chunk_mask = base & (chunk.view({B, 1, T, 1}) == chunk.view({B, 1, 1, T}));
    }
  }
  return ctx;
}

at::Tensor MoeModel::head(const at::Tensor& hidden) const {
  const at::Tensor logits = at::linear(rms_norm(hidden, final_norm_, cfg_.rms_eps), lm_head_);
  if (cfg_.final_logit_softcap <= 0) return logits;
  const double cap = cfg_.final_logit_softcap;  // Gemma's final_logit_softcapping
  return at::tanh(logits / cap) * cap;
}

at::Tensor MoeModel::loss_sum(const at::Tensor& hidden, const at::Tensor& labels) const {
  const auto B = hidden.size(0), T = hidden.size(1), H = hidden.size(2);
  EO_CHECK(labels.dim() == 2 && labels.size(0) == B && labels.size(1) == T, "labels shape ", labels.sizes(),
           " does not match hidden ", hidden.sizes());
  if (T < 2) return at::zeros({}, hidden.options().dtype(at::kFloat));
  const at::Tensor normed = rms_norm(hidden.narrow(1, 0, T - 1), final_norm_, cfg_.rms_eps).reshape({-1, H});
  const at::Tensor target = labels.narrow(1, 1, T - 1).to(hidden.device(), at::kLong).reshape({-1});
  return chunked_linear_cross_entropy(normed, lm_head_, target, 0, cfg_.final_logit_softcap);
}

std::pair<at::Tensor, std::int64_t> shifted_cross_entropy(const at::Tensor& logits, const at::Tensor& labels) {
  const auto V = logits.size(-1), T = logits.size(1);
  EO_CHECK(labels.sizes() == logits.sizes().slice(0, 2), "labels shape ", labels.sizes(), " does not match logits ",
           logits.sizes());
  if (T < 2) return {at::zeros({}, logits.options().dtype(at::kFloat)), 0};
  const at::Tensor pred = logits.narrow(1, 0, T - 1).to(at::kFloat).reshape({-1, V});
  const at::Tensor target = labels.narrow(1, 1, T - 1).to(logits.device(), at::kLong).reshape({-1});
  const std::int64_t count = (target != -100).sum().item<std::int64_t>();
  const at::Tensor sum = at::cross_entropy_loss(pred, target, {}, at::Reduction::Sum, -100);
  return {sum, count};
}

at::Tensor load_balancing_loss(const std::vector<at::Tensor>& router_logits, std::int64_t experts, std::int64_t top_k,
                               const at::Tensor& attention_mask) {
  EO_CHECK(!router_logits.empty(), "load_balancing_loss: no MoE layer produced router logits");
  const auto dev = router_logits[0].device();
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(dev);
  at::Tensor tokens_per_expert = at::zeros({experts}, f32), prob_sum = at::zeros({experts}, f32);
  at::Tensor rows = at::zeros({}, f32);
  const at::Tensor mask = attention_mask.defined() ? attention_mask.reshape({-1}).to(dev, at::kFloat) : at::Tensor();
  for (const auto& layer : router_logits) {
    const at::Tensor probs = at::softmax(layer.to(at::kFloat), -1);
    const at::Tensor selected = std::get<1>(at::topk(probs, top_k, -1)).reshape({-1});
    const at::Tensor w = mask.defined() ? mask.repeat_interleave(top_k) : at::ones({selected.size(0)}, f32);
    tokens_per_expert = tokens_per_expert + at::zeros({experts}, f32).scatter_add(0, selected, w);
    prob_sum = prob_sum + (mask.defined() ? probs * mask.unsqueeze(-1) : probs).sum(0);
    rows = rows + (mask.defined() ? mask.sum() : at::full({}, static_cast<double>(probs.size(0)), f32));
  }
  return (tokens_per_expert / rows * (prob_sum / rows)).sum() * static_cast<double>(experts);
}

ForwardOutput MoeModel::forward(const Batch& batch, const ForwardOptions& opts) const {
  if (opts.aux_loss && !cfg_.has_aux_loss)
    throw UsageError(cfg_.model_type + " has no router auxiliary loss in transformers (it balances its experts with "
                     "e_score_correction_bias, or not at all); turn output_router_logits off");
  ForwardOutput out;
  std::vector<at::Tensor> router_logits;
  BlockContext ctx = context(batch, opts.training);
  if (opts.aux_loss) ctx.router_logits = &router_logits;
  at::Tensor h = embed(batch.input_ids);
  for (const auto& b : blocks_) {
    if (b->is_moe()) provider_->stage(b->index());
    h = b->forward(h, ctx);
  }
  out.logits = head(h);
  if (batch.labels.defined()) std::tie(out.loss_sum, out.tokens) = shifted_cross_entropy(out.logits, batch.labels);
  if (opts.aux_loss) out.aux_loss = load_balancing_loss(router_logits, cfg_.experts, cfg_.top_k, batch.attention_mask);
  return out;
}

void MoeModel::set_bank_reuse(BankReuse reuse) {
  for (auto& b : blocks_) b->set_bank_reuse(reuse);
}

}  // namespace eo::model
