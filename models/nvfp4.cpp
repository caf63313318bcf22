#include "models/nvfp4.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <array>

#include "common/error.h"
#include "models/fp4_stack.h"
#include "models/nvfp4_decode.h"

#ifdef EO_WITH_CUDA
#include "models/nvfp4_cuda.h"
#endif

namespace eo::nvfp4 {
namespace {

// e2m1 * e4m3 of every (scale byte, code) pair, exact in fp32: the CPU path's decode is this
// table of code_times_scale, times the global scale.
const std::array<float, 256 * 16>& table() {
  static const std::array<float, 256 * 16> t = [] {
    std::array<float, 256 * 16> v{};
    for (unsigned s = 0; s < 256; ++s)
      for (unsigned c = 0; c < 16; ++c) v[s * 16 + c] = code_times_scale(c, s);
    return v;
  }();
  return t;
}

// `groups` groups of 8 code bytes and one scale byte each → fp32, 16 values per group in order.
void decode_groups(const std::uint8_t* codes, const std::uint8_t* scales, float global, std::int64_t groups, float* out) {
  const auto& t = table();
  at::parallel_for(0, groups, 2048, [&](std::int64_t first, std::int64_t last) {
    for (std::int64_t g = first; g < last; ++g) {
      const float* row = t.data() + 16 * static_cast<unsigned>(scales[g]);
      const std::uint8_t* b = codes + 8 * g;
      float* o = out + 16 * g;
      for (int j = 0; j < 8; ++j) {
        o[2 * j] = row[b[j] & 15] * global;  // low nibble first; one rounding
        o[2 * j + 1] = row[b[j] >> 4] * global;
      }
    }
  });
}

void check_weight(const QuantizedWeight& q) {
  EO_CHECK(q.format == QuantFormat::Nvfp4 && q.shape.size() == 2 && q.shape[1] % kGroup == 0 && q.packed.defined() &&
               q.scales.defined() && q.global_scale.defined(),
           "nvfp4: not an NVFP4 weight (format ", quant_format_name(q.format), ")");
  EO_CHECK(q.packed.numel() == q.numel() / 2 && q.scales.numel() == q.numel() / kGroup && q.packed.scalar_type() == at::kByte &&
               q.scales.scalar_type() == at::kByte && q.global_scale.numel() == 1 && q.global_scale.scalar_type() == at::kFloat,
           "nvfp4: weight [", q.shape[0], ", ", q.shape[1], "] has ", q.packed.numel(), " code bytes, ", q.scales.numel(),
           " scales and ", q.global_scale.numel(), " global scales, expected ", q.numel() / 2, ", ", q.numel() / kGroup, " and 1");
}

void check_stack(const std::vector<const QuantizedWeight*>& qs) {
  EO_CHECK(!qs.empty(), "nvfp4::dequantize_stack: no weights");
  for (const QuantizedWeight* q : qs) {
    check_weight(*q);
    EO_CHECK(q->shape == qs.front()->shape && q->packed.device() == qs.front()->packed.device() &&
                 q->scales.device() == q->packed.device() && q->global_scale.device() == q->packed.device(),
             "nvfp4::dequantize_stack: the weights differ in shape or device");
  }
}

// Scales as their bytes: float8_e4m3fn viewed as uint8 (same bits), uint8 as is.
at::Tensor scale_bytes(const at::Tensor& scales) {
  if (scales.scalar_type() == at::kByte) return scales;
  EO_CHECK(scales.scalar_type() == at::kFloat8_e4m3fn, "nvfp4: weight_scale must be float8_e4m3fn (or its uint8 bytes), got ",
           scales.scalar_type());
  return scales.contiguous().view(at::kByte);
}

// fp4_stack.h's format struct.
struct Nvfp4 {
  static constexpr const char* kName = "nvfp4";
  static constexpr int kGroup = nvfp4::kGroup;
  // fp32: e2m1 * e4m3 * global rounded once (nvfp4_decode.h); other dtypes round that value.
  static constexpr at::ScalarType kDecoded = at::kFloat;
  static void check_stack(const std::vector<const QuantizedWeight*>& qs) { nvfp4::check_stack(qs); }
  static void decode(const QuantizedWeight& q, const std::uint8_t* codes, const std::uint8_t* scales, std::int64_t groups,
                     void* out) {
    decode_groups(codes, scales, q.global_scale.item<float>(), groups, static_cast<float*>(out));
  }
#ifdef EO_WITH_CUDA
  using Window = cuda::Nvfp4Window;
  using Source = cuda::Nvfp4Source;
  static Source source(const QuantizedWeight& q) {
    return {q.packed.data_ptr<std::uint8_t>(), q.scales.data_ptr<std::uint8_t>(), q.global_scale.data_ptr<float>()};
  }
  static constexpr auto dequantize = cuda::dequantize;
#endif
};

}  // namespace

QuantizedWeight weight(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& global) {
  EO_CHECK(codes.dim() == 2 && scales.dim() == 2 && codes.size(0) == scales.size(0) && codes.size(1) * 2 == scales.size(1) * kGroup &&
               codes.scalar_type() == at::kByte && global.numel() == 1 && global.scalar_type() == at::kFloat,
           "nvfp4::weight: expected uint8 codes [out, in / 2], scales [out, in / 16] and one fp32 global scale, got ",
           codes.sizes(), " ", codes.scalar_type(), ", ", scales.sizes(), " and ", global.sizes(), " ", global.scalar_type());
  QuantizedWeight q;
  q.format = QuantFormat::Nvfp4;
  q.shape = {codes.size(0), codes.size(1) * 2};
  q.blocksize = kGroup;
  q.dtype = at::kFloat;
  const at::Tensor s = scale_bytes(scales);
  q.packed = codes.contiguous().view({q.numel() / 2, 1});
  q.scales = s.contiguous().view({q.numel() / kGroup});
  q.global_scale = global.reshape({1}).contiguous();
  // Own the bytes (the inputs may be views of an mmapped file).
  if (q.packed.data_ptr() == codes.data_ptr()) q.packed = q.packed.clone();
  if (q.scales.data_ptr() == scales.data_ptr()) q.scales = q.scales.clone();
  if (q.global_scale.data_ptr() == global.data_ptr()) q.global_scale = q.global_scale.clone();
  return q;
}

at::Tensor dequantize(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& global, at::ScalarType dtype) {
  const QuantizedWeight q = weight(codes, scales, global.to(codes.device()));
  return dequantize_stack({&q}, dtype)[0];
}

at::Tensor dequantize_stack(const std::vector<const QuantizedWeight*>& qs, at::ScalarType dtype) {
  check_stack(qs);
  const auto& shape = qs.front()->shape;
  return nvfp4::dequantize_stack_window(qs, dtype, 0, shape[0], 0, shape[1]);
}

at::Tensor dequantize_stack_window(const std::vector<const QuantizedWeight*>& qs, at::ScalarType dtype, std::int64_t r0,
                                   std::int64_t rows, std::int64_t c0, std::int64_t cols) {
  return fp4::dequantize_stack_window<Nvfp4>(qs, dtype, r0, rows, c0, cols);
}

at::Tensor fake_quantize(const at::Tensor& x, const at::Tensor& global) {
  EO_CHECK(x.dim() >= 2 && x.size(-1) % kGroup == 0 && at::isFloatingType(x.scalar_type()),
           "nvfp4::fake_quantize: expected a float tensor [lead, ..., K] with K a multiple of 16, got ", x.sizes(), " ",
           x.scalar_type());
  EO_CHECK(global.numel() == 1 || global.numel() == x.size(0), "nvfp4::fake_quantize: ", global.numel(),
           " global scales for ", x.size(0), " leading slices (expected 1 or one per slice)");
  const std::int64_t lead = global.numel();
  // The op order is torchao's (nvfp4_quantize's two-level branch, then dequantize): each step is
  // one fp32 rounding there, so the same steps give the same bits.
  const at::Tensor g = global.to(x.device(), at::kFloat).reshape({lead, 1});
  const at::Tensor blocks = x.to(at::kFloat).reshape({lead, -1, kGroup});
  const at::Tensor block_scale = blocks.abs().amax(-1) / 6.0;
  const at::Tensor s = (block_scale / g).clamp(0.015625, 448.0).to(at::kFloat8_e4m3fn).to(at::kFloat);
  const at::Tensor v = (blocks * (at::reciprocal(g) / s).unsqueeze(-1)).clamp(-6.0, 6.0);
  // E2M1's magnitudes are steps of 0.5 below 2, 1 below 4, 2 up to 6; rounding half to even on
  // each step's integer grid is ties to the even code (the code's parity is the grid index's).
  const at::Tensor m = v.abs();
  const at::Tensor q = at::where(m < 2.0, at::round(m * 2.0) * 0.5, at::where(m < 4.0, at::round(m), at::round(m * 0.5) * 2.0));
  return (at::copysign(q, v) * (g * s).unsqueeze(-1)).reshape(x.sizes()).to(x.scalar_type());
}

}  // namespace eo::nvfp4
