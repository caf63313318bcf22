// fp16's dynamic loss scaling, with torch.amp.GradScaler's rules: the loss is multiplied by the
// scale before backward (so small gradients survive fp16), the optimizer divides it out again,
// and after each step the scale is halved on an overflow (the step is skipped by the trainer's
// non-finite guard) or doubled after `growth_interval` consecutive clean steps. The scale and its
// counter live on the device and are updated by torch's own kernel (_amp_update_scale_), so the
// host never reads them inside a step; every rank takes the same decision from the same found_inf.
// Without fp16 the scaler is disabled: no scale, update() does nothing.
#pragma once

#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>

#include <cstdint>

namespace eo {

class LossScaler {
 public:
  LossScaler() = default;
  // enabled: fp16 compute. init, growth and backoff: GradScaler's defaults (runtime/config.h).
  LossScaler(bool enabled, const at::Device& device, std::int64_t growth_interval);
  bool enabled() const { return scale_.defined(); }
  // fp32 [] on the device: what the loss is multiplied by (undefined when disabled).
  const at::Tensor& scale() const { return scale_; }
  // After a step: found_inf (fp32 [] on the device, 1 where the step overflowed and was skipped)
  // backs off or grows the scale, as GradScaler.update.
  void update(const at::Tensor& found_inf);
  // For checkpoints (reads the device): {"loss_scale": s, "loss_scale_growth_tracker": n}; empty
  // when disabled. load_state takes that (missing keys: the initial state).
  nlohmann::json state() const;
  void load_state(const nlohmann::json& extra);

 private:
  at::Tensor scale_;           // fp32 []
  at::Tensor growth_tracker_;  // int32 []: clean steps since the last change
  std::int64_t growth_interval_ = 2000;
};

}  // namespace eo
