// y = a · B_e on row groups (rows [offsets[e-1], offsets[e]) through expert e), with autograd:
// at::_grouped_mm's 2-D x 3-D form and its backward. With the small-K kernel turned on, every
// product whose contraction is small (the LoRA rank: K <= 64) runs on eo's own kernel on a GPU
// (grouped_mm_cuda.h): the expert LoRA's B GEMM forward (down [N, r] · B^T) and its A GEMM's dX
// (d_down [N, r] · A), the GEMMs whose outputs are [N, in] or [N, out] wide.
//
// The kernel is off by default because the step is slower with it: on the H200 it matches
// libtorch's CUTLASS GEMM bit for bit and is faster per call (1.16x over a block's 20 LoRA GEMMs),
// but the every-linear resident step went from 0.285 to 0.290 s at micro-batch 1
// (docs/benchmarks-history.md, "Issue #14's rows at e456ade").
#pragma once

#include <ATen/ATen.h>

namespace eo::model {

// a [M, K], b [E, K, N] (any strides: a transposed view is fine), offsets int32 [E] on a's
// device: [M, N] in a's dtype.
at::Tensor grouped_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offsets);

// The forward product alone, no autograd: the portable kernel where it is selected and applies,
// else the small-K kernel where it is on and applies, else at::_grouped_mm.
at::Tensor grouped_mm_product(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offsets);
// The small-K kernel itself (tests, eo-lora-gemm); throws where small_k_kernel_applies is false.
at::Tensor small_k_grouped_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offsets);
// Whether a · b runs on the small-K kernel: CUDA (sm_80+), bf16, K <= 64 and K, N multiples of
// 8, at most 1024 experts, b contiguous as [E, K, N] or as the transposed view of a contiguous [E, N, K].
bool small_k_kernel_applies(const at::Tensor& a, const at::Tensor& b);
// Whether grouped_mm and grouped_mm_product use the small-K kernel (default off).
void set_small_k_kernel_enabled(bool on);
bool small_k_kernel_enabled();

// Which kernel runs the expert GEMMs on a GPU (the `expert_gemm` key). kTorch: at::_grouped_mm,
// which has a device-scheduled kernel only for bf16 on compute capability 9.x / 10.x and elsewhere
// reads the offsets on the host and loops over experts (no CUDA graph can hold that). kPortable:
// CUTLASS's grouped kernel (expert_gemm_cuda.h), sizes read on the device: bf16 on sm_80 to
// sm_120, fp16 on sm_75 to sm_120. Process-wide, set once at start from the run's decision (default
// kTorch): the dispatch inside grouped_mm reads it. CPU tensors always take libtorch's op.
enum class ExpertGemm { kTorch, kPortable };
void set_expert_gemm(ExpertGemm kernel);
ExpertGemm expert_gemm();
// The rule for `expert_gemm: auto`: torch where its kernel is device-scheduled for the compute
// dtype (bf16 on 9.x / 10.x), portable elsewhere (fp16 on every card).
ExpertGemm auto_expert_gemm(int compute_capability_major, at::ScalarType dtype);
// Whether this build holds the portable kernel (a CUDA build: CUTLASS is then required).
bool portable_expert_gemm_built();
// Whether the portable kernel computes `dtype` on `device`: bf16 where the build's code running
// there is sm_80 or newer, fp16 where it is sm_75 or newer (expert_gemm_cuda.h, takes). A compute_75
// PTX build on an sm_90 card serves fp16 only.
bool portable_kernel_takes(at::ScalarType dtype, const at::Device& device);
// Whether a MoE block in `dtype` on `device` runs its expert GEMMs (base and LoRA) as grouped GEMMs
// (grouped_mm, grouped_mm_contract): bf16 on a GPU (libtorch's op or the portable kernel); fp16
// where the portable kernel is selected and takes fp16 there. Otherwise the block loops over its
// experts, reading the routing counts on the host (no CUDA graph holds that).
// With `kernel` given: the same rule for a kernel not (yet) set process-wide.
bool grouped_expert_gemm_runs(at::ScalarType dtype, const at::Device& device);
bool grouped_expert_gemm_runs(ExpertGemm kernel, at::ScalarType dtype, const at::Device& device);
// Whether the portable kernel takes a · b: CUDA, a dtype portable_kernel_takes, K and N multiples
// of 8 (16-byte rows), b [E, K, N] contiguous or the transposed view of a contiguous [E, N, K].
bool portable_grouped_mm_applies(const at::Tensor& a, const at::Tensor& b);
// The portable kernel itself (tests, benchmarks); throws where it does not apply.
at::Tensor portable_grouped_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offsets);
// a^T · g per row group: a [M, K], g [M, N] -> [E, K, N] (at::_grouped_mm(a.t(), g, offsets)); the
// weight gradient of grouped_mm. Portable where it applies (K, N multiples of 8), libtorch's op
// otherwise.
at::Tensor grouped_mm_contract(const at::Tensor& a, const at::Tensor& g, const at::Tensor& offsets);

}  // namespace eo::model
