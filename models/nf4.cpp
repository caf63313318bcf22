// NF4 quantisation on the CPU, byte-identical to bitsandbytes 0.50.2 as it runs on the CPU.
//
// Reference semantics (read from bitsandbytes/backends/default/ops.py and the CPU library; the
// CPU backend registers no quantize_4bit of its own, so the pure-torch "default" kernel runs):
//   - input is converted to fp32 (bf16/fp16 exactly), flattened row-major, cut into blocks;
//   - full blocks: scaled = clamp(x * (1 / max(absmax, 1e-38f)), -1, 1) (multiply by the fp32
//     reciprocal), stored absmax unclamped;
//   - the partial last block: scaled = clamp(x / am, -1, 1) with am = max(absmax, 1e-38f)
//     (a true division), and the stored absmax is the clamped am;
//   - code = torch.bucketize(scaled, midpoints): the number of fp32 midpoints
//     (code[i] + code[i+1]) / 2 strictly below the value, so a value on a midpoint takes the
//     lower code (NaN, from 0 * inf in a block with subnormal absmax, gives 15);
//   - odd element counts pad one 0.0 value, i.e. the last low nibble is code 7;
//   - dequantise: code[nibble] * absmax[i / blocksize] in fp32, rounded to the dtype (RNE).
// Double quantisation: offset = mean(absmax) (torch's mean); absmax - offset goes through the
// CPU library's 8-bit blockwise quantiser (blocksize 256, signed dynamic map). That quantiser is
// NOT an exact nearest-value search: it maps v = (a - offset) * (1 / blockmax) to a 65536-entry
// table, idx = uint16((clamp(v, -1, 1) + 1) * 0.5 * 65535 + 0.5), table[i] = number of map
// midpoints below -1 + 2i / 65535; a block whose max is 0 gets code 0. We reproduce that table.
//
// Where bitsandbytes' CUDA kernels differ (they come later here): kQuantizeBlockwise for NF4
// multiplies by 1/absmax for every block (no division for the partial block, no 1e-38 clamp)
// and walks a decision tree with strict '>' pivots on the midpoints, which agrees with
// bucketize except on the partial-block rounding; the 8-bit absmax quantiser does a binary
// search for the nearest map value instead of the 65536-entry table, so nested absmax codes can
// differ by one step from the CPU ones. bnb's native CPU dequantize_4bit (AVX-512 path) indexes
// absmax per row and is wrong when a row is not a whole number of blocks (e.g. [4, 48] with
// blocksize 32); we follow the flat-index semantics of its CUDA and pure-torch kernels.
#include "models/nf4.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <vector>

#include "common/error.h"

#ifdef EO_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common/cuda_check.h"
#include "models/nf4_cuda.h"
#endif


