// A frozen NF4 linear whose backward re-fetches its weight (design.md §2.2).
//
// The autograd node keeps only a handle — (provider, layer, expert, matrix) for experts, or a
// pointer to a module-owned QuantizedWeight for resident linears — never the packed bytes nor
// the dequantised matrix. Backward asks the handle for the bytes current *then*, dequantises
// into a temporary and forms dX = dY · W. The weight is frozen: it gets no gradient, so the
// input activation is not needed either and is not saved.
#pragma once

#include <ATen/core/Tensor.h>

#include "models/quantized_weight.h"
#include "models/weights.h"

namespace eo::model {

struct WeightHandle {
  WeightProvider* provider = nullptr;        // experts: fetched through the provider
  int layer = -1, expert = -1;
  ExpertMatrix matrix = ExpertMatrix::Gate;
  const QuantizedWeight* owned = nullptr;  // resident linears: owned by the module

  const QuantizedWeight& fetch() const;
};

// y = x · W^T with W = dequantize(handle.fetch()) in x's dtype.
at::Tensor linear4bit(const at::Tensor& x, const WeightHandle& handle);

// One matrix of every expert of a MoE block, applied to token-sorted rows with one grouped GEMM:
// rows [offsets[e-1], offsets[e]) of x go through expert e. offsets is int32 [experts] on x's
// device (cumulative row counts), so no count ever travels to the host.
//   4-bit: the experts' weights (NF4, MXFP4 or NVFP4, nf4.h) are fetched through `provider` and
//   dequantised together into one temporary [E, out, in] tensor, in forward and again in backward
//   (never saved). Gate and up
//   stay separate GEMMs so that only one matrix bank exists at a time.
//   With max_bytes > 0 the bank is dequantised in slices of at most that many bytes (at least
//   64 rows or columns each): forward in slices of output rows, backward (dX = dY · W) in slices
//   of input columns, each its own grouped GEMM over the same offsets writing its columns of
//   the result. The same sums in the same order per output element, over a bank that never
//   exists whole: the small-card setting (LoadOptions::expert_bank_bytes).
//   Dense: `dense` [E, out, in] is used as it is (frozen, saved by reference).
//   keep_for_backward: a whole 4-bit bank dequantised in forward is kept for this use's backward
//   (dX needs the same bank) instead of being dequantised again. Under checkpointing the
//   recompute's backward follows at once, so the bank lives a short while (BankReuse).
struct ExpertBank {
  WeightProvider* provider = nullptr;
  // Experts [first, first + experts) of the block (a group, when the provider streams a block in
  // groups: WeightProvider::expert_group_size); offsets then count those experts' rows only.
  int layer = -1, experts = 0, first = 0;
  ExpertMatrix matrix = ExpertMatrix::Gate;
  at::Tensor dense;  // defined for dense (unquantised) experts
  std::int64_t max_bytes = 0;  // NF4: largest dequantised slice; 0 = the whole bank at once
  bool keep_for_backward = false;
};
// Which banks a checkpointed block's recompute keeps for its backward (expert_bank_reuse):
// None dequantises every bank again in backward; Down keeps the down projection's, the last one
// the recompute dequantises, which the backward's first step needs anyway (no more peak memory);
// All keeps gate's, up's and down's (two more banks at the peak; backward dequantises nothing).
enum class BankReuse { None, Down, All };
// Banks (or bank slices) dequantised by grouped_expert_linear in this process (instrumentation
// for tests).
std::int64_t grouped_bank_dequantisations();
// The slice length (rows or columns of each expert matrix) that keeps an [E, len, other] slice of
// `elem_bytes` values within max_bytes: a multiple of 64, at least 64, at most `full`.
std::int64_t bank_slice(std::int64_t full, std::int64_t experts, std::int64_t other, std::int64_t elem_bytes,
                        std::int64_t max_bytes);
at::Tensor grouped_expert_linear(const at::Tensor& x, const at::Tensor& offsets, const ExpertBank& bank);
// Whether grouped_expert_linear can run here: a CUDA tensor the grouped expert GEMMs take
// (grouped_expert_gemm_runs: bf16, or fp16 on the portable kernel), unless switched off (tests
// compare it with the per-expert loop). set_grouped_gemm_on_cpu lets tests run the same grouped
// path on fp32 CPU tensors (libtorch's CPU _grouped_mm), so the GPU's code path is checked against
// the loop on a machine without one; training never sets it.
bool grouped_gemm_available(const at::Tensor& x);
void set_grouped_gemm_enabled(bool enabled);
void set_grouped_gemm_on_cpu(bool enabled);

// out = x.index_select(0, index) for the MoE dispatch, whose backward is a gather too: `inverse`
// lists, for every row of x in order, the rows of `out` that copied it (`fanout` per row of x,
// consecutive), so dX = grad.index_select(0, inverse).view(rows, fanout, -1).sum(1). libtorch's
// index_select backward is an atomic index_add: slower on a GPU (measured 1.1 ms per call on
// Qwen3-30B-A3B shapes at 8,192 tokens), rounding every add in bf16, and not deterministic.
at::Tensor gather_rows(const at::Tensor& x, const at::Tensor& index, const at::Tensor& inverse, std::int64_t fanout);
// gather_rows as two outputs over one buffer (the second an alias of the first) for two sets of
// consumers: the expert GEMMs read the first, the expert LoRA the second. Autograd would add the
// two sets' gradients in a pass of its own ([N, hidden] read twice, written once); here the
// dispatch's backward sums them inside its gather, in fp32.
std::pair<at::Tensor, at::Tensor> gather_rows_twice(const at::Tensor& x, const at::Tensor& index, const at::Tensor& inverse,
                                                    std::int64_t fanout);

// The MoE combine: out[t] = sum over j < k of weights[t, j] * (y + addend)[position[t * k + j]],
// y [tokens * k, hidden] in expert order, weights [tokens, k] (the routing weights), addend
// (y's shape, may be undefined: the down projection's LoRA delta). position is order's inverse
// and token_of = order / k. One pass each way (fused.h), fp32 sums rounded once; no [tokens, k,
// hidden] gather is written in forward or backward. Gradients: y's (and addend's, the same
// tensor) the weight times its token's gradient; weights' the dot of the token's gradient with
// the row.
at::Tensor combine_rows(const at::Tensor& y, const at::Tensor& addend, const at::Tensor& weights, const at::Tensor& position,
                        const at::Tensor& token_of, const at::Tensor& order);

}  // namespace eo::model
