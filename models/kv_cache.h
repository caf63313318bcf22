// Incremental decoding: the state each layer keeps between forwards so that a prompt runs once
// (prefill) and every new token after it runs alone (decode).
//
// Softmax-attention layers keep their keys and values after RoPE and q/k norms, [B, kv heads,
// positions, D] (latent attention: the keys and values kv_b_proj expands, per head); each forward
// appends its own and attends over all of them with a mask for its queries' absolute positions
// (causal, and the layer's sliding window, Llama 4's chunks, gpt-oss's sinks as without a cache).
// Gated delta-rule layers keep their conv1d's last K - 1 inputs and their recurrent state.
// A forward with a cache sees one row (batch 1) and no packing.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace eo::model {

class MoeModel;
struct BlockContext;

class KvCache {
 public:
  explicit KvCache(int layers) : layers_(static_cast<std::size_t>(layers)) {}
  // Positions already held (the next forward's first position).
  std::int64_t length() const { return length_; }
  // Appends a softmax-attention layer's keys and values [B, heads, T, D] of this forward to the
  // layer's and returns all of them, [B, heads, length() + T, D].
  std::pair<at::Tensor, at::Tensor> extend(int layer, const at::Tensor& k, const at::Tensor& v);
  // A delta-rule layer's conv1d inputs (its last K - 1, [B, K - 1, C]) and recurrent state
  // ([B, Hv, dk, dv], fp32); undefined before the first forward.
  at::Tensor& conv_state(int layer) { return layers_.at(static_cast<std::size_t>(layer)).conv; }
  at::Tensor& recurrent_state(int layer) { return layers_.at(static_cast<std::size_t>(layer)).state; }
  // Called once per forward, after every layer: the new tokens become part of the cache.
  void advance(std::int64_t tokens) { length_ += tokens; }

 private:
  struct Layer {
    at::Tensor k, v, conv, state;
  };
  std::vector<Layer> layers_;
  std::int64_t length_ = 0;
};

// For the attention code: with ctx.cache set, k and v [B, heads, T, D] become the layer's cached
// keys and values followed by these (KvCache::extend); without, they stay as they are.
void cache_keys_values(const BlockContext& ctx, int layer, at::Tensor& k, at::Tensor& v);

// The next-token logits (fp32 [V], on the host) after ids [1, T] at positions cache.length() ...,
// which the cache then holds. The model stages each MoE block's experts as its forward does.
at::Tensor forward_cached(MoeModel& model, const at::Tensor& ids, KvCache& cache);

}  // namespace eo::model