namespace eo::nf4 {

const std::array<float, 16> kCode = {
    -1.0f,
    -0.6961928009986877f,
    -0.5250730514526367f,
    -0.39491748809814453f,
    -0.28444138169288635f,
    -0.18477343022823334f,
    -0.09105003625154495f,
    0.0f,
    0.07958029955625534f,
    0.16093020141124725f,
    0.24611230194568634f,
    0.33791524171829224f,
    0.44070982933044434f,
    0.5626170039176941f,
    0.7229568362236023f,
    1.0f,
};

namespace {

constexpr float kAbsmaxFloor = 1e-38f;  // bnb clamps absmax before dividing (a subnormal float)
constexpr int kNestedBlocksize = 256;   // bnb quantize_4bit(compress_statistics=True)
constexpr int kLutSize = 65536;         // bnb CPU 8-bit quantiser's lookup table

// torch.bucketize(value, midpoints, right=False): count of midpoints m with !(m >= value).
// For ordinary values that is "m < value" (ties take the lower code); NaN counts all of them.
inline std::uint8_t nf4_index(float value, const std::array<float, 15>& midpoints) {
  int index = 0;
  for (float m : midpoints) index += !(m >= value);
  return static_cast<std::uint8_t>(index);
}

// torch.clamp(x, -1, 1): NaN stays NaN.
inline float clamp_unit(float x) { return x < -1.0f ? -1.0f : (x > 1.0f ? 1.0f : x); }

std::array<float, 15> nf4_midpoints() {
  std::array<float, 15> m{};
  for (int i = 0; i < 15; ++i) m[i] = (kCode[i] + kCode[i + 1]) / 2.0f;  // fp32, as in bnb
  return m;
}

void check_blocksize(int blocksize) {
  const bool power_of_two = blocksize > 0 && (blocksize & (blocksize - 1)) == 0;
  if (!power_of_two || blocksize < 32 || blocksize > 4096)
    throw UsageError(detail::concat("NF4 blocksize must be a power of two in 32..4096 (as in bitsandbytes), got ",
                                    blocksize, "."));
}

// bnb's CPU 8-bit table for the signed dynamic map (built once; the map never changes).
const std::vector<std::uint8_t>& dynamic_lut() {
  static std::vector<std::uint8_t> lut;
  static std::once_flag once;
  std::call_once(once, [] {
    const at::Tensor map = dynamic_map_signed();
    const float* code = map.data_ptr<float>();
    float midpoints[255];
    for (int i = 0; i < 255; ++i) midpoints[i] = 0.5f * (code[i] + code[i + 1]);
    lut.resize(kLutSize);
    int index = 0;
    for (int i = 0; i < kLutSize; ++i) {
      const float value = -1.0f + (2.0f * static_cast<float>(i)) / static_cast<float>(kLutSize - 1);
      while (index < 255 && midpoints[index] < value) ++index;
      lut[i] = static_cast<std::uint8_t>(index);
    }
  });
  return lut;
}

inline std::uint16_t lut_index(float value) {
  const float shifted = (clamp_unit(value) + 1.0f) * 0.5f;
  const float scaled = shifted * static_cast<float>(kLutSize - 1);
  return static_cast<std::uint16_t>(scaled + 0.5f);
}

// bnb quantize_blockwise(x, blocksize) on the CPU with the signed dynamic map.
void quantize_8bit_blockwise(const at::Tensor& x, int blocksize, at::Tensor& codes, at::Tensor& absmax) {
  const std::int64_t n = x.numel();
  const std::int64_t nblocks = (n + blocksize - 1) / blocksize;
  codes = at::empty({n}, x.options().dtype(at::kByte));
  absmax = at::empty({nblocks}, x.options().dtype(at::kFloat));
  const float* in = x.data_ptr<float>();
  std::uint8_t* out = codes.data_ptr<std::uint8_t>();
  float* am = absmax.data_ptr<float>();
  const std::uint8_t* lut = dynamic_lut().data();
  for (std::int64_t b = 0; b < nblocks; ++b) {
    const std::int64_t begin = b * blocksize, end = std::min(n, begin + blocksize);
    float block_max = 0.0f;
    for (std::int64_t i = begin; i < end; ++i) block_max = std::max(block_max, std::fabs(in[i]));
    am[b] = block_max;
    if (block_max == 0.0f) {
      for (std::int64_t i = begin; i < end; ++i) out[i] = 0;
      continue;
    }
    const float inv = 1.0f / block_max;
    for (std::int64_t i = begin; i < end; ++i) out[i] = lut[lut_index(in[i] * inv)];
  }
}

}  // namespace

at::Tensor dynamic_map_signed() {
  // create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8), with the same tensor
  // ops so the fp32 roundings agree: for exponent i the means of fp32 linspace(0.1, 1, 2^i + 1)
  // neighbours, times 10^(i-6) in fp32, both signs; plus 0 and 1; sorted.
  std::vector<float> data;
  for (int i = 0; i < 7; ++i) {
    const at::Tensor bounds = at::linspace(0.1, 1.0, (1 << i) + 1, at::kFloat);
    const at::Tensor means = (bounds.slice(0, 0, -1) + bounds.slice(0, 1)) / 2.0;
    const at::Tensor scaled = (means * std::pow(10.0, -6 + i)).contiguous();
    for (std::int64_t k = 0; k < scaled.numel(); ++k) {
      data.push_back(scaled.data_ptr<float>()[k]);
      data.push_back(-scaled.data_ptr<float>()[k]);
    }
  }
  data.push_back(0.0f);
  data.push_back(1.0f);
  EO_CHECK(data.size() == 256, "internal: dynamic map has ", data.size(), " entries, expected 256");
  std::sort(data.begin(), data.end());
  return at::tensor(data, at::kFloat);
}

#ifdef EO_WITH_CUDA
namespace {

cuda::OutType out_type(at::ScalarType dtype) {
  return dtype == at::kFloat ? cuda::OutType::F32 : dtype == at::kBFloat16 ? cuda::OutType::BF16 : cuda::OutType::F16;
}

cuda::Nf4Source source_of(const QuantizedWeight& q) {
  cuda::Nf4Source s;
  s.packed = q.packed.data_ptr<std::uint8_t>();
  if (q.nested) {
    s.absmax = q.nested->absmax_codes.data_ptr<std::uint8_t>();
    s.nested_absmax = q.nested->nested_absmax.data_ptr<float>();
    s.offset = q.nested->offset;
  } else {
    s.absmax = q.absmax.data_ptr<float>();
  }
  return s;
}

// Kernel path of dequantize_stack(_window): every tensor already contiguous on one CUDA device;
// `window` null for the whole matrices.
at::Tensor dequantize_cuda(const std::vector<const QuantizedWeight*>& qs, at::ScalarType dtype, const cuda::Nf4Window* window) {
  const QuantizedWeight& first = *qs.front();
  const at::Device dev = first.packed.device();
  c10::cuda::CUDAGuard guard(dev);
  cuda::Nf4Layout layout;
  layout.n = first.numel();
  layout.blocksize = first.blocksize;
  layout.nested = first.nested.has_value();
  at::Tensor code;
  if (layout.nested) {
    code = first.nested->nested_code.to(dev, at::kFloat).contiguous();
    layout.nested_code = code.data_ptr<float>();
    layout.nested_blocksize = first.nested->nested_blocksize;
  }
  std::vector<cuda::Nf4Source> sources;
  sources.reserve(qs.size());
  for (const QuantizedWeight* q : qs) {
    EO_CHECK(q->packed.is_contiguous() && q->packed.device() == dev && (!q->absmax.defined() || q->absmax.is_contiguous()),
             "nf4::dequantize: CUDA tensors must be contiguous and on one device");
    sources.push_back(source_of(*q));
  }
  const auto count = static_cast<std::int64_t>(qs.size());
  const auto stream = c10::cuda::getCurrentCUDAStream(dev.index()).stream();
  const auto opts = at::TensorOptions().dtype(dtype).device(dev);
  if (window) {
    at::Tensor out = at::empty({count, window->rows, window->cols}, opts);
    EO_CUDA_CHECK(cuda::dequantize_window(sources.data(), static_cast<int>(count), layout, *window, out.data_ptr(), out_type(dtype),
                                          stream),
                  "nf4: CUDA dequantize window kernel launch");
    return out;
  }
  at::Tensor out = at::empty({count, first.shape[0], first.shape[1]}, opts);
  EO_CUDA_CHECK(cuda::dequantize(sources.data(), static_cast<int>(count), layout, out.data_ptr(), out_type(dtype), stream),
                "nf4: CUDA dequantize kernel launch");
  return out;
}

}  // namespace
#endif

QuantizedWeight quantize(const at::Tensor& weight, int blocksize, bool double_quant) {
  check_blocksize(blocksize);
  EO_CHECK(weight.defined(), "nf4::quantize: the weight tensor is undefined.");
  EO_CHECK(weight.dim() == 2, "nf4::quantize: expected a 2-D weight [out, in], got ", weight.dim(), " dimensions.");
  const at::ScalarType dtype = weight.scalar_type();
  EO_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
           "nf4::quantize: weights must be float32, bfloat16 or float16 (as in bitsandbytes), got ", dtype, ".");
  EO_CHECK(weight.numel() > 0, "nf4::quantize: the weight is empty (shape ", weight.sizes(), ").");

#ifdef EO_WITH_CUDA
  if (weight.is_cuda()) {
    // The NF4 codes and absmax on the GPU; double quantisation of the (small) absmax vector on
    // the CPU, so its mean and 8-bit table are exactly the CPU path's.
    c10::cuda::CUDAGuard guard(weight.device());
    const at::Tensor x = weight.to(at::kFloat).contiguous().reshape({-1});
    EO_CHECK(at::isfinite(x).all().item<bool>(), "nf4::quantize: the weight of shape ", weight.sizes(),
             " contains NaN or infinity; refusing to quantise it.");
    const std::int64_t n = x.numel();
    QuantizedWeight q;
    q.shape = {weight.size(0), weight.size(1)};
    q.blocksize = blocksize;
    q.dtype = dtype;
    q.packed = at::empty({(n + 1) / 2, 1}, x.options().dtype(at::kByte));
    q.absmax = at::empty({(n + blocksize - 1) / blocksize}, x.options());
    EO_CUDA_CHECK(cuda::quantize(x.data_ptr<float>(), n, blocksize, q.packed.data_ptr<std::uint8_t>(), q.absmax.data_ptr<float>(),
                                 c10::cuda::getCurrentCUDAStream(weight.device().index()).stream()),
                  "nf4: CUDA quantize kernel launch");
    if (double_quant) {
      const at::Tensor absmax = q.absmax.to(at::kCPU);
      DoubleQuant dq;
      const at::Tensor offset = absmax.mean();
      dq.offset = offset.item<float>();
      EO_CHECK(std::isfinite(dq.offset), "nf4::quantize: the mean absmax of the weight of shape ", weight.sizes(),
               " overflows float32; double quantisation is impossible, quantise without it.");
      quantize_8bit_blockwise((absmax - offset).contiguous(), kNestedBlocksize, dq.absmax_codes, dq.nested_absmax);
      dq.absmax_codes = dq.absmax_codes.to(weight.device());
      dq.nested_absmax = dq.nested_absmax.to(weight.device());
      dq.nested_code = dynamic_map_signed().to(weight.device());
      dq.nested_blocksize = kNestedBlocksize;
      q.nested = std::move(dq);
      q.absmax = at::Tensor();
    }
    return q;
  }
#endif
  // Computed on the CPU in fp32 (bf16/fp16 widen exactly).
  const at::Tensor x = weight.to(at::kCPU).to(at::kFloat).contiguous().reshape({-1});
  EO_CHECK(at::isfinite(x).all().item<bool>(), "nf4::quantize: the weight of shape ", weight.sizes(),
           " contains NaN or infinity; refusing to quantise it.");
  const std::int64_t n = x.numel();
  const std::int64_t nblocks = (n + blocksize - 1) / blocksize;
  const std::int64_t full_blocks = n / blocksize;

