// The language-model loss without the whole logits tensor.
//
// For a 150k vocabulary and 8k tokens the fp32 logits alone are 5 GB; the loss needs only each
// row's log-sum-exp and target logit. So the head runs chunk by chunk: forward keeps the
// log-sum-exp per row, backward recomputes a chunk's logits to form its gradient. Per row the
// arithmetic is transformers' (logits in the compute dtype, upcast to fp32, cross entropy).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace eo::model {

// Σ over rows with target != -100 of CE(hidden · weight^T, target), fp32 scalar.
// hidden [N, H] (compute dtype, differentiable), weight [V, H] frozen, targets int64 [N].
// chunk_rows = 0 picks loss_chunk_rows(rows, vocab). softcap > 0: the logits are
// softcap · tanh(logits / softcap) first (Gemma's final_logit_softcapping), in fp32.
// Rows per chunk: about 128 MiB of fp32 logits (the memory plan counts the same).
std::int64_t loss_chunk_rows(std::int64_t rows, std::int64_t vocab);
at::Tensor chunked_linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                                        std::int64_t chunk_rows = 0, double softcap = 0);

}  // namespace eo::model
