#include "models/mxfp4.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <array>

#include "common/error.h"
#include "models/fp4_stack.h"
#include "models/mxfp4_decode.h"

#ifdef EO_WITH_CUDA
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

void check_weight(const QuantizedWeight& q) {
  EO_CHECK(q.format == QuantFormat::Mxfp4 && q.shape.size() == 2 && q.shape[1] % kGroup == 0 && q.packed.defined() &&
               q.scales.defined(),
           "mxfp4: not an MXFP4 weight (format ", quant_format_name(q.format), ")");
  EO_CHECK(q.packed.numel() == q.numel() / 2 && q.scales.numel() == q.numel() / kGroup && q.packed.scalar_type() == at::kByte &&
               q.scales.scalar_type() == at::kByte,
           "mxfp4: weight [", q.shape[0], ", ", q.shape[1], "] has ", q.packed.numel(), " code bytes and ", q.scales.numel(),
           " scales, expected ", q.numel() / 2, " and ", q.numel() / kGroup);
}

void check_stack(const std::vector<const QuantizedWeight*>& qs) {
  EO_CHECK(!qs.empty(), "mxfp4::dequantize_stack: no weights");
  for (const QuantizedWeight* q : qs) {
    check_weight(*q);
    EO_CHECK(q->shape == qs.front()->shape && q->packed.device() == qs.front()->packed.device() &&
                 q->scales.device() == q->packed.device(),
             "mxfp4::dequantize_stack: the weights differ in shape or device");
  }
}

// fp4_stack.h's format struct.
struct Mxfp4 {
  static constexpr const char* kName = "mxfp4";
  static constexpr int kGroup = mxfp4::kGroup;
  static constexpr at::ScalarType kDecoded = at::kBFloat16;  // every MXFP4 value is exact in bf16
  static void check_stack(const std::vector<const QuantizedWeight*>& qs) { mxfp4::check_stack(qs); }
  static void decode(const QuantizedWeight&, const std::uint8_t* codes, const std::uint8_t* scales, std::int64_t groups,
                     void* out) {
    decode_groups(codes, scales, groups, static_cast<std::uint16_t*>(out));
  }
#ifdef EO_WITH_CUDA
  using Window = cuda::Mxfp4Window;
  using Source = cuda::Mxfp4Source;
  static Source source(const QuantizedWeight& q) { return {q.packed.data_ptr<std::uint8_t>(), q.scales.data_ptr<std::uint8_t>()}; }
  static constexpr auto dequantize = cuda::dequantize;
#endif
};

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

QuantizedWeight weight(const at::Tensor& blocks, const at::Tensor& scales) {
  EO_CHECK(blocks.dim() == 3 && blocks.size(2) == 16 && scales.dim() == 2 && blocks.size(0) == scales.size(0) &&
               blocks.size(1) == scales.size(1) && blocks.scalar_type() == at::kByte && scales.scalar_type() == at::kByte,
           "mxfp4::weight: expected uint8 blocks [rows, G, 16] and scales [rows, G], got ", blocks.sizes(), " and ",
           scales.sizes());
  QuantizedWeight q;
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

at::Tensor dequantize_stack(const std::vector<const QuantizedWeight*>& qs, at::ScalarType dtype) {
  check_stack(qs);
  const auto& shape = qs.front()->shape;
  return mxfp4::dequantize_stack_window(qs, dtype, 0, shape[0], 0, shape[1]);
}

at::Tensor dequantize_stack_window(const std::vector<const QuantizedWeight*>& qs, at::ScalarType dtype, std::int64_t r0,
                                   std::int64_t rows, std::int64_t c0, std::int64_t cols) {
  return fp4::dequantize_stack_window<Mxfp4>(qs, dtype, r0, rows, c0, cols);
}

}  // namespace eo::mxfp4
