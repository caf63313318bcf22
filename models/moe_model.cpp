// Decoder forward: attention (RoPE, GQA, q/k norms), router + token-sorted expert dispatch,
// dense / shared-expert MLPs, final head, loss and router aux loss. Semantics follow the
// transformers 5.x modeling files of each family (design.md §3.3).
#include "models/moe_model.h"

#include <ATen/ATen.h>

#include <cmath>
#include <optional>

#include "common/error.h"
#include "models/fused.h"
#include "models/linear4bit.h"
#include "models/lm_loss.h"

namespace eo::model {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  // On a GPU libtorch's fused kernel: one pass forward and one backward instead of the seven
  // elementwise passes below, with fp32 statistics; it multiplies by the weight before the one
  // rounding to x's dtype (transformers rounds, then multiplies), a difference within bf16 rounding.
  if (x.is_cuda()) return std::get<0>(at::_fused_rms_norm(x, {x.size(-1)}, weight, eps));
  // fp32 statistics, cast back, then × weight (HF order: the product is in the input dtype).
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor normed = xf * at::rsqrt(xf.pow(2).mean({-1}, true) + eps);
  return weight * normed.to(x.scalar_type());
}

at::Tensor FrozenLinear::forward(const at::Tensor& x, bool training) const {
  at::Tensor y = q ? linear4bit(x, WeightHandle{nullptr, -1, -1, ExpertMatrix::Gate, q.get()}) : at::linear(x, weight);
  if (bias.defined()) y = y + bias;
  if (lora) y = lora->add_to(y, x, training);
  return y;
}

at::Tensor Mlp::forward(const at::Tensor& x, bool training) const {
  return down.forward(swiglu(gate.forward(x, training), up.forward(x, training)), training);
}

at::Tensor DecoderBlock::attention(const at::Tensor& x, const BlockContext& ctx) const {
  const ModelConfig& c = *cfg_;
  const auto B = x.size(0), T = x.size(1);
  at::Tensor q = q_.forward(x, ctx.training), k = k_.forward(x, ctx.training), v = v_.forward(x, ctx.training);
  if (c.qk_norm == QkNorm::Whole) {  // olmoe: over the whole projection, before the split
    q = rms_norm(q, q_norm_, c.rms_eps);
    k = rms_norm(k, k_norm_, c.rms_eps);
  }
  if (c.clip_qkv) {
    q = q.clamp(-*c.clip_qkv, *c.clip_qkv);
    k = k.clamp(-*c.clip_qkv, *c.clip_qkv);
    v = v.clamp(-*c.clip_qkv, *c.clip_qkv);
  }
  q = q.view({B, T, c.heads, c.head_dim});
  k = k.view({B, T, c.kv_heads, c.head_dim});
  v = v.view({B, T, c.kv_heads, c.head_dim});
  if (c.qk_norm == QkNorm::PerHead) {  // qwen3: per head, after the view
    q = rms_norm(q, q_norm_, c.rms_eps);
    k = rms_norm(k, k_norm_, c.rms_eps);
  }
  q = rope(q, ctx.cos, ctx.sin).transpose(1, 2);  // [B, heads, T, D] views for SDPA
  k = rope(k, ctx.cos, ctx.sin).transpose(1, 2);
  v = v.transpose(1, 2);
  // GQA: query head h reads kv head h / (heads / kv_heads). Plain causal attention passes the
  // grouping to the fused kernel (flash attention on a GPU); with a packing mask the kv heads
  // are repeated, which the memory-efficient kernel accepts together with a mask.
  const bool gqa = c.kv_heads != c.heads;
  if (gqa && ctx.attn_mask.defined()) {
    k = k.repeat_interleave(c.heads / c.kv_heads, 1);
    v = v.repeat_interleave(c.heads / c.kv_heads, 1);
  }
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
  const std::optional<at::Tensor> mask = ctx.attn_mask.defined() ? std::optional<at::Tensor>(ctx.attn_mask) : std::nullopt;
  const at::Tensor o =
      at::scaled_dot_product_attention(q, k, v, mask, 0.0, !mask.has_value(), scale, gqa && !mask.has_value());
  return o_.forward(o.transpose(1, 2).reshape({B, T, c.heads * c.head_dim}), ctx.training);
}

