// A frozen NF4 linear whose backward re-fetches its weight (design.md §2.2).
//
// The autograd node keeps only a handle — (provider, layer, expert, matrix) for experts, or a
// pointer to a module-owned QuantizedWeight for resident linears — never the packed bytes nor
// the dequantised matrix. Backward asks the handle for the bytes current *then*, dequantises
// into a temporary and forms dX = dY · W. The weight is frozen: it gets no gradient, so the
// input activation is not needed either and is not saved.
#pragma once

#include <ATen/core/Tensor.h>

#include "models/nf4.h"
#include "models/weights.h"

namespace eo::model {

struct WeightHandle {
  WeightProvider* provider = nullptr;        // experts: fetched through the provider
  int layer = -1, expert = -1;
  ExpertMatrix matrix = ExpertMatrix::Gate;
  const nf4::QuantizedWeight* owned = nullptr;  // resident linears: owned by the module

  const nf4::QuantizedWeight& fetch() const;
};

// y = x · W^T with W = dequantize(handle.fetch()) in x's dtype.
at::Tensor linear4bit(const at::Tensor& x, const WeightHandle& handle);

}  // namespace eo::model
