#include "models/quantized_weight.h"

#include <iterator>

#include "common/error.h"
#include "models/mxfp4.h"
#include "models/nf4.h"
#include "models/nvfp4.h"

namespace eo {

namespace {

// Each format's dequantisers, one row per QuantFormat in its order (models/quant_format.h): a
// stack of same-shaped weights into one [count, rows, cols] tensor, or a window of its rows and
// columns.
struct Dequantizers {
  at::Tensor (*stack)(const std::vector<const QuantizedWeight*>&, at::ScalarType);
  at::Tensor (*window)(const std::vector<const QuantizedWeight*>&, at::ScalarType, std::int64_t, std::int64_t,
                       std::int64_t, std::int64_t);
};
const Dequantizers kDequantizers[] = {
    {nf4::dequantize_stack, nf4::dequantize_stack_window},
    {mxfp4::dequantize_stack, mxfp4::dequantize_stack_window},
    {nvfp4::dequantize_stack, nvfp4::dequantize_stack_window},
};
static_assert(std::size(kDequantizers) == std::size(kQuantFormats), "one dequantiser row per QuantFormat");
const Dequantizers& dequantizers(QuantFormat f) { return kDequantizers[static_cast<int>(f)]; }

}  // namespace

std::int64_t QuantizedWeight::numel() const {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

std::int64_t QuantizedWeight::nblocks() const { return (numel() + blocksize - 1) / blocksize; }

const at::Tensor& QuantizedWeight::stats() const {
  return format != QuantFormat::Nf4 ? scales : nested ? nested->absmax_codes : absmax;
}

std::int64_t QuantizedWeight::bytes() const {
  std::int64_t total = packed.defined() ? packed.nbytes() : 0;
  if (absmax.defined()) total += absmax.nbytes();
  if (scales.defined()) total += scales.nbytes();
  if (global_scale.defined()) total += global_scale.nbytes();
  if (nested) total += nested->absmax_codes.nbytes() + nested->nested_absmax.nbytes() + nested->nested_code.nbytes();
  return total;
}

at::Tensor dequantize(const QuantizedWeight& q, at::ScalarType dtype) {
  if (q.format == QuantFormat::Nf4) return nf4::dequantize(q, dtype);  // keeps the weight's own shape
  return dequantizers(q.format).stack({&q}, dtype)[0];
}

at::Tensor dequantize(const QuantizedWeight& q) { return dequantize(q, q.dtype); }

at::Tensor dequantize_stack(const std::vector<const QuantizedWeight*>& qs, at::ScalarType dtype) {
  EO_CHECK(!qs.empty(), "dequantize_stack: no weights");
  return dequantizers(qs.front()->format).stack(qs, dtype);
}

at::Tensor dequantize_stack_window(const std::vector<const QuantizedWeight*>& qs, at::ScalarType dtype, std::int64_t r0,
                                   std::int64_t rows, std::int64_t c0, std::int64_t cols) {
  EO_CHECK(!qs.empty(), "dequantize_stack_window: no weights");
  return dequantizers(qs.front()->format).window(qs, dtype, r0, rows, c0, cols);
}

}  // namespace eo
