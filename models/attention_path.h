// Which attention kernel a layer runs on a CUDA GPU, as models/moe_model.cpp calls it (attend,
// attend_with_sinks) and PyTorch's dispatcher picks among flash, memory-efficient and math (ATen's
// sdp_utils): the one rule that the model's attention and the step-time prediction both follow.
// And the documents of packed rows, as flash attention's variable-length form reads them.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>

#include "models/hf_config.h"

namespace eo::model {

enum class AttentionPath {
  Fused,   // flash attention: plain causal, heads up to 256 wide; tiles above the diagonal skipped
  Varlen,  // packed rows through flash attention's variable-length form: each document causal on its
           // own, tiles above each document's diagonal and across documents skipped
  Masked,  // the memory-efficient kernel with a boolean mask: every query-key tile computed
  Math,    // scores materialised ([B, heads, T, T]) and soft-maxed by separate kernels
};

// Layer `layer` of `c` at sequence `seq`. `packed`: rows hold several documents (sample_packing).
// `varlen`: flash's variable-length form runs where the rows are (flash_varlen_runs); without it
// packed rows take the packing mask on every layer.
AttentionPath attention_path(const ModelConfig& c, int layer, std::int64_t seq, bool packed, bool varlen = true);

const char* attention_path_name(AttentionPath p);

// How packed rows attend in `c` at sequence `seq` where `varlen` says whether flash's variable-length
// form runs, for the run's log: the attention layers by path, with the reason where it is the mask.
std::string packed_attention_summary(const ModelConfig& c, std::int64_t seq, bool varlen);

// Whether flash attention's variable-length form runs on `device` in `dtype`: a CUDA GPU of sm_80 or
// newer (PyTorch's flash kernels) and bf16 or fp16.
bool flash_varlen_runs(const c10::Device& device, c10::ScalarType dtype);

// The documents of packed rows as flash's variable-length form takes them: int32 cumulative starts
// [n + 1] over the B·T tokens of `segment_ids` (host, [B, T], any integer type; each run of equal ids
// in a row is one document, padding included, whose outputs are unused), padded with empty documents
// to a power of two at least 8 entries long, so that CUDA graphs see a few shapes and not one per
// batch. Undefined when an id comes back after another in a row: the packing mask then differs
// from documents taken run by run, and the mask must be used.
at::Tensor packed_document_starts(const at::Tensor& segment_ids);

}  // namespace eo::model
