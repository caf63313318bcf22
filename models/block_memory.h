// What a family's decoder block holds beyond the tensors every block has, as its code
// (models/moe_model.cpp, the block structs of models/hf_config.h) allocates them. The memory plan
// (runtime/plan.cpp) adds these to the shared decoder's terms and names no family itself.
#pragma once

#include <string>

#include "models/hf_config.h"

namespace eo::model {

// Columns of the RoPE tables (cos, sin) each micro-batch keeps: one table of head_dim, Gemma 4
// one per layer type.
double rope_table_columns(const ModelConfig& c);
// Layers with a dense MLP: the dense layers, and every layer of Gemma 4 (beside its experts).
int dense_mlp_layers(const ModelConfig& c, int moe_layers);
// Parameters of one layer beyond its attention, its two norms and its q/k norms: Gemma 4's
// feed-forward norms, router scales and layer scalar; the delta-rule layers' conv1d, decay and gated norm.
double extra_layer_params(const ModelConfig& c);
// Parameters of one MoE layer's shared expert beside its three linears (its gate).
double shared_expert_gate_params(const ModelConfig& c);

// Tensors a family's blocks share across a micro-batch (BlockContext), all micro-batches of the
// step kept: Llama 4's chunked-attention masks and NoPE query scales. bytes 0: none.
struct BlockContextBytes {
  double bytes = 0;
  std::string name, what;
};
BlockContextBytes block_context_bytes(const ModelConfig& c, double micro_batch_size, double sequence_len, double micro_batches);

// Saved by one MoE layer's forward beyond the router's, the dispatch's and SwiGLU's tensors, for
// `pairs` token-expert pairs: Llama 4's unscaled expert input rows.
double routed_input_saved_bytes(const ModelConfig& c, double pairs, double dtype_bytes);
// Saved by one MoE layer beside the routed experts: the shared expert's gate, up and output and
// its gate's logit, and Gemma 4's dense MLP (gate, up, act) and its five norms' outputs.
double beside_experts_saved_bytes(const ModelConfig& c, double tokens, double dtype_bytes);
// A gated delta-rule layer (Qwen3-Next, Qwen3.5; models/linear_attention.cpp, models/delta_rule.cpp)
// of a micro-batch of `rows` rows of `seq` tokens: what its recompute saves until its backward, in
// place of attention's, and what the delta rule's chunked backward adds at once (its fp32 chunks,
// their C x C matrices and every chunk's entry state, and as much again for their gradients).
// Both 0 for a family without such layers. `lora_bytes`: one LoRA intermediate's bytes per token.
struct LinearAttentionBytes {
  double saved = 0, backward = 0;
};
LinearAttentionBytes linear_attention_bytes(const ModelConfig& c, double rows, double seq, double dtype_bytes,
                                            double lora_bytes);

// Whether the GPU's fused SwiGLU takes the expert LoRA's deltas and gradients apart from the base
// GEMMs' (models/fused.h: swiglu_twice), keeping them for its backward: not under gpt-oss's
// clamped activation, whose clamps read the sums, formed first (models/moe_model.cpp).
bool fused_swiglu_lora(const ModelConfig& c);

}  // namespace eo::model
