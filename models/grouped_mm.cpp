#include "models/grouped_mm.h"

#include <torch/csrc/autograd/custom_function.h>

#include <atomic>
#include <optional>

#include "common/error.h"

#ifdef EO_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common/cuda_check.h"
#include "models/expert_gemm_cuda.h"
#include "models/grouped_mm_cuda.h"
#endif

namespace eo::model {
namespace {

// Off by default: on the H200 it ran no faster than libtorch's GEMM (docs/benchmarks.md).
std::atomic<bool> small_k_enabled{false};
std::atomic<ExpertGemm> expert_gemm_kernel{ExpertGemm::kTorch};

#ifdef EO_WITH_CUDA
// What eo's grouped kernels compute a dtype as (expert_gemm_cuda.h); nullopt for any other dtype.
std::optional<expert_gemm::cuda::DType> kernel_dtype(at::ScalarType t) {
  if (t == at::kBFloat16) return expert_gemm::cuda::DType::BF16;
  if (t == at::kHalf) return expert_gemm::cuda::DType::F16;
  return std::nullopt;
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

#ifdef EO_WITH_CUDA
// What the portable kernel takes: a [M, K] · b [E, K, N] on one GPU, both in a dtype it computes
// there (portable_kernel_takes), K and N multiples of 8 (16-byte rows), b in one of the two layouts
// above, 16-byte aligned.
bool grouped_operands(const at::Tensor& a, const at::Tensor& b) {
  if (!a.is_cuda() || a.dim() != 2 || b.dim() != 3 || a.device() != b.device()) return false;
  if (a.scalar_type() != b.scalar_type()) return false;
  if (b.size(1) != a.size(1) || a.size(1) % 8 || b.size(2) % 8) return false;
  if (!contiguous_kn(b) && !transposed_nk(b)) return false;
  if (reinterpret_cast<std::uintptr_t>(b.data_ptr()) % 16) return false;
  return portable_kernel_takes(a.scalar_type(), a.device());
}

void check_offsets(const at::Tensor& offsets, std::int64_t experts, const at::Tensor& a, const char* what) {
  EO_CHECK(offsets.dim() == 1 && offsets.size(0) == experts && offsets.scalar_type() == at::kInt &&
               offsets.device() == a.device(),
           what, ": offsets must be int32 [", experts, "] on ", a.device(), ", got ", offsets.sizes(), " ",
           offsets.scalar_type(), " on ", offsets.device());
}
#endif

// The backward of y = a · B_e, as libtorch's: da = g · B_e^T over the same rows (small-K where K' = N
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
    if (ctx->needs_input_grad(1)) db = grouped_mm_contract(a, g, offsets);
    return {da, db, at::Tensor()};
  }
};

}  // namespace

void set_small_k_kernel_enabled(bool on) { small_k_enabled = on; }
bool small_k_kernel_enabled() { return small_k_enabled; }

bool small_k_kernel_applies(const at::Tensor& a, const at::Tensor& b) {
#ifdef EO_WITH_CUDA
  return a.scalar_type() == at::kBFloat16 && grouped_operands(a, b) && a.size(1) > 0 &&
         a.size(1) <= grouped_mm::cuda::kMaxK && b.size(0) <= grouped_mm::cuda::kMaxExperts;
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
  check_offsets(offsets, b.size(0), a, "small_k_grouped_mm");
  at::Tensor ac = a.contiguous();
  if (reinterpret_cast<std::uintptr_t>(ac.data_ptr()) % 16) ac = ac.clone();  // a view at an odd offset
  const at::Tensor oc = offsets.contiguous();
  at::Tensor out = at::empty({a.size(0), b.size(2)}, a.options());
  c10::cuda::CUDAGuard guard(a.device());
  const cudaError_t rc = grouped_mm::cuda::small_k_grouped_mm(
      ac.data_ptr(), b.data_ptr(), transposed_nk(b), oc.data_ptr<int>(), static_cast<int>(b.size(0)), out.data_ptr(),
      a.size(0), b.size(2), static_cast<int>(a.size(1)), c10::cuda::getCurrentCUDAStream(a.device().index()).stream());
  EO_CUDA_CHECK(rc, "small-K grouped GEMM");
  return out;
#else
  (void)offsets;
  return {};
#endif
}

void set_expert_gemm(ExpertGemm kernel) { expert_gemm_kernel = kernel; }
ExpertGemm expert_gemm() { return expert_gemm_kernel; }
ExpertGemm auto_expert_gemm(int compute_capability_major, at::ScalarType dtype) {
  const bool device_scheduled = dtype == at::kBFloat16 && (compute_capability_major == 9 || compute_capability_major == 10);
  return device_scheduled ? ExpertGemm::kTorch : ExpertGemm::kPortable;
}

bool portable_expert_gemm_built() {
#ifdef EO_WITH_CUDA
  return true;
#else
  return false;
#endif
}

bool portable_kernel_takes(at::ScalarType dtype, const at::Device& device) {
#ifdef EO_WITH_CUDA
  const auto d = kernel_dtype(dtype);
  if (!d || !device.is_cuda()) return false;
  c10::cuda::CUDAGuard guard(device);
  return expert_gemm::cuda::takes(*d);
#else
  (void)dtype;
  (void)device;
  return false;
#endif
}

