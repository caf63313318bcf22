#include "models/load_checks.h"

#include <ATen/ATen.h>

#include <cmath>
#include <cstdio>
#include <limits>

#include "common/error.h"

namespace eo::model {
namespace {

[[noreturn]] void refuse(const std::string& folder, const std::string& name, const std::string& what) {
  throw Error("checkpoint " + folder + ": tensor '" + name + "' " + what +
              "; the model cannot train from it (a damaged download or a broken export: fetch or export it again)");
}

// "N of M elements ..., the first at flat index I".
std::string count_of(const at::Tensor& bad) {
  const std::int64_t n = bad.sum().item<std::int64_t>();
  const std::int64_t first = bad.reshape(-1).nonzero().min().item<std::int64_t>();
  return std::to_string(n) + " of " + std::to_string(bad.numel()) + " elements, the first at flat index " +
         std::to_string(first);
}

}  // namespace

void check_finite_input(const std::string& folder, const std::string& name, const at::Tensor& t) {
  if (!t.defined() || !t.is_floating_point() || t.numel() == 0) return;
  if (at::isfinite(t).all().item<bool>()) return;
  refuse(folder, name, "holds NaN or infinity (" + count_of(at::logical_not(at::isfinite(t))) + ")");
}

void check_nvfp4_global_scale(const std::string& folder, const std::string& name, float global) {
  // The largest value an NVFP4 element decodes to is 6 (FP4) x 448 (E4M3) x global.
  constexpr float kLimit = std::numeric_limits<float>::max() / (6.0f * 448.0f);
  if (std::isfinite(global) && global > 0 && global <= kLimit) return;
  char buf[64];
  std::snprintf(buf, sizeof buf, "%g", double(global));
  refuse(folder, name, std::string("is the NVFP4 global scale ") + buf +
                           (std::isfinite(global) ? global <= 0 ? ", not positive"
                                                                : ": times the largest block scale (448) and FP4 value (6) "
                                                                  "it overflows float32"
                                                  : ", not a finite number"));
}

void check_e4m3_scales(const std::string& folder, const std::string& name, const at::Tensor& scales) {
  const at::Tensor bytes = scales.view(at::kByte);
  const at::Tensor bad = bytes.bitwise_and(0x7f).eq(0x7f);  // float8_e4m3fn: S.1111.111 is NaN
  if (bad.any().item<bool>()) refuse(folder, name, "holds NaN E4M3 block scales (" + count_of(bad) + ")");
}

void check_e8m0_scales(const std::string& folder, const std::string& name, const at::Tensor& scales) {
  const at::Tensor bad = scales.eq(255);  // E8M0: 255 is NaN
  if (bad.any().item<bool>()) refuse(folder, name, "holds E8M0 block scales of 255, which encode NaN (" + count_of(bad) + ")");
}

}  // namespace eo::model
