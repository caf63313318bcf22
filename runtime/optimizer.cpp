#include "runtime/optimizer.h"

#include <ATen/ATen.h>
#include <torch/optim/adamw.h>

#include <cmath>

#include "common/error.h"
#include "runtime/config.h"

namespace eo {

double lr_multiplier(const std::string& schedule, std::int64_t step, std::int64_t warmup, std::int64_t total) {
  if (step < warmup) return double(step) / double(std::max<std::int64_t>(1, warmup));
  if (schedule == "constant") return 1.0;
  const double progress = double(step - warmup) / double(std::max<std::int64_t>(1, total - warmup));
  if (schedule == "linear") return std::max(0.0, 1.0 - progress);
  if (schedule == "cosine") return std::max(0.0, 0.5 * (1.0 + std::cos(M_PI * progress)));
  EO_FAIL("unknown lr_scheduler '", schedule, "'");
}

std::int64_t resolve_warmup_steps(const TrainConfig& cfg, std::int64_t total_steps) {
  if (cfg.warmup_ratio) return static_cast<std::int64_t>(std::ceil(*cfg.warmup_ratio * double(total_steps)));
  return cfg.warmup_steps;
}

double clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm) {
  // Accumulate in fp64 so the norm does not depend on summation order across many tensors.
  double sq = 0;
  for (const auto& p : params)
    if (p.grad().defined()) sq += p.grad().to(at::kDouble).pow(2).sum().item<double>();
  const double norm = std::sqrt(sq);
  if (max_norm > 0 && std::isfinite(norm)) {
    const double coef = max_norm / (norm + 1e-6);
    if (coef < 1.0)
      for (const auto& p : params)
        if (p.grad().defined()) p.mutable_grad().mul_(coef);
  }
  return norm;
}

namespace {
bool no_decay(const std::string& name) {
  return name.find("bias") != std::string::npos || name.find("norm") != std::string::npos;
}
}  // namespace

Optimizer::Optimizer(const NamedTensors& params, const TrainConfig& cfg) : params_(params) {
  std::vector<at::Tensor> decay, plain;
  for (const auto& [name, p] : params) {
    EO_CHECK(p.scalar_type() == at::kFloat, "trainable parameter ", name, " must be fp32 (master weights)");
    (no_decay(name) ? plain : decay).push_back(p);
  }
  auto opts = torch::optim::AdamWOptions(cfg.learning_rate)
                  .betas({cfg.adam_beta1, cfg.adam_beta2})
                  .eps(cfg.adam_epsilon)
                  .weight_decay(cfg.weight_decay);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  if (!decay.empty()) groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(opts));
  if (!plain.empty()) {
    auto o = std::make_unique<torch::optim::AdamWOptions>(opts);
    o->weight_decay(0.0);
    groups.emplace_back(plain, std::move(o));
  }
  adamw_ = std::make_unique<torch::optim::AdamW>(groups, opts);
}

Optimizer::~Optimizer() = default;

void Optimizer::step(double lr) {
  for (auto& g : adamw_->param_groups()) static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr);
  adamw_->step();
}

void Optimizer::zero_grad() {
  // Drop the gradients (set_to_none) so an unused parameter is distinguishable from a zero one.
  adamw_->zero_grad(true);
}

NamedTensors Optimizer::state() const {
  NamedTensors out;
  auto& st = adamw_->state();
  for (const auto& [name, p] : params_) {
    auto it = st.find(p.unsafeGetTensorImpl());
    if (it == st.end()) continue;  // never stepped
    auto& s = static_cast<torch::optim::AdamWParamState&>(*it->second);
    out.emplace_back(name + ".exp_avg", s.exp_avg());
    out.emplace_back(name + ".exp_avg_sq", s.exp_avg_sq());
    out.emplace_back(name + ".step", at::full({1}, static_cast<double>(s.step()), at::kDouble));
  }
  return out;
}

void Optimizer::load_state(const std::map<std::string, at::Tensor>& state) {
  auto& st = adamw_->state();
  for (const auto& [name, p] : params_) {
    auto a = state.find(name + ".exp_avg");
    if (a == state.end()) continue;
    auto b = state.find(name + ".exp_avg_sq");
    auto s = state.find(name + ".step");
    EO_CHECK(b != state.end() && s != state.end(), "optimizer state for ", name, " is incomplete");
    EO_CHECK(a->second.sizes() == p.sizes(), "optimizer state for ", name, " has shape ", a->second.sizes(),
             ", the parameter ", p.sizes());
    auto ps = std::make_unique<torch::optim::AdamWParamState>();
    ps->step(static_cast<std::int64_t>(s->second.item<double>()));
    ps->exp_avg(a->second.to(p.device(), at::kFloat).clone());
    ps->exp_avg_sq(b->second.to(p.device(), at::kFloat).clone());
    st[p.unsafeGetTensorImpl()] = std::move(ps);
  }
}

}  // namespace eo
