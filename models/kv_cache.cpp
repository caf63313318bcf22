#include "models/kv_cache.h"

#include <ATen/ATen.h>

#include "common/error.h"
#include "models/moe_model.h"

namespace eo::model {

std::pair<at::Tensor, at::Tensor> KvCache::extend(int layer, const at::Tensor& k, const at::Tensor& v) {
  Layer& l = layers_.at(static_cast<std::size_t>(layer));
  EO_CHECK(!l.k.defined() || l.k.size(2) == length_, "kv cache: layer ", layer, " holds ", l.k.size(2),
           " positions, the cache ", length_);
  // One concatenation per token: a preallocated buffer would save the copy, which is small beside
  // a decode step's expert reads.
  l.k = l.k.defined() ? at::cat({l.k, k}, 2) : k.contiguous();
  l.v = l.v.defined() ? at::cat({l.v, v}, 2) : v.contiguous();
  return {l.k, l.v};
}

void cache_keys_values(const BlockContext& ctx, int layer, at::Tensor& k, at::Tensor& v) {
  if (!ctx.cache) return;
  std::tie(k, v) = ctx.cache->extend(layer, k, v);
}

at::Tensor forward_cached(MoeModel& model, const at::Tensor& ids, KvCache& cache) {
  EO_CHECK(ids.dim() == 2 && ids.size(0) == 1, "forward_cached: ids must be [1, T], got ", ids.sizes());
  const ModelConfig& c = model.config();
  const std::int64_t past = cache.length(), T = ids.size(1), all = past + T;
  const at::Device dev = model.options().device;
  Batch batch;
  batch.input_ids = ids;
  batch.positions = at::arange(past, all, at::TensorOptions().dtype(at::kLong)).view({1, T});
  BlockContext ctx = model.context(batch, false);
  if (past > 0) {
    // The queries sit at positions past ... all - 1, the keys at 0 ... all - 1: query i sees key j
    // when j <= past + i (the layers add their windows and sinks to this mask, as without a cache).
    // The prefill (past 0) keeps context()'s plain causal attention, which takes the fused kernel.
    const auto opt = at::TensorOptions().dtype(at::kBool).device(dev);
    const at::Tensor qpos = at::arange(past, all, opt.dtype(at::kLong)).view({T, 1});
    const at::Tensor kpos = at::arange(all, opt.dtype(at::kLong)).view({1, all});
    ctx.attn_mask = (kpos <= qpos).view({1, 1, T, all});
    if (c.llama4 && c.llama4->chunk > 0) {  // chunked layers: keys in the query's chunk only
      const std::int64_t chunk = c.llama4->chunk;
      ctx.chunk_mask = ctx.attn_mask & (at::floor_divide(qpos, chunk) == at::floor_divide(kpos, chunk)).view({1, 1, T, all});
    }
  }
  ctx.cache = &cache;
  at::Tensor h = model.embed(ids);
  for (int i = 0; i < model.num_layers(); ++i) {
    const DecoderBlock& b = model.block(i);
    if (b.is_moe()) model.weight_provider().stage(b.index());
    h = b.forward(h, ctx);
  }
  cache.advance(T);
  return model.head(h.narrow(1, T - 1, 1))[0][0].to(at::kCPU, at::kFloat);
}

}  // namespace eo::model
