#include "runtime/loss_scale.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "common/error.h"
#include "runtime/config.h"

namespace eo {

LossScaler::LossScaler(bool enabled, const at::Device& device, std::int64_t growth_interval)
    : growth_interval_(growth_interval) {
  if (!enabled) return;
  const auto opts = at::TensorOptions().device(device);
  scale_ = at::full({}, kLossScaleInit, opts.dtype(at::kFloat));
  growth_tracker_ = at::zeros({}, opts.dtype(at::kInt));
}

void LossScaler::update(const at::Tensor& found_inf) {
  if (!enabled()) return;
  at::NoGradGuard ng;
  EO_CHECK(found_inf.numel() == 1 && found_inf.scalar_type() == at::kFloat, "LossScaler::update: found_inf must be an fp32 scalar");
  at::_amp_update_scale_(scale_, growth_tracker_, found_inf.to(scale_.device()), kLossScaleGrowth, kLossScaleBackoff,
                         growth_interval_);
}

nlohmann::json LossScaler::state() const {
  if (!enabled()) return nlohmann::json::object();
  // Powers of two and a small count: exact in JSON's doubles.
  return {{"loss_scale", scale_.item<double>()}, {"loss_scale_growth_tracker", growth_tracker_.item<std::int64_t>()}};
}

void LossScaler::load_state(const nlohmann::json& extra) {
  if (!enabled() || !extra.contains("loss_scale")) return;
  at::NoGradGuard ng;
  scale_.fill_(extra.at("loss_scale").get<double>());
  growth_tracker_.fill_(extra.value("loss_scale_growth_tracker", std::int64_t(0)));
}

}  // namespace eo
