// The NF4 expert GEMM's tensor API (the kernel: nf4_expert_gemm_cuda.h): a MoE block's frozen NF4
// experts multiplied without a dequantised bf16 bank, forward (x · W_e^T) and backward (dy · W_e,
// the input gradient; the experts are frozen, so there is no weight gradient). Not on the training
// path yet: the block still dequantises into banks (linear4bit.h) and runs grouped_mm.h's kernels.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "models/quantized_weight.h"

namespace eo::model {

// One block's experts as the kernel reads them: a device table with each expert's packed codes and
// absmax (or nested statistics) pointers, and the tensors those pointers point into (kept alive
// here). Build it once per bank, outside any CUDA graph capture (it copies the table to the GPU);
// the products below then read nothing on the host.
struct Nf4ExpertTable {
  at::Tensor sources;            // uint8 on the GPU: E entries of nf4_cuda.h's Nf4Source
  at::Tensor nested_code;        // fp32 [256] on the GPU where the statistics are nested
  std::vector<at::Tensor> keep;  // every tensor the table points into
  std::int64_t experts = 0, out = 0, in = 0;  // E, and each W_e's [out, in]
  int blocksize = 64, nested_blocksize = 256;
  bool nested = false;
};

// Whether this build holds the kernel (a CUDA build).
bool nf4_expert_gemm_built();
// Whether the kernel runs on `device`: CUDA, and the build's code there is sm_80 or newer.
bool nf4_expert_gemm_runs(const at::Device& device);
// The table of `experts` (NF4, one shape, blocksize and statistics kind, contiguous on one GPU;
// out and in multiples of 8, blocksizes powers of two). Throws, saying which, where one is not.
Nf4ExpertTable nf4_expert_table(const std::vector<const QuantizedWeight*>& experts);
// x [M, in] bf16, offsets int32 [E] cumulative row ends on x's GPU: [M, out], row group e times
// W_e^T; rows past offsets[E-1] zero.
at::Tensor nf4_grouped_mm(const at::Tensor& x, const Nf4ExpertTable& w, const at::Tensor& offsets);
// dy [M, out] bf16: [M, in], row group e times W_e (the input gradient of nf4_grouped_mm).
at::Tensor nf4_grouped_mm_dx(const at::Tensor& dy, const Nf4ExpertTable& w, const at::Tensor& offsets);

}  // namespace eo::model
