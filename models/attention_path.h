// Which of PyTorch's scaled_dot_product_attention kernels a layer's attention runs on a CUDA GPU, as
// models/moe_model.cpp calls SDPA (attend, attend_with_sinks) and PyTorch's dispatcher picks among
// flash, memory-efficient and math (ATen's sdp_utils): the rule the step-time prediction counts with.
#pragma once

#include <cstdint>

#include "models/hf_config.h"

namespace eo::model {

enum class AttentionPath {
  Fused,   // flash attention: plain causal, heads up to 256 wide; tiles above the diagonal skipped
  Masked,  // the memory-efficient kernel with a boolean mask: every query-key tile computed
  Math,    // scores materialised ([B, heads, T, T]) and soft-maxed by separate kernels
};

// Layer `layer` of `c` at sequence `seq`. `packed`: rows hold several documents (sample_packing),
// so every layer gets the packing mask.
AttentionPath attention_path(const ModelConfig& c, int layer, std::int64_t seq, bool packed);

const char* attention_path_name(AttentionPath p);

}  // namespace eo::model
