#include "models/quantized_weight.h"

#include "common/error.h"
#include "models/mxfp4.h"
#include "models/nf4.h"
#include "models/nvfp4.h"

namespace eo {

const char* quant_format_name(QuantFormat f) {
  return f == QuantFormat::Mxfp4 ? "MXFP4" : f == QuantFormat::Nvfp4 ? "NVFP4" : "NF4";
}

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
  if (q.format == QuantFormat::Mxfp4) return mxfp4::dequantize_stack({&q}, dtype)[0];
  if (q.format == QuantFormat::Nvfp4) return nvfp4::dequantize_stack({&q}, dtype)[0];
  return nf4::dequantize(q, dtype);
}

at::Tensor dequantize(const QuantizedWeight& q) { return dequantize(q, q.dtype); }

at::Tensor dequantize_stack(const std::vector<const QuantizedWeight*>& qs, at::ScalarType dtype) {
  EO_CHECK(!qs.empty(), "dequantize_stack: no weights");
  const QuantFormat f = qs.front()->format;
  if (f == QuantFormat::Mxfp4) return mxfp4::dequantize_stack(qs, dtype);
  if (f == QuantFormat::Nvfp4) return nvfp4::dequantize_stack(qs, dtype);
  return nf4::dequantize_stack(qs, dtype);
}

at::Tensor dequantize_stack_window(const std::vector<const QuantizedWeight*>& qs, at::ScalarType dtype, std::int64_t r0,
                                   std::int64_t rows, std::int64_t c0, std::int64_t cols) {
  EO_CHECK(!qs.empty(), "dequantize_stack_window: no weights");
  const QuantFormat f = qs.front()->format;
  if (f == QuantFormat::Mxfp4) return mxfp4::dequantize_stack_window(qs, dtype, r0, rows, c0, cols);
  if (f == QuantFormat::Nvfp4) return nvfp4::dequantize_stack_window(qs, dtype, r0, rows, c0, cols);
  return nf4::dequantize_stack_window(qs, dtype, r0, rows, c0, cols);
}

}  // namespace eo
