#include "models/mxfp4.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <array>

#include "common/error.h"
#include "models/mxfp4_decode.h"

#ifdef EO_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common/cuda_check.h"
#include "models/mxfp4_cuda.h"
#endif

namespace eo::mxfp4 {
namespace {

// bf16 bits of every (scale, code) pair: the CPU path's decode is this table of bf16_bits.
const std::array<std::uint16_t, 256 * 16>& table() {
  static const std::array<std::uint16_t, 256 * 16> t = [] {
    std::array<std::uint16_t, 256 * 16> v{};
    for (unsigned s = 0; s < 256; ++s)
      for (unsigned c = 0; c < 16; ++c) v[s * 16 + c] = bf16_bits(c, s);
    return v;
  }();
  return t;
}

// `groups` groups of 16 code bytes and one scale each → bf16 bits, 32 per group in order.
void decode_groups(const std::uint8_t* codes, const std::uint8_t* scales, std::int64_t groups, std::uint16_t* out) {
  const auto& t = table();
  at::parallel_for(0, groups, 1024, [&](std::int64_t first, std::int64_t last) {
    for (std::int64_t g = first; g < last; ++g) {
      const std::uint16_t* row = t.data() + 16 * static_cast<unsigned>(scales[g]);
      const std::uint8_t* b = codes + 16 * g;
      std::uint16_t* o = out + 32 * g;
      for (int j = 0; j < 16; ++j) {
        o[2 * j] = row[b[j] & 15];  // low nibble first
        o[2 * j + 1] = row[b[j] >> 4];
      }
    }
  });
}

void check_dtype(at::ScalarType dtype) {
  EO_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
           "mxfp4::dequantize: the output dtype must be float32, bfloat16 or float16, got ", dtype, ".");
}

void check_weight(const nf4::QuantizedWeight& q) {
  EO_CHECK(q.format == QuantFormat::Mxfp4 && q.shape.size() == 2 && q.shape[1] % kGroup == 0 && q.packed.defined() &&
               q.scales.defined(),
           "mxfp4: not an MXFP4 weight (format ", quant_format_name(q.format), ")");
  EO_CHECK(q.packed.numel() == q.numel() / 2 && q.scales.numel() == q.numel() / kGroup && q.packed.scalar_type() == at::kByte &&
               q.scales.scalar_type() == at::kByte,
           "mxfp4: weight [", q.shape[0], ", ", q.shape[1], "] has ", q.packed.numel(), " code bytes and ", q.scales.numel(),
           " scales, expected ", q.numel() / 2, " and ", q.numel() / kGroup);
}

void check_stack(const std::vector<const nf4::QuantizedWeight*>& qs) {
  EO_CHECK(!qs.empty(), "mxfp4::dequantize_stack: no weights");
  for (const nf4::QuantizedWeight* q : qs) {
    check_weight(*q);
    EO_CHECK(q->shape == qs.front()->shape && q->packed.device() == qs.front()->packed.device() &&
                 q->scales.device() == q->packed.device(),
             "mxfp4::dequantize_stack: the weights differ in shape or device");
  }
}

#ifdef EO_WITH_CUDA
at::Tensor dequantize_cuda(const std::vector<const nf4::QuantizedWeight*>& qs, at::ScalarType dtype, const cuda::Mxfp4Window& w) {
  const at::Device dev = qs.front()->packed.device();
  c10::cuda::CUDAGuard guard(dev);
  std::vector<cuda::Mxfp4Source> sources;
  sources.reserve(qs.size());
  for (const nf4::QuantizedWeight* q : qs) {
    EO_CHECK(q->packed.is_contiguous() && q->scales.is_contiguous(), "mxfp4::dequantize: CUDA tensors must be contiguous");
    sources.push_back({q->packed.data_ptr<std::uint8_t>(), q->scales.data_ptr<std::uint8_t>()});
  }
  const auto type = dtype == at::kFloat ? cuda::OutType::F32 : dtype == at::kBFloat16 ? cuda::OutType::BF16 : cuda::OutType::F16;
  at::Tensor out = at::empty({static_cast<std::int64_t>(qs.size()), w.rows, w.cols}, at::TensorOptions().dtype(dtype).device(dev));
  const cudaError_t rc = cuda::dequantize(sources.data(), static_cast<int>(qs.size()), w, out.data_ptr(), type,
                                          c10::cuda::getCurrentCUDAStream(dev.index()).stream());
  EO_CUDA_CHECK(rc, "mxfp4: CUDA dequantize kernel launch (codes must be 4-byte aligned, window columns multiples of 8)");
  return out;
}
#endif

}  // namespace

