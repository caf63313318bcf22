// dequantize_stack_window as MXFP4 and NVFP4 share it (mxfp4.cpp, nvfp4.cpp): the window checks,
// the CUDA kernel on a GPU, and on the CPU the window's rows decoded whole, then its columns cut.
// The formats differ in what each .cpp supplies as a format struct F:
//   F::kName               "mxfp4" / "nvfp4", the prefix of every message
//   F::kGroup              values per scale byte
//   F::kDecoded            the dtype the CPU decode writes, exact for every value (bf16 / fp32)
//   F::check_stack(qs)     the weights are the format's, of one shape on one device
//   F::decode(q, codes, scales, groups, out)   CPU: `groups` scale groups of q from these bytes on
//   F::Window, F::source(q), F::dequantize     CUDA builds: the format's kernel (mxfp4_cuda.h / nvfp4_cuda.h)
// Only those two files include it.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "common/error.h"
#include "models/nf4.h"

#ifdef EO_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common/cuda_check.h"
#include "models/nf4_cuda.h"
#endif

namespace eo::fp4 {

#ifdef EO_WITH_CUDA
template <typename F>
at::Tensor dequantize_cuda(const std::vector<const QuantizedWeight*>& qs, at::ScalarType dtype, const typename F::Window& w) {
  const at::Device dev = qs.front()->packed.device();
  c10::cuda::CUDAGuard guard(dev);
  std::vector<typename F::Source> sources;
  sources.reserve(qs.size());
  for (const QuantizedWeight* q : qs) {
    EO_CHECK(q->packed.is_contiguous() && q->scales.is_contiguous(), F::kName, "::dequantize: CUDA tensors must be contiguous");
    sources.push_back(F::source(*q));
  }
  using nf4::cuda::OutType;
  const auto type = dtype == at::kFloat ? OutType::F32 : dtype == at::kBFloat16 ? OutType::BF16 : OutType::F16;
  at::Tensor out = at::empty({static_cast<std::int64_t>(qs.size()), w.rows, w.cols}, at::TensorOptions().dtype(dtype).device(dev));
  const cudaError_t rc = F::dequantize(sources.data(), static_cast<int>(qs.size()), w, out.data_ptr(), type,
                                       c10::cuda::getCurrentCUDAStream(dev.index()).stream());
  EO_CUDA_CHECK(rc, F::kName, ": CUDA dequantize kernel launch (codes must be 4-byte aligned, window columns multiples of 8)");
  return out;
}
#endif

template <typename F>
at::Tensor dequantize_stack_window(const std::vector<const QuantizedWeight*>& qs, at::ScalarType dtype, std::int64_t r0,
                                   std::int64_t rows, std::int64_t c0, std::int64_t cols) {
  EO_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, F::kName,
           "::dequantize: the output dtype must be float32, bfloat16 or float16, got ", dtype, ".");
  F::check_stack(qs);
  const std::int64_t out = qs.front()->shape[0], in = qs.front()->shape[1];
  EO_CHECK(r0 >= 0 && rows > 0 && r0 + rows <= out && c0 >= 0 && cols > 0 && c0 + cols <= in, F::kName,
           "::dequantize_stack_window: window rows [", r0, ", ", r0 + rows, ") x cols [", c0, ", ", c0 + cols, ") outside [",
           out, ", ", in, "]");
#ifdef EO_WITH_CUDA
  if (qs.front()->packed.is_cuda()) return dequantize_cuda<F>(qs, dtype, typename F::Window{in, r0, rows, c0, cols});
#endif
  // CPU: decode the rows of the window whole (a row's groups are contiguous), then cut the columns
  // and round to dtype (nearest even; nothing to round where dtype is the decoded one).
  const auto count = static_cast<std::int64_t>(qs.size());
  at::Tensor bank = at::empty({count, rows, in}, at::TensorOptions().dtype(F::kDecoded));
  for (std::int64_t i = 0; i < count; ++i) {
    const at::Tensor codes = qs[i]->packed.contiguous(), scales = qs[i]->scales.contiguous();
    F::decode(*qs[i], codes.data_ptr<std::uint8_t>() + r0 * in / 2, scales.data_ptr<std::uint8_t>() + r0 * in / F::kGroup,
              rows * in / F::kGroup, bank[i].data_ptr());
  }
  at::Tensor w = c0 == 0 && cols == in ? bank : bank.narrow(2, c0, cols).contiguous();
  return w.to(dtype);
}

}  // namespace eo::fp4
