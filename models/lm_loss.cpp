#include "models/lm_loss.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>

#include "common/error.h"

namespace eo::model {
namespace {

constexpr std::int64_t kIgnore = -100;


// fp32 logits of one chunk, as transformers forms them: the GEMM in the compute dtype, then upcast;
// soft-capped (cap · tanh(z / cap)) when softcap > 0.
at::Tensor chunk_logits(const at::Tensor& h, const at::Tensor& weight, double softcap) {
  const at::Tensor z = at::linear(h, weight).to(at::kFloat);
  return softcap > 0 ? at::tanh(z / softcap) * softcap : z;
}

struct ChunkedCrossEntropy : public torch::autograd::Function<ChunkedCrossEntropy> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& weight,
                            const at::Tensor& targets, std::int64_t chunk, double softcap) {
    const std::int64_t N = hidden.size(0);
    at::Tensor lse = at::empty({N}, hidden.options().dtype(at::kFloat));
    at::Tensor total = at::zeros({}, hidden.options().dtype(at::kFloat));
    for (std::int64_t r = 0; r < N; r += chunk) {
      const std::int64_t n = std::min(chunk, N - r);
      const at::Tensor logits = chunk_logits(hidden.narrow(0, r, n), weight, softcap);
      const at::Tensor t = targets.narrow(0, r, n);
      const at::Tensor row_lse = at::logsumexp(logits, {1});
      lse.narrow(0, r, n).copy_(row_lse);
      const at::Tensor picked = logits.gather(1, t.clamp_min(0).unsqueeze(1)).squeeze(1);
      total.add_(((row_lse - picked) * (t != kIgnore)).sum());
    }
    ctx->save_for_backward({hidden, targets, lse});
    ctx->saved_data["weight"] = weight;
    ctx->saved_data["chunk"] = chunk;
    ctx->saved_data["softcap"] = softcap;
    return total;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& hidden = saved[0];
    const at::Tensor& targets = saved[1];
    const at::Tensor& lse = saved[2];
    const at::Tensor weight = ctx->saved_data["weight"].toTensor();
    const std::int64_t chunk = ctx->saved_data["chunk"].toInt();
    const double softcap = ctx->saved_data["softcap"].toDouble();
    const at::Tensor g = grads[0].to(at::kFloat);
    const std::int64_t N = hidden.size(0);
    at::Tensor dh = at::empty_like(hidden);
    for (std::int64_t r = 0; r < N; r += chunk) {
      const std::int64_t n = std::min(chunk, N - r);
      const at::Tensor t = targets.narrow(0, r, n);
      const at::Tensor valid = (t != kIgnore).to(at::kFloat);
      // d CE / d logits = softmax - onehot(target), zero on ignored rows, times the loss' grad.
      const at::Tensor logits = chunk_logits(hidden.narrow(0, r, n), weight, softcap);
      at::Tensor d = (logits - lse.narrow(0, r, n).unsqueeze(1)).exp_();
      d.scatter_add_(1, t.clamp_min(0).unsqueeze(1), -at::ones({n, 1}, d.options()));
      d.mul_((valid * g).unsqueeze(1));
      // Through the cap: d(cap · tanh(z / cap)) / dz = 1 - (capped / cap)².
      if (softcap > 0) d.mul_(1 - (logits / softcap).square());
      dh.narrow(0, r, n).copy_(at::matmul(d.to(hidden.scalar_type()), weight));
    }
    return {dh, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

std::int64_t loss_chunk_rows(std::int64_t rows, std::int64_t vocab) {
  const std::int64_t budget = std::int64_t(128) << 20;  // bytes of fp32 logits per chunk
  return std::max<std::int64_t>(1, std::min(rows, budget / (4 * std::max<std::int64_t>(1, vocab))));
}

at::Tensor chunked_linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                                        std::int64_t chunk_rows, double softcap) {
  EO_CHECK(hidden.dim() == 2 && weight.dim() == 2 && hidden.size(1) == weight.size(1), "chunked_linear_cross_entropy: hidden ",
           hidden.sizes(), " and weight ", weight.sizes(), " do not match");
  EO_CHECK(targets.dim() == 1 && targets.size(0) == hidden.size(0), "chunked_linear_cross_entropy: targets ", targets.sizes(),
           " for ", hidden.size(0), " rows");
  EO_CHECK(!weight.requires_grad(), "chunked_linear_cross_entropy: the head weight must be frozen");
  if (hidden.size(0) == 0) return at::zeros({}, hidden.options().dtype(at::kFloat));
  const std::int64_t chunk = chunk_rows > 0 ? std::min(hidden.size(0), chunk_rows) : loss_chunk_rows(hidden.size(0), weight.size(0));
  return ChunkedCrossEntropy::apply(hidden.contiguous(), weight, targets.to(hidden.device(), at::kLong).contiguous(), chunk,
                                   softcap);
}

}  // namespace eo::model
