#include "models/linear4bit.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <atomic>

#include "common/error.h"
#include "models/fused.h"
#include "models/grouped_mm.h"

namespace eo::model {

const QuantizedWeight& WeightHandle::fetch() const {
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
    const at::Tensor w = eo::dequantize(h.fetch(), x.scalar_type());
    return at::linear(x, w);  // w is a temporary: freed when forward returns
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    WeightHandle h;
    h.provider = reinterpret_cast<WeightProvider*>(static_cast<std::intptr_t>(ctx->saved_data["provider"].toInt()));
    h.owned = reinterpret_cast<const QuantizedWeight*>(static_cast<std::intptr_t>(ctx->saved_data["owned"].toInt()));
    h.layer = static_cast<int>(ctx->saved_data["layer"].toInt());
    h.expert = static_cast<int>(ctx->saved_data["expert"].toInt());
    h.matrix = static_cast<ExpertMatrix>(ctx->saved_data["matrix"].toInt());
    const at::Tensor& dy = grads[0];
    const at::Tensor w = eo::dequantize(h.fetch(), dy.scalar_type());  // bytes current now
    return {at::matmul(dy, w), at::Tensor()};
  }
};

std::atomic<std::int64_t> g_bank_dequantisations{0};

// The bank travels through saved_data like the handle above.
struct GroupedExpertFunction : public torch::autograd::Function<GroupedExpertFunction> {
  static std::vector<const QuantizedWeight*> sources(const ExpertBank& bank) {
    std::vector<const QuantizedWeight*> qs;
    qs.reserve(bank.experts);
    for (int e = bank.first; e < bank.first + bank.experts; ++e) qs.push_back(&bank.provider->expert_weight(bank.layer, e, bank.matrix));
    return qs;
  }
  static at::Tensor weights(const ExpertBank& bank, at::ScalarType dtype) {
    if (bank.dense.defined()) return bank.dense.to(dtype);
    ++g_bank_dequantisations;
    return eo::dequantize_stack(sources(bank), dtype);  // [E, out, in]
  }
  // [out, in] of the bank's matrices, and the slice length along `dim` (1 rows, 2 columns) that
  // max_bytes allows; the full length when the bank is dense or unlimited.
  static std::pair<std::vector<std::int64_t>, std::int64_t> slicing(const ExpertBank& bank, int dim, at::ScalarType dt) {
    if (bank.dense.defined()) return {{bank.dense.size(1), bank.dense.size(2)}, dim == 1 ? bank.dense.size(1) : bank.dense.size(2)};
    const auto& shape = bank.provider->expert_weight(bank.layer, bank.first, bank.matrix).shape;
    const std::int64_t full = dim == 1 ? shape[0] : shape[1], other = dim == 1 ? shape[1] : shape[0];
    return {{shape[0], shape[1]}, bank_slice(full, bank.experts, other, c10::elementSize(dt), bank.max_bytes)};
  }

  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& offsets,
                            const ExpertBank& bank) {
    ctx->saved_data["provider"] = static_cast<std::int64_t>(reinterpret_cast<std::intptr_t>(bank.provider));
    ctx->saved_data["layer"] = static_cast<std::int64_t>(bank.layer);
    ctx->saved_data["experts"] = static_cast<std::int64_t>(bank.experts);
    ctx->saved_data["first"] = static_cast<std::int64_t>(bank.first);
    ctx->saved_data["matrix"] = static_cast<std::int64_t>(bank.matrix);
    ctx->saved_data["max_bytes"] = bank.max_bytes;
    ctx->saved_data["offsets"] = offsets;
    if (bank.dense.defined()) ctx->saved_data["dense"] = bank.dense;
    const auto [shape, rows] = slicing(bank, 1, x.scalar_type());
    if (rows >= shape[0]) {
      const at::Tensor w = weights(bank, x.scalar_type());
      if (bank.keep_for_backward && !bank.dense.defined()) ctx->saved_data["bank"] = w;
      return grouped_mm_product(x, w.transpose(1, 2), offsets);
    }
    // Output columns [o0, o0 + rows) from rows [o0, o0 + rows) of every expert's matrix.
    const auto qs = sources(bank);
    at::Tensor y = at::empty({x.size(0), shape[0]}, x.options());
    for (std::int64_t o0 = 0; o0 < shape[0]; o0 += rows) {
      const std::int64_t n = std::min(rows, shape[0] - o0);
      ++g_bank_dequantisations;
      const at::Tensor w = eo::dequantize_stack_window(qs, x.scalar_type(), o0, n, 0, shape[1]);  // [E, n, in]
      y.narrow(1, o0, n).copy_(grouped_mm_product(x, w.transpose(1, 2), offsets));
    }
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    ExpertBank bank;
    bank.provider = reinterpret_cast<WeightProvider*>(static_cast<std::intptr_t>(ctx->saved_data["provider"].toInt()));
    bank.layer = static_cast<int>(ctx->saved_data["layer"].toInt());
    bank.experts = static_cast<int>(ctx->saved_data["experts"].toInt());
    bank.first = static_cast<int>(ctx->saved_data["first"].toInt());
    bank.matrix = static_cast<ExpertMatrix>(ctx->saved_data["matrix"].toInt());
    bank.max_bytes = ctx->saved_data["max_bytes"].toInt();
    if (ctx->saved_data.count("dense")) bank.dense = ctx->saved_data["dense"].toTensor();
    const at::Tensor offsets = ctx->saved_data["offsets"].toTensor();
    const at::Tensor dy = grads[0].contiguous();
    if (auto kept = ctx->saved_data.find("bank"); kept != ctx->saved_data.end()) {
      const at::Tensor w = kept->second.toTensor();
      ctx->saved_data.erase(kept);  // freed once dX is queued, not with the graph
      return {grouped_mm_product(dy, w, offsets), at::Tensor(), at::Tensor()};
    }
    // The bytes current now (the recompute staged them).
    const auto [shape, cols] = slicing(bank, 2, dy.scalar_type());
    if (cols >= shape[1]) return {grouped_mm_product(dy, weights(bank, dy.scalar_type()), offsets), at::Tensor(), at::Tensor()};
    // dX columns [c0, c0 + cols) from columns [c0, c0 + cols) of every expert's matrix.
    const auto qs = sources(bank);
    at::Tensor dx = at::empty({dy.size(0), shape[1]}, dy.options());
    for (std::int64_t c0 = 0; c0 < shape[1]; c0 += cols) {
      const std::int64_t n = std::min(cols, shape[1] - c0);
      ++g_bank_dequantisations;
      const at::Tensor w = eo::dequantize_stack_window(qs, dy.scalar_type(), 0, shape[0], c0, n);  // [E, out, n]
      dx.narrow(1, c0, n).copy_(grouped_mm_product(dy, w, offsets));
    }
    return {dx, at::Tensor(), at::Tensor()};
  }
};

