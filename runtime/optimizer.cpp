#include "runtime/optimizer.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <cmath>
#include <optional>

#include "common/error.h"
#include "models/lora.h"
#include "runtime/config.h"

namespace eo {

double lr_multiplier(const std::string& schedule, std::int64_t step, std::int64_t warmup, std::int64_t total) {
  if (schedule == "constant") return 1.0;  // get_constant_schedule: no warm-up, whatever warmup_steps says
  if (step < warmup) return double(step) / double(std::max<std::int64_t>(1, warmup));
  if (schedule == "constant_with_warmup") return 1.0;
  // transformers' formulas as written there (a warm-up as long as the run leaves linear at 0).
  if (schedule == "linear")
    return std::max(0.0, double(total - step) / double(std::max<std::int64_t>(1, total - warmup)));
  const double progress = double(step - warmup) / double(std::max<std::int64_t>(1, total - warmup));
  if (schedule == "cosine") return std::max(0.0, 0.5 * (1.0 + std::cos(M_PI * progress)));
  EO_FAIL("unknown lr_scheduler '", schedule, "'");
}

std::int64_t resolve_warmup_steps(const TrainConfig& cfg, std::int64_t total_steps) {
  if (cfg.warmup_ratio) return static_cast<std::int64_t>(std::ceil(*cfg.warmup_ratio * double(total_steps)));
  return cfg.warmup_steps;
}

namespace {
// The gradients that exist (a parameter without one counts as zero everywhere below).
std::vector<at::Tensor> defined_grads(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> grads;
  for (const auto& p : params)
    if (p.grad().defined()) grads.push_back(p.grad());
  return grads;
}
}  // namespace

at::Tensor grad_norm_on_device(const std::vector<at::Tensor>& params) {
  const std::vector<at::Tensor> grads = defined_grads(params);
  if (grads.empty()) return at::zeros({}, at::TensorOptions().dtype(at::kDouble));
  // Per-tensor norms in one multi-tensor kernel (fp32, each reduced in a tree), combined in fp64
  // so the total does not depend on the order of ~37k tensors.
  return combine_grad_norms(at::_foreach_norm(grads, 2));
}

at::Tensor grad_norms(const std::vector<at::Tensor>& params) {
  const std::vector<at::Tensor> grads = defined_grads(params);
  if (grads.empty()) return at::zeros({0}, at::TensorOptions().dtype(at::kFloat));
  return at::stack(at::_foreach_norm(grads, 2));
}

at::Tensor combine_grad_norms(const std::vector<at::Tensor>& norms) {
  if (norms.empty()) return at::zeros({}, at::TensorOptions().dtype(at::kDouble));
  return at::stack(norms).to(at::kDouble).pow(2).sum().sqrt();
}

namespace {
// torch's clip coefficient max_norm / (norm + 1e-6) where it is < 1 and the norm finite, else 1.
at::Tensor clip_coefficient(const at::Tensor& norm, double max_norm) {
  const at::Tensor coef = (max_norm / (norm + 1e-6)).clamp_max(1.0);
  return at::where(at::isfinite(norm), coef, at::ones_like(coef));
}
}  // namespace

at::Tensor clip_divisor(const at::Tensor& norm, double max_norm) {
  if (max_norm <= 0) return at::ones({}, norm.options().dtype(at::kFloat));
  return (1.0 / clip_coefficient(norm, max_norm)).to(at::kFloat);
}

at::Tensor clip_grad_norm_on_device(const std::vector<at::Tensor>& params, double max_norm) {
  const at::Tensor norm = grad_norm_on_device(params);
  if (const std::vector<at::Tensor> grads = defined_grads(params); max_norm > 0 && !grads.empty())
    at::_foreach_mul_(grads, clip_coefficient(norm, max_norm).to(at::kFloat));  // x * 1 = x
  return norm;
}

double clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm) {
  return clip_grad_norm_on_device(params, max_norm).item<double>();
}

