#include "models/fused.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "common/error.h"

#ifdef EO_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common/cuda_check.h"
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
#endif

// fp32 of a + b (b may be undefined), the kernels' sum of a base output and its LoRA delta.
at::Tensor f32_sum(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor af = a.to(at::kFloat);
  return b.defined() ? af + b.to(at::kFloat) : af;
}

// CPU: the same fp32 math as the kernels, rounded once.
at::Tensor swiglu_math(const at::Tensor& g0, const at::Tensor& g1, const at::Tensor& u0, const at::Tensor& u1) {
  return (at::silu(f32_sum(g0, g1)) * f32_sum(u0, u1)).to(g0.scalar_type());
}

std::pair<at::Tensor, at::Tensor> swiglu_grad_math(const at::Tensor& g0, const at::Tensor& g1, const at::Tensor& u0,
                                                   const at::Tensor& u1, const at::Tensor& dh0, const at::Tensor& dh1) {
  // d silu(g)/dg = s (1 + g (1 - s)) with s = sigmoid(g).
  const at::Tensor gf = f32_sum(g0, g1), uf = f32_sum(u0, u1), df = f32_sum(dh0, dh1);
  const at::Tensor s = at::sigmoid(gf);
  return {(df * uf * s * (1 + gf * (1 - s))).to(g0.scalar_type()), (df * gf * s).to(u0.scalar_type())};
}

#ifdef EO_WITH_CUDA
// A contiguous operand for a kernel, or nullptr where it is undefined (a missing delta).
const void* ptr_or_null(const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }
at::Tensor contiguous_if(const at::Tensor& t, const at::Tensor& like) {
  return t.defined() ? t.to(like.scalar_type()).contiguous() : t;
}
#endif

// silu(g0 + g1) * (u0 + u1), with g1 and u1 undefined for plain swiglu.
at::Tensor swiglu_forward(const at::Tensor& g0, const at::Tensor& g1, const at::Tensor& u0, const at::Tensor& u1) {
#ifdef EO_WITH_CUDA
  if (g0.is_cuda()) {
    const at::Tensor g = g0.contiguous(), u = u0.contiguous(), gd = contiguous_if(g1, g), ud = contiguous_if(u1, g);
    at::Tensor h = at::empty_like(g);
    c10::cuda::CUDAGuard guard(g.device());
    EO_CUDA_CHECK(fused::cuda::swiglu_forward(g.data_ptr(), ptr_or_null(gd), u.data_ptr(), ptr_or_null(ud), h.data_ptr(), g.numel(),
                                              dtype_of(g), stream_of(g)),
                  "fused swiglu forward kernel");
    return h;
  }
#endif
  return swiglu_math(g0, g1, u0, u1);
}

// The gradients of gate and up for h's gradient dh0 + dh1 (the two outputs' consumers; either
// may be undefined, not both).
std::pair<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor& g0, const at::Tensor& g1, const at::Tensor& u0,
                                                  const at::Tensor& u1, const at::Tensor& dh0, const at::Tensor& dh1) {
  const at::Tensor& da = dh0.defined() ? dh0 : dh1;
  const at::Tensor db = dh0.defined() ? dh1 : at::Tensor();
#ifdef EO_WITH_CUDA
  if (g0.is_cuda()) {
    const at::Tensor g = g0.contiguous(), u = u0.contiguous(), d = da.to(g.scalar_type()).contiguous();
    const at::Tensor gd = contiguous_if(g1, g), ud = contiguous_if(u1, g), d1 = contiguous_if(db, g);
    at::Tensor dg = at::empty_like(g), du = at::empty_like(u);
    c10::cuda::CUDAGuard guard(g.device());
    EO_CUDA_CHECK(fused::cuda::swiglu_backward(g.data_ptr(), ptr_or_null(gd), u.data_ptr(), ptr_or_null(ud), d.data_ptr(),
                                               ptr_or_null(d1), dg.data_ptr(), du.data_ptr(), g.numel(), dtype_of(g), stream_of(g)),
                  "fused swiglu backward kernel");
    return {dg, du};
  }
#endif
  return swiglu_grad_math(g0, g1, u0, u1, da, db);
}

