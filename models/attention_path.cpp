#include "models/attention_path.h"

namespace eo::model {

AttentionPath attention_path(const ModelConfig& c, int layer, std::int64_t seq, bool packed) {
  // Flash attention takes heads up to 256 wide and no mask; the memory-efficient kernel takes a
  // mask; wider heads (Gemma 4's 512-wide full layers) fall to the math path.
  if (c.head_dim_at(layer) > 256) return AttentionPath::Math;
  // A mask rides along with sinks and sliding windows (attend_with_sinks), chunked layers longer
  // than a chunk (BlockContext::chunk_mask) and packed rows (BlockContext::attn_mask).
  const bool chunked = c.is_chunked_layer(layer) && seq > c.llama4->chunk;
  if (packed || c.attention_sinks || c.is_sliding_layer(layer) || chunked) return AttentionPath::Masked;
  return AttentionPath::Fused;
}

const char* attention_path_name(AttentionPath p) {
  switch (p) {
    case AttentionPath::Fused: return "fused";
    case AttentionPath::Masked: return "masked";
    case AttentionPath::Math: return "math";
  }
  return "?";
}

}  // namespace eo::model
