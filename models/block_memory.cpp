#include "models/block_memory.h"

#include <cmath>

#include "models/delta_rule.h"

namespace eo::model {

double rope_table_columns(const ModelConfig& c) {
  return c.gemma ? double(c.rope.dim + c.gemma->full_rope.dim) : double(c.head_dim);
}

int dense_mlp_layers(const ModelConfig& c, int moe_layers) {
  return c.dense_beside_experts() ? int(c.layers) : int(c.layers) - moe_layers;
}

double extra_layer_params(const ModelConfig& c) {
  const double H = double(c.hidden), E = double(c.experts);
  double extra = c.gemma ? 5 * H + H + E + 1 : 0;
  if (c.linear_attn) {  // the delta-rule layers' conv1d, A_log, dt_bias and gated norm, averaged over the layers
    const LinearAttention& a = *c.linear_attn;
    double linear_layers = 0;
    for (int i = 0; i < c.layers; ++i) linear_layers += c.is_linear_attention_layer(i) ? 1 : 0;
    extra += (double(a.conv_width() * a.conv_kernel) + 2 * double(a.v_heads) + double(a.v_dim)) * linear_layers / double(c.layers);
  }
  return extra;
}

double shared_expert_gate_params(const ModelConfig& c) {
  return c.llama4 ? 0.0 : double(c.hidden);  // Llama 4's shared expert has no gate
}

BlockContextBytes block_context_bytes(const ModelConfig& c, double micro_batch_size, double sequence_len, double micro_batches) {
  if (!c.llama4) return {};
  // A bool [T, T] mask per row of each micro-batch kept, when the sequence is longer than a chunk,
  // and q_scale's fp32 per token for the NoPE layers.
  bool chunked = false;
  for (int i = 0; i < c.layers; ++i) chunked = chunked || c.is_chunked_layer(i);
  const double g = micro_batches, T = sequence_len, N = micro_batch_size * sequence_len;
  const double masks = chunked && sequence_len > double(c.llama4->chunk) ? g * micro_batch_size * T * T : 0;
  const double scales = c.llama4->temperature_tuning ? g * N * 4 : 0;
  return {masks + scales, "llama4 context", "chunked-attention masks and NoPE query scales of the micro-batches"};
}

double routed_input_saved_bytes(const ModelConfig& c, double pairs, double dtype_bytes) {
  // Llama 4 scales the experts' input rows by their routing weights: the unscaled rows are saved too.
  return c.llama4 ? pairs * double(c.hidden) * dtype_bytes : 0;
}

double beside_experts_saved_bytes(const ModelConfig& c, double tokens, double dtype_bytes) {
  const double N = tokens, H = double(c.hidden), d = dtype_bytes;
  double bytes = c.shared_expert_width > 0 ? N * (2 * double(c.shared_expert_width) + H) * d + N * d : 0;
  if (c.dense_beside_experts()) bytes += N * (3 * double(c.dense_width) + 5 * H) * d;
  return bytes;
}

LinearAttentionBytes linear_attention_bytes(const ModelConfig& c, double rows, double seq, double dtype_bytes,
                                            double lora_bytes) {
  if (!c.linear_attn) return {};
  const LinearAttention& a = *c.linear_attn;
  const double N = rows * seq, d = dtype_bytes, H = double(c.hidden);
  const double kd = double(a.key_width()), vd = double(a.value_width()), cw = double(a.conv_width());
  const double Hv = double(a.v_heads), dk = double(a.k_dim), dv = double(a.v_dim);
  const double C = double(GatedDeltaRuleOptions{}.chunk_size);
  LinearAttentionBytes b;
  // The normed input (the projections' LoRA A), the projections' outputs, the conv's input, its
  // pre-SiLU sum and q / k / v after it, the decay's fp32 inputs and beta, the delta rule's output,
  // z and the gated norm's fp32 products, out_proj's input, the LoRA intermediates.
  const int linears = a.split_projections ? 5 : 3;
  b.saved = N * (H * d + (2 * kd + 2 * vd) * d + 3 * cw * d + Hv * (8 + d) + vd * (4 * d + 8) + linears * lora_bytes);
  // The backward's fp32 chunks (q, k at every value head, Γq, e k, W; v, U, Ṽ), its C x C matrices
  // (decay, k kᵀ, q kᵀ, the inverse and two more in flight) and the entry state of every chunk.
  const double chunks = N * Hv * (5 * dk + 3 * dv + 6 * C) * 4;
  const double states = rows * Hv * std::ceil(seq / C) * dk * dv * 4;
  b.backward = 2 * (chunks + states);
  return b;
}

bool fused_swiglu_lora(const ModelConfig& c) { return !c.swiglu_clamp; }

}  // namespace eo::model
