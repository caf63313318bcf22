#include "models/nf4_expert_gemm.h"

#include <cstring>

#include "common/error.h"

#ifdef EO_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common/cuda_check.h"
#include "models/nf4_expert_gemm_cuda.h"
#endif

namespace eo::model {

bool nf4_expert_gemm_built() {
#ifdef EO_WITH_CUDA
  return true;
#else
  return false;
#endif
}

bool nf4_expert_gemm_runs(const at::Device& device) {
#ifdef EO_WITH_CUDA
  if (!device.is_cuda()) return false;
  c10::cuda::CUDAGuard guard(device);
  return nf4_gemm::cuda::available() == cudaSuccess;
#else
  (void)device;
  return false;
#endif
}

Nf4ExpertTable nf4_expert_table(const std::vector<const QuantizedWeight*>& experts) {
#ifndef EO_WITH_CUDA
  (void)experts;
  EO_FAIL("NF4 expert GEMM: this build has no CUDA kernels (a CUDA libtorch builds them)");
#else
  EO_CHECK(!experts.empty(), "NF4 expert GEMM: no experts");
  const QuantizedWeight& first = *experts.front();
  EO_CHECK(first.format == QuantFormat::Nf4 && first.shape.size() == 2, "NF4 expert GEMM: expert 0 is ",
           quant_format_name(first.format), " with ", first.shape.size(), " dimensions, not a 2-D NF4 weight");
  const at::Device dev = first.packed.device();
  EO_CHECK(dev.is_cuda(), "NF4 expert GEMM: the experts are on ", dev, ", not a GPU");
  Nf4ExpertTable t;
  t.experts = static_cast<std::int64_t>(experts.size());
  t.out = first.shape[0];
  t.in = first.shape[1];
  t.blocksize = first.blocksize;
  t.nested = first.nested.has_value();
  auto power_of_two = [](int n) { return n > 0 && (n & (n - 1)) == 0; };
  EO_CHECK(t.out % 8 == 0 && t.in % 8 == 0 && t.blocksize >= 8 && power_of_two(t.blocksize),
           "NF4 expert GEMM: experts [", t.out, ", ", t.in, "] with blocksize ", t.blocksize,
           ": the kernel needs out and in multiples of 8 and the blocksize a power of two of at least 8");
  if (t.nested) {
    t.nested_blocksize = first.nested->nested_blocksize;
    EO_CHECK(power_of_two(t.nested_blocksize), "NF4 expert GEMM: nested blocksize ", t.nested_blocksize,
             " is not a power of two");
    t.nested_code = first.nested->nested_code.to(dev, at::kFloat).contiguous();
    t.keep.push_back(t.nested_code);
  }
  std::vector<nf4::cuda::Nf4Source> sources;
  sources.reserve(experts.size());
  auto on_gpu = [&](const at::Tensor& x, at::ScalarType dtype, std::size_t e, const char* what) {
    EO_CHECK(x.defined() && x.device() == dev && x.scalar_type() == dtype && x.is_contiguous(),
             "NF4 expert GEMM: expert ", e, "'s ", what, " is not a contiguous ", dtype, " tensor on ", dev);
    t.keep.push_back(x);
  };
  for (std::size_t e = 0; e < experts.size(); ++e) {
    const QuantizedWeight& q = *experts[e];
    EO_CHECK(q.format == QuantFormat::Nf4 && q.shape == first.shape && q.blocksize == first.blocksize &&
                 q.nested.has_value() == t.nested &&
                 (!t.nested || q.nested->nested_blocksize == t.nested_blocksize),
             "NF4 expert GEMM: expert ", e, " differs from expert 0 in format, shape, blocksize or statistics");
    on_gpu(q.packed, at::kByte, e, "packed codes");
    // The kernel reads 8 codes at a time as one 4-byte word.
    EO_CHECK(reinterpret_cast<std::uintptr_t>(q.packed.data_ptr()) % 4 == 0, "NF4 expert GEMM: expert ", e,
             "'s packed codes are not 4-byte aligned");
    nf4::cuda::Nf4Source s;
    s.packed = q.packed.data_ptr<std::uint8_t>();
    if (t.nested) {
      on_gpu(q.nested->absmax_codes, at::kByte, e, "absmax codes");
      on_gpu(q.nested->nested_absmax, at::kFloat, e, "nested absmax");
      s.absmax = q.nested->absmax_codes.data_ptr();
      s.nested_absmax = q.nested->nested_absmax.data_ptr<float>();
      s.offset = q.nested->offset;
    } else {
      on_gpu(q.absmax, at::kFloat, e, "absmax");
      s.absmax = q.absmax.data_ptr();
    }
    sources.push_back(s);
  }
  const auto bytes = static_cast<std::int64_t>(sources.size() * sizeof(nf4::cuda::Nf4Source));
  at::Tensor host = at::empty({bytes}, at::kByte);
  std::memcpy(host.data_ptr(), sources.data(), static_cast<std::size_t>(bytes));
  t.sources = host.to(dev);  // pageable: complete before the host's copy goes away
  return t;
#endif
}

#ifdef EO_WITH_CUDA
namespace {

at::Tensor run(nf4_gemm::cuda::Product product, const at::Tensor& a, const Nf4ExpertTable& w, const at::Tensor& offsets,
               const char* what) {
  const bool backward = product == nf4_gemm::cuda::Product::kBackward;
  const std::int64_t width = backward ? w.out : w.in, out_width = backward ? w.in : w.out;
  EO_CHECK(w.sources.defined() && w.experts > 0, what, ": the expert table is empty (nf4_expert_table builds it)");
  EO_CHECK(a.is_cuda() && a.dim() == 2 && a.size(1) == width && a.scalar_type() == at::kBFloat16 &&
               a.device() == w.sources.device(),
           what, ": takes bf16 [M, ", width, "] on ", w.sources.device(), ", got ", a.scalar_type(), " ", a.sizes(),
           " on ", a.device());
  EO_CHECK(offsets.dim() == 1 && offsets.size(0) == w.experts && offsets.scalar_type() == at::kInt &&
               offsets.device() == a.device(),
           what, ": offsets must be int32 [", w.experts, "] on ", a.device(), ", got ", offsets.scalar_type(), " ",
           offsets.sizes(), " on ", offsets.device());
  EO_CHECK(nf4_expert_gemm_runs(a.device()), what, ": the build's code for ", a.device(),
           " is older than sm_80 (the kernel's bf16 mma.sync); build for this GPU's architecture");
  at::Tensor ac = a.contiguous();
  if (reinterpret_cast<std::uintptr_t>(ac.data_ptr()) % 16) ac = ac.clone();
  const at::Tensor oc = offsets.contiguous();
  at::Tensor out = at::empty({a.size(0), out_width}, a.options());
  c10::cuda::CUDAGuard guard(a.device());
  const auto ws_bytes = static_cast<std::int64_t>(nf4_gemm::cuda::workspace_bytes(static_cast<int>(w.experts)));
  const at::Tensor ws = at::empty({ws_bytes}, a.options().dtype(at::kByte));
  nf4::cuda::Nf4Layout layout;
  layout.n = w.out * w.in;
  layout.blocksize = w.blocksize;
  layout.nested = w.nested;
  layout.nested_blocksize = w.nested_blocksize;
  layout.nested_code = w.nested ? w.nested_code.data_ptr<float>() : nullptr;
  const cudaError_t rc = nf4_gemm::cuda::grouped(
      product, ac.data_ptr(), reinterpret_cast<const nf4::cuda::Nf4Source*>(w.sources.data_ptr()), layout, w.out, w.in,
      oc.data_ptr<int>(), static_cast<int>(w.experts), out.data_ptr(), a.size(0), ws.data_ptr(),
      c10::cuda::getCurrentCUDAStream(a.device().index()).stream());
  EO_CUDA_CHECK(rc, what);
  return out;
}

}  // namespace
#endif

at::Tensor nf4_grouped_mm(const at::Tensor& x, const Nf4ExpertTable& w, const at::Tensor& offsets) {
#ifdef EO_WITH_CUDA
  return run(nf4_gemm::cuda::Product::kForward, x, w, offsets, "NF4 expert GEMM (x · W^T)");
#else
  (void)x, (void)w, (void)offsets;
  EO_FAIL("NF4 expert GEMM: this build has no CUDA kernels (a CUDA libtorch builds them)");
#endif
}

at::Tensor nf4_grouped_mm_dx(const at::Tensor& dy, const Nf4ExpertTable& w, const at::Tensor& offsets) {
#ifdef EO_WITH_CUDA
  return run(nf4_gemm::cuda::Product::kBackward, dy, w, offsets, "NF4 expert GEMM (dy · W)");
#else
  (void)dy, (void)w, (void)offsets;
  EO_FAIL("NF4 expert GEMM: this build has no CUDA kernels (a CUDA libtorch builds them)");
#endif
}

}  // namespace eo::model