at::Tensor DecoderBlock::expert(int e, const at::Tensor& x, bool training, const ExpertLoraSlices& lora) const {
  auto linear = [&](ExpertMatrix m, const at::Tensor& in) {
    const int mi = static_cast<int>(m);
    at::Tensor y = quantized_ ? linear4bit(in, WeightHandle{provider_, index_, e, m, nullptr}) : at::linear(in, experts_[mi][e]);
    if (const auto& l = expert_lora_[mi]) y = l->add_to(lora[mi], e, y, in, training);
    return y;
  };
  at::Tensor gate = linear(ExpertMatrix::Gate, x), up = linear(ExpertMatrix::Up, x);
  if (gate_up_lora_) {
    // The fused [gate; up] output takes one LoRA delta (shared A), then splits as transformers'
    // gate_up_proj(...).chunk(2) does.
    const auto I = gate.size(-1);
    const at::Tensor gu = gate_up_lora_->add_to(lora[3], e, at::cat({gate, up}, -1), x, training);
    gate = gu.narrow(-1, 0, I);
    up = gu.narrow(-1, I, I);
  }
  return linear(ExpertMatrix::Down, swiglu(gate, up));
}

bool DecoderBlock::expert_lora_grouped_ok() const {
  for (const auto& l : expert_lora_)
    if (l && !l->grouped_ok()) return false;
  return !gate_up_lora_ || gate_up_lora_->grouped_ok();
}

at::Tensor DecoderBlock::experts_forward(const at::Tensor& x_sorted, const at::Tensor& expert_of, bool training) const {
  const ModelConfig& c = *cfg_;
  // Per-expert row counts, on the device: scatter_add (bincount would read its max on the host).
  const at::Tensor counts = at::zeros({c.experts}, expert_of.options()).scatter_add(0, expert_of, at::ones_like(expert_of));
  if (grouped_gemm_available(x_sorted) && expert_lora_grouped_ok()) {
    // GPU: one grouped GEMM per matrix over all experts, and the expert LoRA as two more over
    // the same rows and offsets; offsets stay on the device, so the block runs without a host
    // synchronisation.
    const at::Tensor offsets = counts.cumsum(0).to(at::kInt);
    auto linear = [&](ExpertMatrix m, const at::Tensor& in) {
      ExpertBank b;
      b.layer = index_;
      b.experts = static_cast<int>(c.experts);
      b.matrix = m;
      if (quantized_) {
        b.provider = provider_;
        b.max_bytes = bank_bytes_;
      } else {
        b.dense = experts_[static_cast<int>(m)];
      }
      at::Tensor y = grouped_expert_linear(in, offsets, b);
      if (const auto& l = expert_lora_[static_cast<int>(m)]) y = y + l->grouped_delta(in, offsets, training);
      return y;
    };
    at::Tensor gate = linear(ExpertMatrix::Gate, x_sorted);
    at::Tensor up = linear(ExpertMatrix::Up, x_sorted);
    if (gate_up_lora_) {  // one delta [N, 2I] for the fused [gate; up], split
      const at::Tensor d = gate_up_lora_->grouped_delta(x_sorted, offsets, training);
      const auto I = gate.size(-1);
      gate = gate + d.narrow(1, 0, I);
      up = up + d.narrow(1, I, I);
    }
    return linear(ExpertMatrix::Down, swiglu(gate, up));
  }
  // CPU (and fp32 on a GPU, or r not a multiple of 8): each routed expert once on its slice;
  // the counts are read on the host. The stacked LoRA is cut into per-expert views once.
  const at::Tensor host_counts = counts.to(at::kCPU);
  const auto* count = host_counts.data_ptr<std::int64_t>();
  ExpertLoraSlices lora;
  for (int mi = 0; mi < 3; ++mi)
    if (expert_lora_[mi]) lora[mi] = expert_lora_[mi]->slices();
  if (gate_up_lora_) lora[3] = gate_up_lora_->slices();
  std::vector<at::Tensor> outs;
  std::int64_t offset = 0;
  for (int e = 0; e < c.experts; ++e) {
    if (count[e] == 0) continue;
    outs.push_back(expert(e, x_sorted.narrow(0, offset, count[e]), training, lora));
    offset += count[e];
  }
  return at::cat(outs, 0);
}

