// AdamW over the trainable (LoRA) parameters, the learning-rate schedule and gradient clipping,
// with the formulas of Hugging Face's Trainer so runs compare with axolotl's.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace eo {

struct TrainConfig;
using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// Multiplier of the peak learning rate for optimizer step `step` (0-based), as transformers'
// get_scheduler: "constant" (get_constant_schedule: 1, no warm-up), "constant_with_warmup",
// "linear", "cosine" (get_*_schedule_with_warmup: the first step of a warm-up uses 0).
double lr_multiplier(const std::string& schedule, std::int64_t step, std::int64_t warmup_steps, std::int64_t total_steps);

// Warmup steps from warmup_steps or warmup_ratio (ceil, as HF's get_warmup_steps).
std::int64_t resolve_warmup_steps(const TrainConfig& cfg, std::int64_t total_steps);

// Scales every gradient so their global L2 norm is at most max_norm (torch.nn.utils.
// clip_grad_norm_: coefficient max_norm / (norm + 1e-6), only when < 1). Returns the norm
// before clipping. Parameters without a gradient count as zero. Multi-tensor kernels (one
// launch for all gradients, not one per tensor); the norm stays on the device (fp64 []), so the
// step reads it with its losses, in one host synchronisation.
at::Tensor clip_grad_norm_on_device(const std::vector<at::Tensor>& params, double max_norm);
// The same, returning the norm read on the host.
double clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm);
// The global L2 norm alone (fp64 [] on the device), and the divisor that clips with it: fp32 []
// max(1, (norm + 1e-6) / max_norm), 1 where max_norm <= 0 or the norm is not finite. Passed to
// Optimizer::step, the fused AdamW divides each gradient by it as it reads it, so clipping costs
// no pass of its own over the gradients (clip_grad_norm_on_device scales them in one).
at::Tensor grad_norm_on_device(const std::vector<at::Tensor>& params);
// Its two halves, for gradients held in several places (runtime/expert_lora_offload.h): the
// per-parameter norms (fp32 [k], the k parameters with a gradient, in order; on their device), and
// the global norm from such norms (a list of fp32 [] on one device, in parameter order).
at::Tensor grad_norms(const std::vector<at::Tensor>& params);
at::Tensor combine_grad_norms(const std::vector<at::Tensor>& norms);
at::Tensor clip_divisor(const at::Tensor& norm, double max_norm);

// AdamW's settings (TrainConfig's adam_beta1, adam_beta2, adam_epsilon, weight_decay), and which
// parameters decay: all but biases and norm weights (names containing "bias" or "norm"), as HF's
// Trainer.
struct AdamWSettings {
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0;
  explicit AdamWSettings(const TrainConfig& cfg);
  static bool decays(const std::string& name);
};

// One AdamW update of parameters whose state the caller holds, k-th with k-th: the parameters,
// their gradients, both moments, their fp32 [] step counters, and whether each decays. What
// Optimizer::step runs (the same kernel calls in the same order), for state kept elsewhere
// (runtime/expert_lora_offload.h). skip and grad_divisor as Optimizer::step takes them.
struct AdamWTensors {
  std::vector<at::Tensor> params, grads, exp_avg, exp_avg_sq, steps;
  std::vector<bool> decay;
};
void adamw_update(const AdamWTensors& t, const AdamWSettings& s, double lr, const at::Tensor& skip,
                  const at::Tensor& grad_divisor);

// A checkpoint's optimizer state under today's names: a state saved before expert LoRA was stacked
// (per-expert names) stacked as the adapter is (models/lora.h).
std::map<std::string, at::Tensor> stacked_optimizer_state(const std::map<std::string, at::Tensor>& state);

// AdamW over named fp32 parameters with torch.optim.AdamW's math (decoupled decay
// p -= lr·wd·p, bias-corrected moments), run by ATen's fused multi-tensor kernel
// (at::_fused_adamw_, CPU and CUDA): one launch per decay group per step, not one chain of ops
// per tensor. Decay is not applied to biases and norm weights (names containing "bias" or
// "norm"), as HF's Trainer; LoRA A/B matrices decay. A parameter without a gradient is skipped
// (no step, no decay), as torch does.
//
// A step can be decided on the device: with `skip` (fp32 [] on the parameters' device, 1 or 0)
// the kernel leaves parameters, moments and step counts untouched where it is 1 (as
// torch.optim.AdamW(fused=True) under a GradScaler's found_inf), so the host need not read the
// gradient norm before it queues the update.
class Optimizer {
 public:
  Optimizer(const NamedTensors& params, const TrainConfig& cfg);
  ~Optimizer();
  // grad_divisor (fp32 [] on the device, optional): every gradient is divided by it before use,
  // as the fused kernel's grad_scale (clip_divisor's clipping).
  void step(double lr, const at::Tensor& skip = at::Tensor(), const at::Tensor& grad_divisor = at::Tensor());
  // set_to_none: drop the gradients (an unused parameter is then skipped by step()); else zero them
  // in place (CUDA graphs accumulate into them at fixed addresses).
  void zero_grad(bool set_to_none = true);
  // Optimizer state as named tensors ("<param>.exp_avg", ".exp_avg_sq", ".step" as fp64 [1]),
  // for checkpoints (reads the step counts from the device: one synchronisation). load_state also takes the per-expert names of checkpoints written before
  // expert LoRA was stacked (models/lora.h), stacking them.
  NamedTensors state() const;
  void load_state(const std::map<std::string, at::Tensor>& state);
  // fp64 [] on the device: 1 when a parameter or moment holds NaN/Inf, else 0 (one multi-tensor
  // max-norm pass, no host read). A skipped step cannot repair such a state, so the trainer stops.
  at::Tensor state_nonfinite() const;

 private:
  NamedTensors params_;
  std::vector<bool> decay_;
  AdamWSettings settings_;
  // Per parameter, undefined until its first step. step_ is the fused kernel's fp32 counter on
  // the parameter's device (exact up to 2^24 steps).
  std::vector<at::Tensor> exp_avg_, exp_avg_sq_, step_;
};

}  // namespace eo