// The gather-and-sum backward of out = x.index_select(0, index) (see gather_rows), of the
// gradient grad + second (second may be undefined: the twin output's, summed in the same pass).
at::Tensor gather_rows_backward(torch::autograd::AutogradContext* ctx, const at::Tensor& grad, const at::Tensor& second) {
  if (!grad.defined() && !second.defined()) return at::Tensor();
  const at::Tensor& g0 = grad.defined() ? grad : second;
  const at::Tensor g1 = grad.defined() && second.defined() ? second.to(grad.scalar_type()) : at::Tensor();
  const at::Tensor inverse = ctx->saved_data["inverse"].toTensor();
  const std::int64_t fanout = ctx->saved_data["fanout"].toInt(), rows = ctx->saved_data["rows"].toInt();
  if (fanout == 1) return (g1.defined() ? g0 + g1 : g0).index_select(0, inverse);
  const at::Tensor g = gather_sum_rows(g0, inverse, fanout, g1);  // accumulates in fp32, rounds once
  EO_CHECK(g.size(0) == rows, "gather_rows backward: ", g.size(0), " rows for an input of ", rows);
  return g;
}
void save_gather(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& inverse, std::int64_t fanout) {
  ctx->saved_data["inverse"] = inverse;  // integer rows, no activation: nothing to checkpoint
  ctx->saved_data["fanout"] = fanout;
  ctx->saved_data["rows"] = x.size(0);
}