// Autograd's custom functions take defined tensors only: one node without deltas, one with both.
// Each gives h twice, over one buffer (the second an alias): the down projection's GEMM reads
// the first, its LoRA the second, and the backward sums their gradients in the kernel (no add
// of its own, which autograd would run for one tensor with two consumers).
struct SwiGluFunction : public torch::autograd::Function<SwiGluFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& gate,
                                                const at::Tensor& up) {
    ctx->save_for_backward({gate, up});  // through the saved-tensor hooks: checkpointing may drop them
    const at::Tensor h = swiglu_forward(gate, at::Tensor(), up, at::Tensor());
    return {h, h.alias()};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    if (!grads[0].defined() && !grads[1].defined()) return {at::Tensor(), at::Tensor()};
    auto [dg, du] = swiglu_backward(saved[0], at::Tensor(), saved[1], at::Tensor(), grads[0], grads[1]);
    return {dg, du};
  }
};

struct SwiGluDeltasFunction : public torch::autograd::Function<SwiGluDeltasFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& gate,
                                                const at::Tensor& up, const at::Tensor& gate_delta,
                                                const at::Tensor& up_delta) {
    ctx->save_for_backward({gate, up, gate_delta, up_delta});
    const at::Tensor h = swiglu_forward(gate, gate_delta, up, up_delta);
    return {h, h.alias()};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    if (!grads[0].defined() && !grads[1].defined()) return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    auto [dg, du] = swiglu_backward(saved[0], saved[2], saved[1], saved[3], grads[0], grads[1]);
    return {dg, du, dg, du};  // a delta's gradient is its base's: the same tensor, no copy
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
  EO_CUDA_CHECK(fused::cuda::rope(xc.data_ptr(), c.data_ptr(), s.data_ptr(), out.data_ptr(), xc.size(0) * xc.size(1),
                                  static_cast<int>(xc.size(2)), static_cast<int>(xc.size(3)), static_cast<int>(c.size(-1)), backward,
                                  dtype_of(xc), stream_of(xc)),
                "fused rope kernel");
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

std::pair<at::Tensor, at::Tensor> swiglu_twice(const at::Tensor& gate, const at::Tensor& up, const at::Tensor& gate_delta,
                                               const at::Tensor& up_delta) {
  EO_CHECK(gate.sizes() == up.sizes(), "swiglu: gate ", gate.sizes(), " and up ", up.sizes(), " differ");
  EO_CHECK(!gate_delta.defined() || gate_delta.sizes() == gate.sizes(), "swiglu: gate_delta ", gate_delta.sizes(),
           " differs from gate ", gate.sizes());
  EO_CHECK(!up_delta.defined() || up_delta.sizes() == up.sizes(), "swiglu: up_delta ", up_delta.sizes(), " differs from up ",
           up.sizes());
  torch::autograd::variable_list h;
  if (gate_delta.defined() && up_delta.defined()) h = SwiGluDeltasFunction::apply(gate, up, gate_delta, up_delta);
  // One delta alone (LoRA on gate_proj or up_proj only): its sum is formed.
  else if (gate_delta.defined()) h = SwiGluFunction::apply(gate + gate_delta, up);
  else if (up_delta.defined()) h = SwiGluFunction::apply(gate, up + up_delta);
  else h = SwiGluFunction::apply(gate, up);
  return {h[0], h[1]};
}

at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up, const at::Tensor& gate_delta, const at::Tensor& up_delta) {
  return swiglu_twice(gate, up, gate_delta, up_delta).first;
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

namespace {
void check_rows(const char* what, const at::Tensor& x, const at::Tensor& addend, const at::Tensor& index) {
  EO_CHECK(x.dim() == 2 && index.dim() == 1, what, ": x ", x.sizes(), " [rows, cols] and index ", index.sizes(), " [n]");
  EO_CHECK(!addend.defined() || (addend.sizes() == x.sizes() && addend.scalar_type() == x.scalar_type()), what, ": addend ",
           addend.sizes(), " ", addend.scalar_type(), " differs from x ", x.sizes(), " ", x.scalar_type());
}
#ifdef EO_WITH_CUDA
// A flat fp32 copy of the per-row weights, or undefined.
at::Tensor f32_contiguous_if(const at::Tensor& t) { return t.defined() ? t.reshape({-1}).to(at::kFloat).contiguous() : t; }
const float* f32_or_null(const at::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; }
#endif
// (x + addend) in fp32, or x's type where it is wider (the CPU formulas' operand).
at::ScalarType wide(const at::Tensor& x) { return at::promote_types(x.scalar_type(), at::kFloat); }
at::Tensor wide_sum(const at::Tensor& x, const at::Tensor& addend) {
  const at::Tensor xw = x.to(wide(x));
  return addend.defined() ? xw + addend.to(wide(x)) : xw;
}
}  // namespace

at::Tensor gather_sum_rows(const at::Tensor& x, const at::Tensor& index, std::int64_t fanout, const at::Tensor& addend,
                           const at::Tensor& weight) {
  check_rows("gather_sum_rows", x, addend, index);
  EO_CHECK(fanout > 0 && index.numel() % fanout == 0, "gather_sum_rows: index ", index.sizes(), " for fanout ", fanout);
  EO_CHECK(!weight.defined() || weight.numel() == index.numel(), "gather_sum_rows: weight ", weight.sizes(), " for index ",
           index.sizes());
  const std::int64_t rows = index.numel() / fanout;
#ifdef EO_WITH_CUDA
  if (x.is_cuda()) {
    const at::Tensor xc = x.contiguous(), ic = index.to(at::kLong).contiguous(), ac = contiguous_if(addend, xc);
    const at::Tensor wc = f32_contiguous_if(weight);
    at::Tensor out = at::empty({rows, xc.size(1)}, xc.options());
    c10::cuda::CUDAGuard guard(xc.device());
    EO_CUDA_CHECK(fused::cuda::gather_sum_rows(xc.data_ptr(), ptr_or_null(ac), ic.data_ptr<std::int64_t>(), f32_or_null(wc),
                                               out.data_ptr(), rows, static_cast<int>(fanout), xc.size(1), dtype_of(xc),
                                               stream_of(xc)),
                  "fused gather_sum_rows kernel");
    return out;
  }
#endif
  if (!addend.defined() && !weight.defined()) return x.index_select(0, index).view({rows, fanout, x.size(1)}).sum(1);
  at::Tensor v = wide_sum(x, addend).index_select(0, index);
  if (weight.defined()) v = v * weight.reshape({-1, 1}).to(wide(x));
  return v.view({rows, fanout, x.size(1)}).sum(1).to(x.scalar_type());
}

at::Tensor gather_dot_rows(const at::Tensor& x, const at::Tensor& addend, const at::Tensor& index, const at::Tensor& g,
                           std::int64_t fanout) {
  check_rows("gather_dot_rows", x, addend, index);
  EO_CHECK(fanout > 0 && index.numel() % fanout == 0 && g.dim() == 2 && g.size(0) * fanout == index.numel() &&
               g.size(1) == x.size(1) && g.scalar_type() == x.scalar_type(),
           "gather_dot_rows: g ", g.sizes(), " ", g.scalar_type(), " for x ", x.sizes(), " ", x.scalar_type(), ", index ",
           index.sizes(), ", fanout ", fanout);
  const std::int64_t rows = g.size(0);
#ifdef EO_WITH_CUDA
  if (x.is_cuda()) {
    const at::Tensor xc = x.contiguous(), ic = index.to(at::kLong).contiguous(), ac = contiguous_if(addend, xc), gc = g.contiguous();
    at::Tensor out = at::empty({index.numel()}, xc.options().dtype(at::kFloat));
    c10::cuda::CUDAGuard guard(xc.device());
    EO_CUDA_CHECK(fused::cuda::gather_dot_rows(xc.data_ptr(), ptr_or_null(ac), ic.data_ptr<std::int64_t>(), gc.data_ptr(),
                                               out.data_ptr<float>(), rows, static_cast<int>(fanout), xc.size(1), dtype_of(xc),
                                               stream_of(xc)),
                  "fused gather_dot_rows kernel");
    return out;
  }
#endif
  const at::Tensor v = wide_sum(x, addend).index_select(0, index).view({rows, fanout, x.size(1)});
  return (v * g.to(wide(x)).unsqueeze(1)).sum(-1).reshape({-1});
}

}  // namespace eo::model