at::Tensor dequantize(const at::Tensor& blocks, const at::Tensor& scales) {
  EO_CHECK(blocks.scalar_type() == at::kByte && scales.scalar_type() == at::kByte, "mxfp4: blocks and scales must be uint8");
  EO_CHECK(blocks.dim() >= 2 && blocks.size(-1) == 16 && blocks.sizes().slice(0, blocks.dim() - 1) == scales.sizes(),
           "mxfp4: blocks ", blocks.sizes(), " and scales ", scales.sizes(), " do not match ([..., G, 16] and [..., G])");
  const at::Tensor b = blocks.to(at::kCPU).contiguous(), s = scales.to(at::kCPU).contiguous();
  std::vector<std::int64_t> shape(scales.sizes().begin(), scales.sizes().end());
  shape.back() *= kGroup;
  at::Tensor out = at::empty(shape, at::TensorOptions().dtype(at::kBFloat16));
  decode_groups(b.data_ptr<std::uint8_t>(), s.data_ptr<std::uint8_t>(), s.numel(),
                reinterpret_cast<std::uint16_t*>(out.data_ptr()));
  return out.to(blocks.device());
}

nf4::QuantizedWeight weight(const at::Tensor& blocks, const at::Tensor& scales) {
  EO_CHECK(blocks.dim() == 3 && blocks.size(2) == 16 && scales.dim() == 2 && blocks.size(0) == scales.size(0) &&
               blocks.size(1) == scales.size(1) && blocks.scalar_type() == at::kByte && scales.scalar_type() == at::kByte,
           "mxfp4::weight: expected uint8 blocks [rows, G, 16] and scales [rows, G], got ", blocks.sizes(), " and ",
           scales.sizes());
  nf4::QuantizedWeight q;
  q.format = QuantFormat::Mxfp4;
  q.shape = {blocks.size(0), blocks.size(1) * kGroup};
  q.blocksize = kGroup;
  q.dtype = at::kBFloat16;
  q.packed = blocks.contiguous().view({q.numel() / 2, 1});  // row-major [rows, G·16] is row-major [out, in / 2]
  q.scales = scales.contiguous().view({q.numel() / kGroup});
  if (q.packed.data_ptr() == blocks.data_ptr()) q.packed = q.packed.clone();  // own the bytes (a view of an mmapped file)
  if (q.scales.data_ptr() == scales.data_ptr()) q.scales = q.scales.clone();
  return q;
}

at::Tensor dequantize_stack(const std::vector<const nf4::QuantizedWeight*>& qs, at::ScalarType dtype) {
  check_stack(qs);
  const auto& shape = qs.front()->shape;
  return mxfp4::dequantize_stack_window(qs, dtype, 0, shape[0], 0, shape[1]);
}

at::Tensor dequantize_stack_window(const std::vector<const nf4::QuantizedWeight*>& qs, at::ScalarType dtype, std::int64_t r0,
                                   std::int64_t rows, std::int64_t c0, std::int64_t cols) {
  check_dtype(dtype);
  check_stack(qs);
  const std::int64_t out = qs.front()->shape[0], in = qs.front()->shape[1];
  EO_CHECK(r0 >= 0 && rows > 0 && r0 + rows <= out && c0 >= 0 && cols > 0 && c0 + cols <= in,
           "mxfp4::dequantize_stack_window: window rows [", r0, ", ", r0 + rows, ") x cols [", c0, ", ", c0 + cols,
           ") outside [", out, ", ", in, "]");
#ifdef EO_WITH_CUDA
  if (qs.front()->packed.is_cuda()) return dequantize_cuda(qs, dtype, cuda::Mxfp4Window{in, r0, rows, c0, cols});
#endif
  // CPU: decode the rows of the window whole (a row's groups are contiguous), then cut the columns.
  const auto count = static_cast<std::int64_t>(qs.size());
  at::Tensor bank = at::empty({count, rows, in}, at::TensorOptions().dtype(at::kBFloat16));
  for (std::int64_t i = 0; i < count; ++i) {
    const at::Tensor codes = qs[i]->packed.contiguous(), scales = qs[i]->scales.contiguous();
    decode_groups(codes.data_ptr<std::uint8_t>() + r0 * in / 2, scales.data_ptr<std::uint8_t>() + r0 * in / kGroup,
                  rows * in / kGroup, reinterpret_cast<std::uint16_t*>(bank[i].data_ptr()));
  }
  at::Tensor w = c0 == 0 && cols == in ? bank : bank.narrow(2, c0, cols).contiguous();
  return w.to(dtype);
}

}  // namespace eo::mxfp4
