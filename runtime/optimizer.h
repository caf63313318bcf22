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

namespace torch::optim {
class AdamW;
}

namespace eo {

struct TrainConfig;
using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// Multiplier of the peak learning rate for optimizer step `step` (0-based), as transformers'
// get_{constant,linear,cosine}_schedule_with_warmup: the first step of a warmup uses 0.
double lr_multiplier(const std::string& schedule, std::int64_t step, std::int64_t warmup_steps, std::int64_t total_steps);

// Warmup steps from warmup_steps or warmup_ratio (ceil, as HF's get_warmup_steps).
std::int64_t resolve_warmup_steps(const TrainConfig& cfg, std::int64_t total_steps);

// Scales every gradient so their global L2 norm is at most max_norm (torch.nn.utils.
// clip_grad_norm_: coefficient max_norm / (norm + 1e-6), only when < 1). Returns the norm
// before clipping. Parameters without a gradient count as zero.
double clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm);

// libtorch's AdamW over named fp32 parameters. Decay is not applied to biases and norm
// weights (names containing "bias" or "norm"), as HF's Trainer; LoRA A/B matrices decay.
class Optimizer {
 public:
  Optimizer(const NamedTensors& params, const TrainConfig& cfg);
  ~Optimizer();
  void step(double lr);
  void zero_grad();
  // Optimizer state as named tensors ("<param>.exp_avg", ".exp_avg_sq", ".step"), for checkpoints.
  NamedTensors state() const;
  void load_state(const std::map<std::string, at::Tensor>& state);

 private:
  NamedTensors params_;
  std::unique_ptr<torch::optim::AdamW> adamw_;
};

}  // namespace eo
