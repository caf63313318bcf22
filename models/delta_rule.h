// The gated delta rule, the recurrence of Qwen3-Next's and Qwen3.5's linear-attention layers
// (transformers' torch_chunk_gated_delta_rule; flash-linear-attention's chunk_gated_delta_rule),
// chunked, with a hand-written chunked backward (docs/design.md §4.3).
//
// Per value head, with state S (dk × dv, fp32) and per token t:
//   S ← exp(g_t) · S                        (decay; g_t ≤ 0 is a log decay)
//   S ← S + k_t · (β_t · (v_t − Sᵀ k_t))ᵀ   (the delta rule: write the part of v_t S does not predict)
//   o_t = Sᵀ q_t                            (q_t scaled by 1/sqrt(dk), after the optional L2 norm)
// In packed rows the state is zeroed where a new document starts, as fla does for cu_seqlens.
// Saved for backward: the inputs only; the backward recomputes the chunks and their entry states.
//
// Everything but the chain of states through the chunks is batched ATen over all chunks at once; the
// chain (forward, and the state gradient's in the backward) can be one kernel per call for fp32 on a
// GPU (delta_rule_cuda.h, set_delta_rule_kernels_enabled) and is batched matmuls per chunk otherwise. No host read of device data, so it is
// graph-capturable. Not yet fused: the chunk-local C × C work and the unit-triangular solve run as
// separate batched kernels over global tensors.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace eo::model {

struct GatedDeltaRuleOptions {
  std::int64_t chunk_size = 64;
  // L2-normalise q and k per head (rsqrt(Σx² + 1e-6), in fp32): transformers'
  // use_qk_l2norm_in_kernel, which Qwen3-Next and Qwen3.5 set.
  bool l2norm_qk = false;
  double scale = 0;  // multiplies q; 0 means 1 / sqrt(dk)
};

struct GatedDeltaRuleOutput {
  at::Tensor out;          // [B, T, Hv, dv], q's dtype
  at::Tensor final_state;  // [B, Hv, dk, dv], fp32 (float64 for float64 inputs): the state after each row's last token
};

// q, k [B, T, Hk, dk]; v [B, T, Hv, dv] with Hv a multiple of Hk (value head h reads key head
// h / (Hv / Hk), as transformers' repeat_interleave); g, beta [B, T, Hv] (g the log decay, beta the
// write strength, already through its sigmoid). Any float dtype; the arithmetic is fp32 (float64 when
// q is float64). initial_state [B, Hv, dk, dv] or undefined (zeros): the state before each row's
// first token. segment_ids int [B, T] or undefined: document ids of packed rows; where the id changes
// from one token to the next the state is reset to zero (the row's first document starts from
// initial_state). Differentiable in q, k, v, g, beta and initial_state.
// Whether fp32 on a GPU runs the chain and the UT transform as delta_rule_cuda.h's kernels or as the
// batched ATen ops every other device runs (default: the kernels); eo-delta-rule times both side by side.
void set_delta_rule_kernels_enabled(bool on);
bool delta_rule_kernels_enabled();

GatedDeltaRuleOutput gated_delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& g, const at::Tensor& beta, const at::Tensor& initial_state,
                                      const at::Tensor& segment_ids, const GatedDeltaRuleOptions& options = {});

}  // namespace eo::model
