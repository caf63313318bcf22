#include "models/block_memory.h"

namespace eo::model {

double rope_table_columns(const ModelConfig& c) {
  return c.gemma ? double(c.rope.dim + c.gemma->full_rope.dim) : double(c.head_dim);
}

int dense_mlp_layers(const ModelConfig& c, int moe_layers) {
  return c.dense_beside_experts() ? int(c.layers) : int(c.layers) - moe_layers;
}

double extra_layer_params(const ModelConfig& c) {
  const double H = double(c.hidden), E = double(c.experts);
  return c.gemma ? 5 * H + H + E + 1 : 0;
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

bool fused_swiglu_lora(const ModelConfig& c) { return !c.swiglu_clamp; }

}  // namespace eo::model