struct GatherRowsFunction : public torch::autograd::Function<GatherRowsFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& index,
                            const at::Tensor& inverse, std::int64_t fanout) {
    save_gather(ctx, x, inverse, fanout);
    return x.index_select(0, index);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return {gather_rows_backward(ctx, grads[0], at::Tensor()), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// The same gather as two outputs over one buffer (the second an alias): each collects its own
// consumers' gradient, and the backward sums the two inside the gather.
struct GatherRowsTwiceFunction : public torch::autograd::Function<GatherRowsTwiceFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                                                const at::Tensor& index, const at::Tensor& inverse, std::int64_t fanout) {
    save_gather(ctx, x, inverse, fanout);
    const at::Tensor out = x.index_select(0, index);
    return {out, out.alias()};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return {gather_rows_backward(ctx, grads[0], grads[1]), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// out[t] = sum_j weights[t, j] * (y + addend)[position[t * k + j]]; see combine_rows. Custom
// functions take defined tensors only, so the form with the delta is a second node.
at::Tensor combine_forward(torch::autograd::AutogradContext* ctx, const at::Tensor& y, const at::Tensor& addend,
                           const at::Tensor& weights, const at::Tensor& position, const at::Tensor& token_of,
                           const at::Tensor& order) {
  // Activations through the saved-tensor hooks; the integer rows need no checkpointing.
  ctx->save_for_backward(addend.defined() ? torch::autograd::variable_list{y, weights, addend} : torch::autograd::variable_list{y, weights});
  ctx->saved_data["position"] = position;
  ctx->saved_data["token_of"] = token_of;
  ctx->saved_data["order"] = order;
  return gather_sum_rows(y, position, weights.size(1), addend, weights);
}
// {d_y, d_weights}; the delta's gradient is d_y.
std::pair<at::Tensor, at::Tensor> combine_backward(torch::autograd::AutogradContext* ctx, const at::Tensor& grad) {
  const auto saved = ctx->get_saved_variables();
  const at::Tensor &y = saved[0], &weights = saved[1];
  const at::Tensor addend = saved.size() > 2 ? saved[2] : at::Tensor();
  const at::Tensor g = grad.contiguous();
  const at::Tensor order = ctx->saved_data["order"].toTensor();
  // Sorted row s came from pair order[s] = (token, slot): its gradient is that pair's weight
  // times the token's gradient, a scaled gather (gather_sum_rows at fanout 1; no [tokens, k,
  // hidden] tensor).
  const at::Tensor d_y =
      gather_sum_rows(g, ctx->saved_data["token_of"].toTensor(), 1, at::Tensor(), weights.reshape({-1}).index_select(0, order));
  const at::Tensor d_w = gather_dot_rows(y, addend, ctx->saved_data["position"].toTensor(), g, weights.size(1))
                             .view(weights.sizes())
                             .to(weights.scalar_type());
  return {d_y, d_w};
}

struct CombineRowsFunction : public torch::autograd::Function<CombineRowsFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& y, const at::Tensor& weights,
                            const at::Tensor& position, const at::Tensor& token_of, const at::Tensor& order) {
    return combine_forward(ctx, y, at::Tensor(), weights, position, token_of, order);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto [d_y, d_w] = combine_backward(ctx, grads[0]);
    return {d_y, d_w, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};
struct CombineRowsDeltaFunction : public torch::autograd::Function<CombineRowsDeltaFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& y, const at::Tensor& addend,
                            const at::Tensor& weights, const at::Tensor& position, const at::Tensor& token_of,
                            const at::Tensor& order) {
    return combine_forward(ctx, y, addend, weights, position, token_of, order);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto [d_y, d_w] = combine_backward(ctx, grads[0]);
    return {d_y, d_y, d_w, at::Tensor(), at::Tensor(), at::Tensor()};  // the delta's gradient is y's: the same tensor
  }
};

}  // namespace