  QuantizedWeight q;
  q.shape = {weight.size(0), weight.size(1)};
  q.blocksize = blocksize;
  q.dtype = dtype;
  q.packed = at::empty({(n + 1) / 2, 1}, at::kByte);
  at::Tensor absmax = at::empty({nblocks}, at::kFloat);

  const float* in = x.data_ptr<float>();
  std::uint8_t* packed = q.packed.data_ptr<std::uint8_t>();
  float* am = absmax.data_ptr<float>();
  const std::array<float, 15> midpoints = nf4_midpoints();

  // Blocks are independent; blocksize is even, so a block's bytes are its own.
  at::parallel_for(0, nblocks, 1, [&](std::int64_t first, std::int64_t last) {
    std::vector<std::uint8_t> codes(blocksize + 1);
    for (std::int64_t b = first; b < last; ++b) {
      const std::int64_t begin = b * blocksize, end = std::min(n, begin + blocksize);
      const std::int64_t len = end - begin;
      float block_max = 0.0f;
      for (std::int64_t i = begin; i < end; ++i) block_max = std::max(block_max, std::fabs(in[i]));
      const float floored = std::max(block_max, kAbsmaxFloor);
      if (b < full_blocks) {
        am[b] = block_max;
        const float inv = 1.0f / floored;
        for (std::int64_t i = 0; i < len; ++i) codes[i] = nf4_index(clamp_unit(in[begin + i] * inv), midpoints);
      } else {  // the partial last block divides, and stores the floored absmax
        am[b] = floored;
        for (std::int64_t i = 0; i < len; ++i) codes[i] = nf4_index(clamp_unit(in[begin + i] / floored), midpoints);
      }
      codes[len] = nf4_index(0.0f, midpoints);  // padding for an odd total count
      for (std::int64_t i = 0; i < len; i += 2) packed[(begin + i) / 2] = (codes[i] << 4) | codes[i + 1];
    }
  });

