// The step time predicted: counts (step_work) and rates (predict_step_time). Every count is of the
// step as the trainer runs it (runtime/step.cpp: checkpointed blocks, frozen base weights); the
// efficiencies are the only measured constants (runtime/step_time.h).
#include "runtime/step_time.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "models/attention_path.h"
#include "models/block_memory.h"
#include "models/lora_targets.h"
#include "runtime/expert_lora_offload.h"

namespace eo {

namespace {

// Keys a query at position p (1-based) attends to, averaged over a causal sequence of `seq`: p
// under full attention, at most `window` under a sliding window.
double mean_context(double seq, double window) {
  if (window <= 0 || window >= seq) return (seq + 1) / 2;
  return (window * (window + 1) / 2 + (seq - window) * window) / seq;
}

// Tensor passes (one read or one write of the tensor) per token of the step's small kernels, counted
// from the block's code: per layer on [tokens, hidden] (residual and LoRA adds, norms, casts, RoPE,
// over the forward, the recompute and the backward), per MoE layer on [tokens x top_k, hidden] (the
// permutation's gathers and the combine's scatter, each way) and on [tokens x top_k, width] (SwiGLU's
// gate, up and product and their gradients). Dense MLPs take the last count on their width.
constexpr double kHiddenPasses = 40, kPairPasses = 16, kWidthPasses = 14;

}  // namespace

StepWork step_work(const RunSpec& spec, const MemoryPlan& plan) {
  const model::ModelConfig& c = spec.model;
  StepWork w;
  const double seq = spec.sequence_len;
  const double T = seq * spec.micro_batch_size * spec.accum;
  const double H = double(c.hidden);
  const double I = double(c.expert_width);
  const double k = double(c.top_k);
  const double E = double(c.experts);
  const double dtype_bytes = spec.compute == Compute::Fp32 ? 4 : 2;
  w.tokens = T;
  w.moe_layers = int(spec.moe_layers.size());
  const double moe = w.moe_layers;
  const double frozen = 3;  // forward, recompute, input gradient
  const double adapted = 4; // ... and LoRA's weight gradient

  w.expert_gemm_flops = T * moe * k * 3 * 2 * H * I * frozen;
  const double dense_layers = model::dense_mlp_layers(c, w.moe_layers);
  double other = T * dense_layers * 3 * 2 * H * double(c.dense_width) * frozen;
  other += T * moe * 3 * 2 * H * double(c.shared_expert_width) * frozen;
  other += T * moe * 2 * H * E * frozen;  // routers
  for (int l = 0; l < int(c.layers); ++l) {
    for (const auto& lin : c.attention_shapes(l)) {
      other += T * 2 * double(lin.in) * double(lin.out) * frozen;
      if (model::adapts_module(spec.lora, spec.lora_all_linear, lin.name, l))
        other += T * 2 * double(spec.lora.r) * double(lin.in + lin.out) * adapted;
    }
    if (c.is_linear_attention_layer(l)) continue;  // the delta rule: not counted (docs)
    double window = 0;
    if (c.is_sliding_layer(l)) window = double(c.sliding_window);
    if (c.is_chunked_layer(l)) window = double(c.llama4->chunk);
    const double qk = c.mla ? double(c.mla->qk_dim()) : double(c.head_dim_at(l));
    const double v = c.mla ? double(c.mla->v_dim) : double(c.head_dim_at(l));
    // QK^T and PV: forward, recompute, and a backward of twice the forward. Only the fused kernel
    // skips the keys a query cannot see.
    const double per_key = T * double(c.heads) * (qk + v) * 2 * 4, visible = per_key * mean_context(seq, window);
    w.attention_flops += visible;
    const model::AttentionPath path = model::attention_path(c, l, spec.sequence_len, spec.packed);
    if (model::needs_flash_forms(c, l, path)) {  // flash's variable-length form or local window
      w.flash_forms_flops += visible;
      w.flash_forms_masked_flops += per_key * seq;
      continue;
    }
    switch (path) {
      case model::AttentionPath::Fused:
      case model::AttentionPath::Varlen: w.fused_attention_flops += visible; break;
      case model::AttentionPath::Masked: w.masked_attention_flops += per_key * seq; break;
    }
  }
  w.other_gemm_flops = other;
  w.head_flops = T * 2 * H * double(c.vocab) * 2;  // forward and input gradient

  if (spec.expert_format && w.moe_layers > 0) {
    // Each micro-batch dequantises every bank in the forward and again in the recompute, which keeps
    // them for the backward as far as expert_bank_reuse lets it; the rest is dequantised there again.
    const double params = moe * E * 3 * H * I;
    const double per_pass = plan.expert_bytes + params * dtype_bytes;
    // Without checkpointing: the forward, then the backward dequantises every bank again.
    double passes = 2;
    if (spec.checkpointing && spec.bank_reuse == model::BankReuse::None) passes += 1;
    if (spec.checkpointing && spec.bank_reuse == model::BankReuse::Down) passes += 2.0 / 3;  // gate's and up's
    w.dequant_bytes = per_pass * passes * spec.accum;
  }
  // The experts' LoRA (lora_target_parameters, or the experts' linears by name): per routed row and
  // adapted matrix in -> out, A reads x and B writes the delta its consumer reads, in the forward and
  // the recompute; the backward reads the output's gradient twice (dz, dB), reads x (dA) and
  // accumulates into x's gradient. Rank-wide terms are small beside in and out and left out; the
  // GEMMs are thin (r columns) and run far below the card's rate, so they are counted by their bytes.
  if (w.moe_layers > 0) {
    const model::ExpertLoraReach reach = model::expert_lora_reach(c, spec.lora, spec.lora_all_linear);
    const double per_row = (reach.gate + reach.up) * (5 * H + 6 * I) + reach.down * (5 * I + 6 * H);
    w.expert_lora_bytes = T * k * moe * dtype_bytes * per_row;
  }
  w.elementwise_bytes =
      T * dtype_bytes *
      (double(c.layers) * kHiddenPasses * H + moe * (kPairPasses * k * H + kWidthPasses * k * I) +
       dense_layers * kWidthPasses * double(c.dense_width) + moe * kWidthPasses * double(c.shared_expert_width));
  w.layer_passes = double(c.layers) * spec.accum;
  if (spec.offload) {
    w.staged_bytes = double(plan.copies_per_step) * plan.block_bytes;
    if (spec.expert_lora_offload) w.staged_bytes += expert_lora_link_bytes(plan.expert_lora_params).h2d;
    w.prefetch = spec.prefetch;
  }
  return w;
}

StepTime predict_step_time(const StepWork& w, const CardFigures& card, const StepEfficiency& eff) {
  StepTime t;
  const double flops = card.bf16_tflops * 1e12, bytes = card.mem_gbps * 1e9;
  const double fused = w.fused_attention_flops + (card.flash_attention ? w.flash_forms_flops : 0);
  const double masked = w.masked_attention_flops + (card.flash_attention ? 0 : w.flash_forms_masked_flops);
  t.phases = {{"expert grouped GEMMs", w.expert_gemm_flops / (flops * eff.expert_gemm)},
              {"other GEMMs (projections, LoRA, routers)", w.other_gemm_flops / (flops * eff.other_gemm)},
              {"LM head", w.head_flops / (flops * eff.other_gemm)},
              {"attention", fused / (flops * eff.attention)},
              {"attention, masked kernel", masked / (flops * eff.masked_attention)},
              {"4-bit dequantisation", w.dequant_bytes / (bytes * eff.memory)},
              {"experts' LoRA (thin grouped GEMMs, adds)", w.expert_lora_bytes / (bytes * eff.expert_lora)},
              {"elementwise, norms, routing", w.elementwise_bytes / (bytes * eff.memory)},
              {"fixed cost per layer pass", w.layer_passes * eff.layer_pass_s}};
  for (const auto& p : t.phases) t.compute_s += p.seconds;
  t.transfer_s = w.staged_bytes / (card.link_gbps * 1e9);
  const double copies_s = t.transfer_s / eff.link;
  if (w.staged_bytes <= 0) {
    t.step_s = t.compute_s;
  } else if (w.prefetch && w.moe_layers > 0) {
    // Each block's copy overlaps the compute before it: per block the slower of the two. The head
    // runs with no block to stage.
    const double head = t.phases[2].seconds;
    const double blocks = w.moe_layers;
    t.step_s = head + blocks * std::max((t.compute_s - head) / blocks, copies_s / blocks);
  } else {
    t.step_s = t.compute_s + copies_s;
  }
  t.tokens_per_s = t.step_s > 0 ? w.tokens / t.step_s : 0;
  return t;
}

StepEfficiency calibrate_step_efficiency(const StepWork& w, const CardFigures& card, const PhaseSeconds& m) {
  const double flops = card.bf16_tflops * 1e12, bytes = card.mem_gbps * 1e9;
  StepEfficiency e;
  e.expert_gemm = w.expert_gemm_flops / (flops * m.expert_gemm);
  e.other_gemm = (w.other_gemm_flops + w.head_flops) / (flops * m.other_gemm);
  e.attention = w.fused_attention_flops / (flops * m.attention);
  e.memory = (w.dequant_bytes + w.elementwise_bytes) / (bytes * m.memory);
  e.layer_pass_s = m.fixed / w.layer_passes;
  return e;
}

std::string describe_step_time(const StepTime& t, const CardFigures& card) {
  std::ostringstream o;
  char line[256];
  std::snprintf(line, sizeof line, "step time on %s (%s; %g TFLOP/s, %g GB/s memory, %g GB/s host link):\n", card.name.c_str(),
                card.what.c_str(), card.bf16_tflops, card.mem_gbps, card.link_gbps);
  o << line;
  for (const auto& p : t.phases) {
    if (p.seconds <= 0) continue;  // a phase this run has none of
    std::snprintf(line, sizeof line, "  %-42s %8.3f s\n", p.name.c_str(), p.seconds);
    o << line;
  }
  std::snprintf(line, sizeof line, "  %-42s %8.3f s\n", "compute, experts resident", t.compute_s);
  o << line;
  if (t.transfer_s > 0) {
    std::snprintf(line, sizeof line, "  %-42s %8.3f s\n", "transfer floor (staged experts / link)", t.transfer_s);
    o << line;
  }
  std::snprintf(line, sizeof line, "  predicted: %.3f s/step, %.0f tokens/s (what it counts and how close it came: docs/step-time.md)\n",
                t.step_s, t.tokens_per_s);
  o << line;
  return o.str();
}

}  // namespace eo