bool grouped_expert_gemm_runs(at::ScalarType dtype, const at::Device& device) {
  return grouped_expert_gemm_runs(expert_gemm_kernel, dtype, device);
}

bool grouped_expert_gemm_runs(ExpertGemm kernel, at::ScalarType dtype, const at::Device& device) {
  if (!device.is_cuda()) return false;
  if (dtype == at::kBFloat16) return true;
  return dtype == at::kHalf && kernel == ExpertGemm::kPortable && portable_kernel_takes(dtype, device);
}

bool portable_grouped_mm_applies(const at::Tensor& a, const at::Tensor& b) {
#ifdef EO_WITH_CUDA
  return grouped_operands(a, b);
#else
  (void)a;
  (void)b;
  return false;
#endif
}

#ifdef EO_WITH_CUDA
namespace {
// a contiguous and 16-byte aligned (a view at an odd offset is copied).
at::Tensor aligned_rows(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  return reinterpret_cast<std::uintptr_t>(c.data_ptr()) % 16 ? c.clone() : c;
}
at::Tensor workspace_for(const at::Tensor& like, std::int64_t experts) {
  const auto bytes = static_cast<std::int64_t>(expert_gemm::cuda::workspace_bytes(static_cast<int>(experts)));
  return at::empty({std::max<std::int64_t>(bytes, 16)}, like.options().dtype(at::kByte));
}
}  // namespace
#endif

at::Tensor portable_grouped_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offsets) {
  EO_CHECK(portable_grouped_mm_applies(a, b), "portable grouped GEMM: a ", a.sizes(), " ", a.scalar_type(), " on ",
           a.device(), ", b ", b.sizes(), " strides ", b.strides(),
           ": not a shape, layout or device it takes (CUDA bf16 on sm_80+ or fp16 on sm_75+, K and N multiples of 8)");
#ifdef EO_WITH_CUDA
  check_offsets(offsets, b.size(0), a, "portable grouped GEMM");
  const at::Tensor ac = aligned_rows(a), oc = offsets.contiguous();
  at::Tensor out = at::empty({a.size(0), b.size(2)}, a.options());
  c10::cuda::CUDAGuard guard(a.device());
  const at::Tensor ws = workspace_for(a, b.size(0));
  const cudaError_t rc = expert_gemm::cuda::grouped_rows(
      *kernel_dtype(a.scalar_type()), ac.data_ptr(), b.data_ptr(), transposed_nk(b), oc.data_ptr<int>(),
      static_cast<int>(b.size(0)), out.data_ptr(), a.size(0), b.size(2), a.size(1), ws.data_ptr(),
      c10::cuda::getCurrentCUDAStream(a.device().index()).stream());
  EO_CUDA_CHECK(rc, "portable grouped GEMM");
  return out;
#else
  (void)offsets;
  return {};
#endif
}

at::Tensor grouped_mm_contract(const at::Tensor& a, const at::Tensor& g, const at::Tensor& offsets) {
#ifdef EO_WITH_CUDA
  const bool portable = expert_gemm_kernel == ExpertGemm::kPortable && a.is_cuda() && a.dim() == 2 && g.dim() == 2 &&
                        a.device() == g.device() && a.size(0) == g.size(0) && a.scalar_type() == g.scalar_type() &&
                        a.size(1) % 8 == 0 && g.size(1) % 8 == 0 && portable_kernel_takes(a.scalar_type(), a.device());
  if (portable) {
    const std::int64_t E = offsets.size(0);
    check_offsets(offsets, E, a, "portable grouped GEMM (a^T g)");
    const at::Tensor ac = aligned_rows(a), gc = aligned_rows(g), oc = offsets.contiguous();
    at::Tensor out = at::empty({E, a.size(1), g.size(1)}, a.options());
    c10::cuda::CUDAGuard guard(a.device());
    const at::Tensor ws = workspace_for(a, E);
    const cudaError_t rc = expert_gemm::cuda::grouped_contract(
        *kernel_dtype(a.scalar_type()), ac.data_ptr(), gc.data_ptr(), oc.data_ptr<int>(), static_cast<int>(E),
        out.data_ptr(), a.size(0), a.size(1), g.size(1), ws.data_ptr(),
        c10::cuda::getCurrentCUDAStream(a.device().index()).stream());
    EO_CUDA_CHECK(rc, "portable grouped GEMM (a^T g)");
    return out;
  }
#endif
  return at::_grouped_mm(a.t(), g, offsets);
}

at::Tensor grouped_mm_product(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offsets) {
  if (expert_gemm_kernel == ExpertGemm::kPortable && portable_grouped_mm_applies(a, b))
    return portable_grouped_mm(a, b, offsets);
  if (small_k_enabled && small_k_kernel_applies(a, b)) return small_k_grouped_mm(a, b, offsets);
  return at::_grouped_mm(a, b, offsets);
}

at::Tensor grouped_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offsets) {
  // libtorch's own op and backward where neither of eo's kernels is selected: the path the step
  // was measured on.
  if (!small_k_enabled && (expert_gemm_kernel == ExpertGemm::kTorch || !a.is_cuda())) return at::_grouped_mm(a, b, offsets);
  return GroupedMmFunction::apply(a, b, offsets);
}

}  // namespace eo::model
