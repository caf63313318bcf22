#include "models/linear4bit.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "common/error.h"

namespace eo::model {

const nf4::QuantizedWeight& WeightHandle::fetch() const {
  if (owned) return *owned;
  EO_CHECK(provider != nullptr, "linear4bit: weight handle has neither a provider nor an owned weight");
  return provider->expert_weight(layer, expert, matrix);
}

namespace {

// The handle travels through saved_data as plain integers (no tensor, no storage reference).
struct Linear4bitFunction : public torch::autograd::Function<Linear4bitFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const WeightHandle& h) {
    ctx->saved_data["provider"] = static_cast<std::int64_t>(reinterpret_cast<std::intptr_t>(h.provider));
    ctx->saved_data["owned"] = static_cast<std::int64_t>(reinterpret_cast<std::intptr_t>(h.owned));
    ctx->saved_data["layer"] = static_cast<std::int64_t>(h.layer);
    ctx->saved_data["expert"] = static_cast<std::int64_t>(h.expert);
    ctx->saved_data["matrix"] = static_cast<std::int64_t>(h.matrix);
    const at::Tensor w = nf4::dequantize(h.fetch(), x.scalar_type());
    return at::linear(x, w);  // w is a temporary: freed when forward returns
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    WeightHandle h;
    h.provider = reinterpret_cast<WeightProvider*>(static_cast<std::intptr_t>(ctx->saved_data["provider"].toInt()));
    h.owned = reinterpret_cast<const nf4::QuantizedWeight*>(static_cast<std::intptr_t>(ctx->saved_data["owned"].toInt()));
    h.layer = static_cast<int>(ctx->saved_data["layer"].toInt());
    h.expert = static_cast<int>(ctx->saved_data["expert"].toInt());
    h.matrix = static_cast<ExpertMatrix>(ctx->saved_data["matrix"].toInt());
    const at::Tensor& dy = grads[0];
    const at::Tensor w = nf4::dequantize(h.fetch(), dy.scalar_type());  // bytes current now
    return {at::matmul(dy, w), at::Tensor()};
  }
};

}  // namespace

at::Tensor linear4bit(const at::Tensor& x, const WeightHandle& handle) {
  return Linear4bitFunction::apply(x, handle);
}

}  // namespace eo::model
