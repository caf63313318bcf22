#include "models/merge_aware.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "models/nvfp4.h"

namespace eo::model {
namespace {

struct SnapNvfp4Function : public torch::autograd::Function<SnapNvfp4Function> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& w, const at::Tensor& global) {
    return nvfp4::fake_quantize(w, global);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*, torch::autograd::variable_list grad) {
    return {grad[0], at::Tensor()};
  }
};

}  // namespace

at::Tensor snap_nvfp4_ste(const at::Tensor& w, const at::Tensor& global) {
  return SnapNvfp4Function::apply(w, global.detach());
}

}  // namespace eo::model
