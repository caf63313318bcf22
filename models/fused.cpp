#include "models/fused.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "common/error.h"

#ifdef EO_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "models/fused_cuda.h"
#endif

namespace eo::model {
namespace {

#ifdef EO_WITH_CUDA
fused::cuda::DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return fused::cuda::DType::F32;
    case at::kBFloat16: return fused::cuda::DType::BF16;
    case at::kHalf: return fused::cuda::DType::F16;
    default: EO_FAIL("fused kernels: unsupported dtype ", t.scalar_type());
  }
}
cudaStream_t stream_of(const at::Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.device().index()).stream(); }
void launched(cudaError_t rc, const char* what) {
  EO_CHECK(rc == cudaSuccess, what, ": ", cudaGetErrorString(rc));
}
#endif

// CPU: the same fp32 math as the kernels, rounded once.
at::Tensor swiglu_math(const at::Tensor& g, const at::Tensor& u) {
  const at::Tensor gf = g.to(at::kFloat);
  return (at::silu(gf) * u.to(at::kFloat)).to(g.scalar_type());
}

std::pair<at::Tensor, at::Tensor> swiglu_grad_math(const at::Tensor& g, const at::Tensor& u, const at::Tensor& dh) {
  // d silu(g)/dg = s (1 + g (1 - s)) with s = sigmoid(g).
  const at::Tensor gf = g.to(at::kFloat), uf = u.to(at::kFloat), df = dh.to(at::kFloat);
  const at::Tensor s = at::sigmoid(gf);
  return {(df * uf * s * (1 + gf * (1 - s))).to(g.scalar_type()), (df * gf * s).to(u.scalar_type())};
}

struct SwiGluFunction : public torch::autograd::Function<SwiGluFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up) {
    ctx->save_for_backward({gate, up});  // through the saved-tensor hooks: checkpointing may drop them
#ifdef EO_WITH_CUDA
    if (gate.is_cuda()) {
      const at::Tensor g = gate.contiguous(), u = up.contiguous();
      at::Tensor h = at::empty_like(g);
      c10::cuda::CUDAGuard guard(g.device());
      launched(fused::cuda::swiglu_forward(g.data_ptr(), u.data_ptr(), h.data_ptr(), g.numel(), dtype_of(g), stream_of(g)),
               "swiglu forward");
      return h;
    }
#endif
    return swiglu_math(gate, up);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
#ifdef EO_WITH_CUDA
    if (saved[0].is_cuda()) {
      const at::Tensor g = saved[0].contiguous(), u = saved[1].contiguous(), dh = grads[0].to(g.scalar_type()).contiguous();
      at::Tensor dg = at::empty_like(g), du = at::empty_like(u);
      c10::cuda::CUDAGuard guard(g.device());
      launched(fused::cuda::swiglu_backward(g.data_ptr(), u.data_ptr(), dh.data_ptr(), dg.data_ptr(), du.data_ptr(),
                                            g.numel(), dtype_of(g), stream_of(g)),
               "swiglu backward");
      return {dg, du};
    }
#endif
    auto [dg, du] = swiglu_grad_math(saved[0], saved[1], grads[0]);
    return {dg, du};
  }
};

// CPU: HF's formula in fp32 over the rotated dims (cos/sin broadcast over the heads).
at::Tensor rope_math(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const auto rot = cos.size(-1), D = x.size(-1), half = rot / 2;
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor xr = rot == D ? xf : xf.narrow(-1, 0, rot);
  const at::Tensor rotated = at::cat({-xr.narrow(-1, half, half), xr.narrow(-1, 0, half)}, -1);
  const at::Tensor c = cos.to(at::kFloat).unsqueeze(2), s = sin.to(at::kFloat).unsqueeze(2);
  at::Tensor out = xr * c + rotated * s;
  if (rot < D) out = at::cat({out, xf.narrow(-1, rot, D - rot)}, -1);
  return out.to(x.scalar_type());
}

#ifdef EO_WITH_CUDA
at::Tensor rope_kernel(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool backward) {
  const at::Tensor xc = x.contiguous(), c = cos.to(x.scalar_type()).contiguous(), s = sin.to(x.scalar_type()).contiguous();
  at::Tensor out = at::empty_like(xc);
  c10::cuda::CUDAGuard guard(xc.device());
  launched(fused::cuda::rope(xc.data_ptr(), c.data_ptr(), s.data_ptr(), out.data_ptr(), xc.size(0) * xc.size(1),
                             static_cast<int>(xc.size(2)), static_cast<int>(xc.size(3)), static_cast<int>(c.size(-1)), backward,
                             dtype_of(xc), stream_of(xc)),
           "rope");
  return out;
}

struct RopeFunction : public torch::autograd::Function<RopeFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos,
                            const at::Tensor& sin) {
    ctx->saved_data["cos"] = cos;  // position tables, not activations: no saved-tensor hooks needed
    ctx->saved_data["sin"] = sin;
    return rope_kernel(x, cos, sin, false);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return {rope_kernel(grads[0], ctx->saved_data["cos"].toTensor(), ctx->saved_data["sin"].toTensor(), true), at::Tensor(),
            at::Tensor()};
  }
};
#endif

}  // namespace

at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up) {
  EO_CHECK(gate.sizes() == up.sizes(), "swiglu: gate ", gate.sizes(), " and up ", up.sizes(), " differ");
  return SwiGluFunction::apply(gate, up);
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  EO_CHECK(x.dim() == 4 && cos.dim() == 3 && cos.sizes() == sin.sizes() && cos.size(0) == x.size(0) &&
               cos.size(1) == x.size(1) && cos.size(2) <= x.size(3) && cos.size(2) % 2 == 0,
           "rope: x ", x.sizes(), " [B, T, heads, head_dim] with cos/sin ", cos.sizes(), " [B, T, rot_dim]");
#ifdef EO_WITH_CUDA
  if (x.is_cuda()) return RopeFunction::apply(x, cos, sin);
#endif
  return rope_math(x, cos, sin);
}

}  // namespace eo::model