namespace {
const char* kSuffixes[] = {".exp_avg", ".exp_avg_sq", ".step"};
}  // namespace

AdamWSettings::AdamWSettings(const TrainConfig& cfg)
    : beta1(cfg.adam_beta1), beta2(cfg.adam_beta2), eps(cfg.adam_epsilon), weight_decay(cfg.weight_decay) {}

bool AdamWSettings::decays(const std::string& name) {
  return name.find("bias") == std::string::npos && name.find("norm") == std::string::npos;
}

void adamw_update(const AdamWTensors& t, const AdamWSettings& s, double lr, const at::Tensor& skip,
                  const at::Tensor& grad_divisor) {
  at::NoGradGuard ng;
  std::optional<at::Tensor> found_inf, grad_scale;
  if (grad_divisor.defined()) {
    EO_CHECK(grad_divisor.dim() == 0 && grad_divisor.scalar_type() == at::kFloat,
             "AdamW: grad_divisor must be an fp32 scalar tensor");
    grad_scale = grad_divisor;
  }
  at::Tensor advance;  // what each step count gains: 1, or 1 - skip
  if (skip.defined()) {
    EO_CHECK(skip.dim() == 0 && skip.scalar_type() == at::kFloat, "AdamW: skip must be an fp32 scalar tensor");
    found_inf = skip;
    advance = 1 - skip;
  }
  for (const bool decay : {true, false}) {
    std::vector<at::Tensor> ps, gs, ms, vs, ss;
    for (std::size_t i = 0; i < t.params.size(); ++i) {
      if (t.decay[i] != decay) continue;
      ps.push_back(t.params[i]);
      gs.push_back(t.grads[i]);
      ms.push_back(t.exp_avg[i]);
      vs.push_back(t.exp_avg_sq[i]);
      ss.push_back(t.steps[i]);
    }
    if (ps.empty()) continue;
    // As torch.optim.AdamW(fused=True): the counters advance first, the kernel reads them (a
    // skipped step's counters do not advance; its kernel returns before reading them).
    if (advance.defined())
      at::_foreach_add_(ss, advance);
    else
      at::_foreach_add_(ss, 1.0);
    at::_fused_adamw_(ps, gs, ms, vs, /*max_exp_avg_sqs=*/{}, ss, lr, s.beta1, s.beta2, decay ? s.weight_decay : 0.0,
                      s.eps, /*amsgrad=*/false, /*maximize=*/false, grad_scale, found_inf);
  }
}

Optimizer::Optimizer(const NamedTensors& params, const TrainConfig& cfg)
    : params_(params), settings_(cfg), exp_avg_(params.size()), exp_avg_sq_(params.size()), step_(params.size()) {
  for (const auto& [name, p] : params) {
    EO_CHECK(p.scalar_type() == at::kFloat, "trainable parameter ", name, " must be fp32 (master weights)");
    EO_CHECK(p.device() == params.front().second.device(), "trainable parameter ", name, " is on ", p.device(),
             ", the others on ", params.front().second.device());
    decay_.push_back(AdamWSettings::decays(name));
  }
}

Optimizer::~Optimizer() = default;

void Optimizer::step(double lr, const at::Tensor& skip, const at::Tensor& grad_divisor) {
  at::NoGradGuard ng;
  AdamWTensors t;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i].second;
    if (!p.grad().defined()) continue;  // no gradient: no step, no decay (as torch)
    if (!step_[i].defined()) {
      exp_avg_[i] = at::zeros_like(p, at::MemoryFormat::Preserve);
      exp_avg_sq_[i] = at::zeros_like(p, at::MemoryFormat::Preserve);
      step_[i] = at::zeros({}, p.options());
    }
    t.params.push_back(p);
    t.grads.push_back(p.grad());
    t.exp_avg.push_back(exp_avg_[i]);
    t.exp_avg_sq.push_back(exp_avg_sq_[i]);
    t.steps.push_back(step_[i]);
    t.decay.push_back(decay_[i]);
  }
  adamw_update(t, settings_, lr, skip, grad_divisor);
}