at::Tensor DecoderBlock::moe(const at::Tensor& x, const BlockContext& ctx) const {
  const ModelConfig& c = *cfg_;
  const auto H = x.size(-1);
  const at::Tensor flat = x.reshape({-1, H});
  const auto N = flat.size(0);

  // Router: logits in the compute dtype, softmax in fp32, top-k, optional renormalisation.
  const at::Tensor logits = at::linear(flat, router_);
  if (ctx.router_logits) ctx.router_logits->push_back(logits);
  const at::Tensor probs = at::softmax(logits, -1, at::kFloat);
  auto [top_w, top_idx] = at::topk(probs, c.top_k, -1);
  if (c.norm_topk_prob) top_w = top_w / top_w.sum(-1, true);
  top_w = top_w.to(x.scalar_type());

  // Token-sorted dispatch: order the (token, slot) pairs by expert, run each expert on its
  // contiguous slice, scale by the routing weight, scatter-add back to the tokens.
  const at::Tensor flat_expert = top_idx.reshape({-1});
  const at::Tensor order = at::argsort(flat_expert, /*stable=*/true, 0, false);
  const at::Tensor token_of = at::floor_divide(order, c.top_k);
  at::Tensor out;
  if (flat.is_cuda()) {
    // position[(t, k)] = where pair (token t, slot k) sits in expert order (order's inverse).
    // Dispatch and combine are gathers both ways (gather_rows): no atomics, deterministic.
    const at::Tensor position = at::empty_like(order).scatter_(0, order, at::arange(order.size(0), order.options()));
    const at::Tensor x_sorted = gather_rows(flat, token_of, position, c.top_k);
    const at::Tensor y = experts_forward(x_sorted, flat_expert, ctx.training);
    // Combine: the rows back in (token, slot) order, each token's routing-weighted sum as one
    // batched GEMM (fp32 accumulation).
    const at::Tensor y_tok = gather_rows(y, position, order, 1).view({N, c.top_k, H});
    out = at::bmm(top_w.view({N, 1, c.top_k}), y_tok).view({N, H});
  } else {
    const at::Tensor x_sorted = flat.index_select(0, token_of);
    const at::Tensor y = experts_forward(x_sorted, flat_expert, ctx.training);
    const at::Tensor weight_sorted = top_w.reshape({-1}).index_select(0, order);
    out = at::zeros_like(flat).index_add(0, token_of, y * weight_sorted.unsqueeze(1));
  }

  if (has_shared_)
    out = out + at::sigmoid(at::linear(flat, shared_gate_)) * shared_.forward(flat, ctx.training);
  return out.view(x.sizes());
}

at::Tensor DecoderBlock::forward(const at::Tensor& hidden, const BlockContext& ctx) const {
  at::Tensor h = hidden + attention(rms_norm(hidden, input_norm_, cfg_->rms_eps), ctx);
  const at::Tensor normed = rms_norm(h, post_norm_, cfg_->rms_eps);
  return h + (moe_ ? moe(normed, ctx) : dense_.forward(normed, ctx.training));
}

at::Tensor MoeModel::embed(const at::Tensor& input_ids) const {
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
  return at::embedding(embed_, input_ids.to(embed_.device()));
}

BlockContext MoeModel::context(const Batch& batch, bool training) const {
  const auto B = batch.input_ids.size(0), T = batch.input_ids.size(1);
  const auto dev = final_norm_.device();  // the compute device (the embedding table may be host-held)
  BlockContext ctx;
  ctx.training = training;
  at::Tensor pos = batch.positions.defined() ? batch.positions.to(dev, at::kLong)
                                             : at::arange(T, at::TensorOptions().dtype(at::kLong).device(dev)).expand({B, T});
  // RoPE tables in fp32 (inv_freq = theta^(-2j/d)), cast to the compute dtype.
  const auto D = cfg_.head_dim;
  const at::Tensor j = at::arange(0, D, 2, at::TensorOptions().dtype(at::kLong).device(dev)).to(at::kFloat);
  const at::Tensor inv_freq = 1.0 / at::pow(cfg_.rope_theta, j / static_cast<double>(D));
  const at::Tensor freqs = pos.to(at::kFloat).unsqueeze(-1) * inv_freq;  // [B, T, D/2]
  const at::Tensor emb = at::cat({freqs, freqs}, -1);                   // [B, T, D]
  ctx.cos = emb.cos().to(opts_.dtype);
  ctx.sin = emb.sin().to(opts_.dtype);

  if (batch.attention_mask.defined() || batch.segment_ids.defined()) {
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
  return ctx;
}

at::Tensor MoeModel::head(const at::Tensor& hidden) const {
  return at::linear(rms_norm(hidden, final_norm_, cfg_.rms_eps), lm_head_);
}

at::Tensor MoeModel::loss_sum(const at::Tensor& hidden, const at::Tensor& labels) const {
  const auto B = hidden.size(0), T = hidden.size(1), H = hidden.size(2);
  EO_CHECK(labels.dim() == 2 && labels.size(0) == B && labels.size(1) == T, "labels shape ", labels.sizes(),
           " does not match hidden ", hidden.sizes());
  if (T < 2) return at::zeros({}, hidden.options().dtype(at::kFloat));
  const at::Tensor normed = rms_norm(hidden.narrow(1, 0, T - 1), final_norm_, cfg_.rms_eps).reshape({-1, H});
  const at::Tensor target = labels.narrow(1, 1, T - 1).to(hidden.device(), at::kLong).reshape({-1});
  return chunked_linear_cross_entropy(normed, lm_head_, target);
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

}  // namespace eo::model