  if (!double_quant) {
    q.absmax = absmax;
    return q;
  }
  DoubleQuant dq;
  const at::Tensor offset = absmax.mean();  // the same reduction bnb runs (see header note)
  dq.offset = offset.item<float>();
  EO_CHECK(std::isfinite(dq.offset), "nf4::quantize: the mean absmax of the weight of shape ", weight.sizes(),
           " overflows float32; double quantisation is impossible, quantise without it.");
  const at::Tensor centered = (absmax - offset).contiguous();
  quantize_8bit_blockwise(centered, kNestedBlocksize, dq.absmax_codes, dq.nested_absmax);
  dq.nested_code = dynamic_map_signed();
  dq.nested_blocksize = kNestedBlocksize;
  q.nested = std::move(dq);
  return q;
}

at::Tensor dequantize(const QuantizedWeight& q, at::ScalarType dtype) {
  EO_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
           "nf4::dequantize: the output dtype must be float32, bfloat16 or float16, got ", dtype, ".");
  EO_CHECK(q.packed.defined() && q.shape.size() == 2, "nf4::dequantize: the quantised weight is empty.");
  EO_CHECK(q.format == QuantFormat::Nf4, "nf4::dequantize: an ", quant_format_name(q.format), " weight");
  // Tensor ops only, so this runs on whatever device the packed bytes live on.
  const std::int64_t n = q.numel(), nb = q.nblocks();
  EO_CHECK(q.packed.numel() == (n + 1) / 2, "nf4::dequantize: packed has ", q.packed.numel(),
           " bytes, expected ", (n + 1) / 2, " for shape [", q.shape[0], ", ", q.shape[1], "].");
  EO_CHECK((q.nested ? q.nested->absmax_codes.numel() : q.absmax.numel()) == nb, "nf4::dequantize: absmax has ",
           (q.nested ? q.nested->absmax_codes.numel() : q.absmax.numel()), " entries, expected ", nb, ".");