void Optimizer::zero_grad(bool set_to_none) {
  if (set_to_none) {
    for (auto& [name, p] : params_) p.mutable_grad() = at::Tensor();
    return;
  }
  std::vector<at::Tensor> grads;
  for (auto& [name, p] : params_)
    if (p.grad().defined()) grads.push_back(p.grad());
  if (!grads.empty()) at::_foreach_zero_(grads);
}

NamedTensors Optimizer::state() const {
  std::vector<at::Tensor> counters;
  for (const auto& s : step_)
    if (s.defined()) counters.push_back(s);
  if (counters.empty()) return {};
  const at::Tensor steps = at::stack(counters).to(at::kCPU, at::kDouble);  // one read for all
  NamedTensors out;
  std::int64_t k = 0;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    if (!step_[i].defined()) continue;  // never stepped
    const std::string& name = params_[i].first;
    out.emplace_back(name + ".exp_avg", exp_avg_[i]);
    out.emplace_back(name + ".exp_avg_sq", exp_avg_sq_[i]);
    out.emplace_back(name + ".step", steps.narrow(0, k++, 1).clone());
  }
  return out;
}

at::Tensor Optimizer::state_nonfinite() const {
  std::vector<at::Tensor> all;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    all.push_back(params_[i].second);
    if (exp_avg_[i].defined()) all.push_back(exp_avg_[i]);
    if (exp_avg_sq_[i].defined()) all.push_back(exp_avg_sq_[i]);
  }
  if (all.empty()) return at::zeros({}, at::TensorOptions().dtype(at::kDouble));
  // The max-norm is NaN or Inf exactly when some element is (it cannot overflow).
  const at::Tensor amax = at::stack(at::_foreach_norm(all, INFINITY)).to(at::kDouble).sum();
  return at::logical_not(at::isfinite(amax)).to(at::kDouble);
}

// Checkpoints written before expert LoRA was stacked name its state per expert
// ("<...>.experts.{e}.<matrix>.lora_A.weight.exp_avg"): stack those like the adapter
// (models/lora.h). Their steps are equal unless an expert once got no token; take the largest.
std::map<std::string, at::Tensor> stacked_optimizer_state(const std::map<std::string, at::Tensor>& state) {
  std::map<std::string, at::Tensor> out;
  for (const char* suffix : kSuffixes) {
    const std::string sfx = suffix;
    model::NamedLora part;
    for (const auto& [k, v] : state)
      if (k.size() > sfx.size() && k.compare(k.size() - sfx.size(), sfx.size(), sfx) == 0)
        part.emplace_back(k.substr(0, k.size() - sfx.size()), v);
    for (auto& [k, v] : model::stack_expert_lora(part))
      out[k + sfx] = (sfx == ".step" && v.dim() == 2) ? v.amax(0) : v;
  }
  return out;
}

void Optimizer::load_state(const std::map<std::string, at::Tensor>& saved) {
  const std::map<std::string, at::Tensor> state = stacked_optimizer_state(saved);
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const auto& [name, p] = params_[i];
    auto a = state.find(name + ".exp_avg");
    if (a == state.end()) continue;
    auto b = state.find(name + ".exp_avg_sq");
    auto s = state.find(name + ".step");
    EO_CHECK(b != state.end() && s != state.end(), "optimizer state for ", name, " is incomplete");
    EO_CHECK(a->second.sizes() == p.sizes(), "optimizer state for ", name, " has shape ", a->second.sizes(),
             ", the parameter ", p.sizes());
    exp_avg_[i] = a->second.to(p.device(), at::kFloat).clone();
    exp_avg_sq_[i] = b->second.to(p.device(), at::kFloat).clone();
    step_[i] = at::full({}, s->second.item<double>(), p.options());
  }
}

}  // namespace eo
