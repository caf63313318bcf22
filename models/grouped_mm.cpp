#include "models/grouped_mm.h"

#include <torch/csrc/autograd/custom_function.h>

#include <atomic>

#include "common/error.h"

#ifdef EO_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "models/grouped_mm_cuda.h"
#endif

namespace eo::model {
namespace {

// Off by default: on the H200 it ran no faster than libtorch's GEMM (docs/benchmarks.md).
std::atomic<bool> small_k_enabled{false};

#ifdef EO_WITH_CUDA
// The WMMA bf16 kernel needs sm_80 or newer.
bool device_has_bf16_mma(int device) {
  int major = 0;
  return cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess && major >= 8;
}
#endif

// b's two layouts the kernel reads: [E, K, N] contiguous, or the transposed view of a
// contiguous [E, N, K] (how B^T and A^T reach the GEMM).
bool contiguous_kn(const at::Tensor& b) {
  return b.stride(2) == 1 && b.stride(1) == b.size(2) && b.stride(0) == b.size(1) * b.size(2);
}
bool transposed_nk(const at::Tensor& b) {
  return b.stride(1) == 1 && b.stride(2) == b.size(1) && b.stride(0) == b.size(1) * b.size(2);
}

// libtorch's own backward of y = a · B_e: da = g · B_e^T over the same rows (small-K where K' = N
// is small), dB_e = a_e^T · g as the 2-D x 2-D grouped form.
struct GroupedMmFunction : public torch::autograd::Function<GroupedMmFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b,
                            const at::Tensor& offsets) {
    ctx->save_for_backward({a, b, offsets});
    return grouped_mm_product(a, b, offsets);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &a = saved[0], &b = saved[1], &offsets = saved[2];
    const at::Tensor g = grads[0].contiguous();
    at::Tensor da, db;
    if (ctx->needs_input_grad(0)) da = grouped_mm_product(g, b.transpose(1, 2), offsets);
    if (ctx->needs_input_grad(1)) db = at::_grouped_mm(a.t(), g, offsets);
    return {da, db, at::Tensor()};
  }
};

}  // namespace

void set_small_k_kernel_enabled(bool on) { small_k_enabled = on; }
bool small_k_kernel_enabled() { return small_k_enabled; }

bool small_k_kernel_applies(const at::Tensor& a, const at::Tensor& b) {
#ifdef EO_WITH_CUDA
  if (!a.is_cuda() || a.dim() != 2 || b.dim() != 3 || a.device() != b.device()) return false;
  if (a.scalar_type() != at::kBFloat16 || b.scalar_type() != at::kBFloat16) return false;
  const std::int64_t K = a.size(1), N = b.size(2);
  if (b.size(1) != K || K > grouped_mm::cuda::kMaxK || K % 8 || N % 8 || K == 0) return false;
  if (b.size(0) > grouped_mm::cuda::kMaxExperts) return false;
  if (!contiguous_kn(b) && !transposed_nk(b)) return false;
  if (reinterpret_cast<std::uintptr_t>(b.data_ptr()) % 16) return false;
  return device_has_bf16_mma(a.device().index());
#else
  (void)a;
  (void)b;
  return false;
#endif
}

at::Tensor small_k_grouped_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offsets) {
  EO_CHECK(small_k_kernel_applies(a, b), "small_k_grouped_mm: a ", a.sizes(), " ", a.scalar_type(), " on ", a.device(),
           ", b ", b.sizes(), " strides ", b.strides(), ": not a shape, layout or device the small-K kernel takes");
#ifdef EO_WITH_CUDA
  EO_CHECK(offsets.dim() == 1 && offsets.size(0) == b.size(0) && offsets.scalar_type() == at::kInt &&
               offsets.device() == a.device(),
           "small_k_grouped_mm: offsets must be int32 [", b.size(0), "] on ", a.device(), ", got ", offsets.sizes(), " ",
           offsets.scalar_type());
  at::Tensor ac = a.contiguous();
  if (reinterpret_cast<std::uintptr_t>(ac.data_ptr()) % 16) ac = ac.clone();  // a view at an odd offset
  const at::Tensor oc = offsets.contiguous();
  at::Tensor out = at::empty({a.size(0), b.size(2)}, a.options());
  c10::cuda::CUDAGuard guard(a.device());
  const cudaError_t rc = grouped_mm::cuda::small_k_grouped_mm(
      ac.data_ptr(), b.data_ptr(), transposed_nk(b), oc.data_ptr<int>(), static_cast<int>(b.size(0)), out.data_ptr(),
      a.size(0), b.size(2), static_cast<int>(a.size(1)), c10::cuda::getCurrentCUDAStream(a.device().index()).stream());
  EO_CHECK(rc == cudaSuccess, "small-K grouped GEMM: ", cudaGetErrorString(rc));
  return out;
#else
  (void)offsets;
  return {};
#endif
}

at::Tensor grouped_mm_product(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offsets) {
  if (small_k_enabled && small_k_kernel_applies(a, b)) return small_k_grouped_mm(a, b, offsets);
  return at::_grouped_mm(a, b, offsets);
}

at::Tensor grouped_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offsets) {
  // Off, libtorch's own op and backward: the path the step was measured on.
  if (!small_k_enabled) return at::_grouped_mm(a, b, offsets);
  return GroupedMmFunction::apply(a, b, offsets);
}

}  // namespace eo::model