#ifdef EO_WITH_CUDA
  if (q.packed.is_cuda() && q.packed.is_contiguous() && (!q.absmax.defined() || q.absmax.is_cuda()))
    return dequantize_cuda({&q}, dtype, nullptr)[0];
#endif
  const at::Tensor absmax = q.absmax_fp32().to(q.packed.device(), at::kFloat).reshape({-1});

  const at::Tensor bytes = q.packed.reshape({-1});
  const at::Tensor nibbles = at::stack({at::bitwise_right_shift(bytes, 4), at::bitwise_and(bytes, 15)}, 1)
                                 .reshape({-1})
                                 .to(at::kLong);
  const at::Tensor code = at::from_blob(const_cast<float*>(kCode.data()), {16}, at::kFloat).to(q.packed.device());
  at::Tensor values = code.index_select(0, nibbles);                     // 2 * ceil(n / 2) values
  values = at::constant_pad_nd(values, {0, nb * q.blocksize - values.numel()}, 0);
  values = (values.view({nb, q.blocksize}) * absmax.view({nb, 1})).reshape({-1});  // fp32
  return values.slice(0, 0, n).view({q.shape[0], q.shape[1]}).to(dtype);
}

at::Tensor dequantize_stack(const std::vector<const QuantizedWeight*>& qs, at::ScalarType dtype) {
  EO_CHECK(!qs.empty(), "nf4::dequantize_stack: no weights");
  const QuantizedWeight& first = *qs.front();
  for (const QuantizedWeight* q : qs)
    EO_CHECK(q->format == QuantFormat::Nf4 && q->shape == first.shape && q->blocksize == first.blocksize && q->nested.has_value() == first.nested.has_value() &&
                 q->packed.device() == first.packed.device(),
             "nf4::dequantize_stack: the weights differ in shape, blocksize, statistics or device");
#ifdef EO_WITH_CUDA
  if (first.packed.is_cuda()) return dequantize_cuda(qs, dtype, nullptr);
#endif
  std::vector<at::Tensor> parts;
  for (const QuantizedWeight* q : qs) parts.push_back(nf4::dequantize(*q, dtype));
  return at::stack(parts);
}