std::int64_t bank_slice(std::int64_t full, std::int64_t experts, std::int64_t other, std::int64_t elem_bytes,
                        std::int64_t max_bytes) {
  if (max_bytes <= 0) return full;
  const std::int64_t fit = max_bytes / std::max<std::int64_t>(1, experts * other * elem_bytes);
  return std::min(full, std::max<std::int64_t>(64, fit / 64 * 64));
}

at::Tensor gather_rows(const at::Tensor& x, const at::Tensor& index, const at::Tensor& inverse, std::int64_t fanout) {
  EO_CHECK(x.dim() == 2 && index.dim() == 1 && inverse.numel() == x.size(0) * fanout && index.numel() == inverse.numel(),
           "gather_rows: x ", x.sizes(), ", index ", index.sizes(), ", inverse ", inverse.sizes(), ", fanout ", fanout);
  return GatherRowsFunction::apply(x, index, inverse, fanout);
}

std::pair<at::Tensor, at::Tensor> gather_rows_twice(const at::Tensor& x, const at::Tensor& index, const at::Tensor& inverse,
                                                    std::int64_t fanout) {
  EO_CHECK(x.dim() == 2 && index.dim() == 1 && inverse.numel() == x.size(0) * fanout && index.numel() == inverse.numel(),
           "gather_rows_twice: x ", x.sizes(), ", index ", index.sizes(), ", inverse ", inverse.sizes(), ", fanout ", fanout);
  const torch::autograd::variable_list outs = GatherRowsTwiceFunction::apply(x, index, inverse, fanout);
  return {outs[0], outs[1]};
}

at::Tensor combine_rows(const at::Tensor& y, const at::Tensor& addend, const at::Tensor& weights, const at::Tensor& position,
                        const at::Tensor& token_of, const at::Tensor& order) {
  EO_CHECK(y.dim() == 2 && weights.dim() == 2 && position.numel() == weights.numel() && token_of.numel() == weights.numel() &&
               order.numel() == weights.numel() && y.size(0) == weights.numel(),
           "combine_rows: y ", y.sizes(), ", weights ", weights.sizes(), ", position ", position.sizes(), ", token_of ",
           token_of.sizes(), ", order ", order.sizes());
  EO_CHECK(!addend.defined() || addend.sizes() == y.sizes(), "combine_rows: addend ", addend.sizes(), " differs from y ",
           y.sizes());
  if (addend.defined()) return CombineRowsDeltaFunction::apply(y, addend, weights, position, token_of, order);
  return CombineRowsFunction::apply(y, weights, position, token_of, order);
}

namespace {
std::atomic<bool> g_grouped_enabled{true};
std::atomic<bool> g_grouped_on_cpu{false};
}  // namespace

void set_grouped_gemm_enabled(bool enabled) { g_grouped_enabled = enabled; }
void set_grouped_gemm_on_cpu(bool enabled) { g_grouped_on_cpu = enabled; }

std::int64_t grouped_bank_dequantisations() { return g_bank_dequantisations.load(); }

bool grouped_gemm_available(const at::Tensor& x) {
  if (!g_grouped_enabled) return false;
  if (x.is_cuda()) return grouped_expert_gemm_runs(x.scalar_type(), x.device());
  return g_grouped_on_cpu && x.device().is_cpu() && x.scalar_type() == at::kFloat;
}

at::Tensor grouped_expert_linear(const at::Tensor& x, const at::Tensor& offsets, const ExpertBank& bank) {
  EO_CHECK(grouped_gemm_available(x), "grouped_expert_linear needs a bf16 CUDA input, fp16 with the portable kernel (or fp32 on the CPU under ",
           "set_grouped_gemm_on_cpu), got ", x.scalar_type(), " on ", x.device());
  EO_CHECK(bank.dense.defined() || bank.provider != nullptr, "grouped_expert_linear: no weights");
  return GroupedExpertFunction::apply(x.contiguous(), offsets, bank);
}

at::Tensor linear4bit(const at::Tensor& x, const WeightHandle& handle) {
  return Linear4bitFunction::apply(x, handle);
}

}  // namespace eo::model
