// Which attention kernel a layer runs on a CUDA GPU, as models/moe_model.cpp calls it (attend,
// attend_with_sinks) and PyTorch's dispatcher picks between flash and memory-efficient (ATen's
// sdp_utils): the one rule that the model's attention and the step-time prediction both follow.
// And the documents of packed rows, as flash attention's variable-length form reads them.
// Flash's own forms (the variable-length form of packed rows, the local window of sliding layers)
// run only where PyTorch's flash kernels do (flash_attention_runs); elsewhere those layers take a mask.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>

#include "models/hf_config.h"

namespace eo::model {

enum class AttentionPath {
  Fused,   // flash attention: causal, heads up to 256 wide; tiles above the diagonal skipped, and on
           // sliding layers (Gemma 4) tiles left of the window too (flash's local window)
  Varlen,  // packed rows through flash attention's variable-length form: each document causal on its
           // own (within the window on sliding layers), tiles above each document's diagonal and
           // across documents skipped
  Masked,  // the memory-efficient kernel: with a boolean mask, or (heads over 256, Gemma 4's full
           // layers) kv heads repeated; every query-key tile counted as computed
};

// Layer `layer` of `c` at sequence `seq`. `packed`: rows hold several documents (sample_packing).
// `flash`: flash's own forms run where the rows are (flash_attention_runs); without them packed rows
// take the packing mask on every layer, and sliding layers their window as a mask.
AttentionPath attention_path(const ModelConfig& c, int layer, std::int64_t seq, bool packed, bool flash = true);
// Whether the layer's path is one of flash's own forms, which need flash_attention_runs: Varlen, or
// Fused on a sliding layer (its local window).
bool needs_flash_forms(const ModelConfig& c, int layer, AttentionPath path);

const char* attention_path_name(AttentionPath p);

// How packed rows attend in `c` at sequence `seq` where `flash` says whether flash's own forms run,
// for the run's log: the attention layers by path, with the reason where it is the mask.
std::string packed_attention_summary(const ModelConfig& c, std::int64_t seq, bool flash);

// Whether PyTorch's flash kernels, and with them flash's variable-length form and local window, run
// on `device` in `dtype`: a CUDA GPU of sm_80 or newer and bf16 or fp16.
bool flash_attention_runs(const c10::Device& device, c10::ScalarType dtype);

// The documents of packed rows as flash's variable-length form takes them: int32 cumulative starts
// [n + 1] over the B·T tokens of `segment_ids` (host, [B, T], any integer type; each run of equal ids
// in a row is one document, padding included, whose outputs are unused), padded with empty documents
// to a power of two at least 8 entries long, so that CUDA graphs see a few shapes and not one per
// batch. Undefined when an id comes back after another in a row: the packing mask then differs
// from documents taken run by run, and the mask must be used.
at::Tensor packed_document_starts(const at::Tensor& segment_ids);

}  // namespace eo::model