at::Tensor dequantize_stack_window(const std::vector<const QuantizedWeight*>& qs, at::ScalarType dtype, std::int64_t r0,
                                   std::int64_t rows, std::int64_t c0, std::int64_t cols) {
  EO_CHECK(!qs.empty(), "nf4::dequantize_stack_window: no weights");
  const QuantizedWeight& first = *qs.front();
  const std::int64_t out = first.shape[0], in = first.shape[1];
  EO_CHECK(r0 >= 0 && rows > 0 && r0 + rows <= out && c0 >= 0 && cols > 0 && c0 + cols <= in,
           "nf4::dequantize_stack_window: window rows [", r0, ", ", r0 + rows, ") x cols [", c0, ", ", c0 + cols,
           ") outside [", out, ", ", in, "]");
#ifdef EO_WITH_CUDA
  if (first.packed.is_cuda()) {
    for (const QuantizedWeight* q : qs)
      EO_CHECK(q->format == QuantFormat::Nf4 && q->shape == first.shape && q->blocksize == first.blocksize &&
                   q->nested.has_value() == first.nested.has_value() && q->packed.device() == first.packed.device(),
               "nf4::dequantize_stack_window: the weights differ in shape, blocksize, statistics or device");
    const cuda::Nf4Window w{in, r0, rows, c0, cols};
    return dequantize_cuda(qs, dtype, &w);
  }
#endif
  return nf4::dequantize_stack(qs, dtype).narrow(1, r0, rows).narrow(2, c0, cols).contiguous();
}

}  // namespace eo::nf4

namespace eo {

// NF4 statistics: bnb's nested map lives here.
at::Tensor QuantizedWeight::absmax_fp32() const {
  EO_CHECK(format == QuantFormat::Nf4, "nf4: an ", quant_format_name(format), " weight has scale bytes, not absmax");
  if (!nested) return absmax;
  // bnb dequantize_blockwise: code[q] * nested_absmax[i / 256] in fp32, then += offset. Two
  // tensor ops, so no fused multiply-add can change the rounding.
  const DoubleQuant& dq = *nested;
  const std::int64_t n = dq.absmax_codes.numel();
  const std::int64_t nb = dq.nested_absmax.numel();
  at::Tensor values = dq.nested_code.index_select(0, dq.absmax_codes.reshape({-1}).to(at::kLong));
  values = at::constant_pad_nd(values, {0, nb * dq.nested_blocksize - n}, 0);
  values = (values.view({nb, dq.nested_blocksize}) * dq.nested_absmax.view({nb, 1})).reshape({-1});
  return values.slice(0, 0, n) + dq.offset;
}

}  // namespace eo
