// MXFP4 dequantise kernel (interface and bit-exactness contract: mxfp4_cuda.h).
//
// The kernel and launch loop are fp4_cuda.cuh's, shaped like the NF4 window kernel (nf4_cuda.cu);
// this file gives them MXFP4's decode: the shared bf16_bits of each code under its 32-value
// group's scale byte.
#include "models/mxfp4_cuda.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "models/fp4_cuda.cuh"
#include "models/mxfp4_decode.h"
#include "models/quant_format.h"

namespace eo::mxfp4::cuda {
namespace {

template <typename T>
struct Store;
template <>
struct Store<__nv_bfloat16> {
  static __device__ __nv_bfloat16 cvt(std::uint16_t bits) { return __ushort_as_bfloat16(bits); }
};
template <>
struct Store<float> {
  static __device__ float cvt(std::uint16_t bits) { return __uint_as_float(static_cast<unsigned>(bits) << 16); }
};
template <>
struct Store<__half> {
  static __device__ __half cvt(std::uint16_t bits) { return __float2half_rn(__uint_as_float(static_cast<unsigned>(bits) << 16)); }
};

struct Mxfp4 {  // fp4_cuda.cuh's format struct
  using Source = Mxfp4Source;
  using Window = Mxfp4Window;
  static constexpr int kGroup = quant_format_traits(QuantFormat::Mxfp4).group;
  static constexpr int kMaxSources = kMaxSourcesPerLaunch;
  struct Matrix {};  // no per-matrix state
  static bool usable(const Source&) { return true; }
  static __device__ Matrix matrix(const Source&) { return {}; }
  template <typename T>
  static __device__ T value(Matrix, unsigned code, unsigned scale) {
    return Store<T>::cvt(bf16_bits(code, scale));
  }
};

}  // namespace

cudaError_t dequantize(const Mxfp4Source* sources, int count, const Mxfp4Window& window, void* out, OutType type,
                       cudaStream_t stream) {
  return fp4::cuda::dequantize<Mxfp4>(sources, count, window, out, type, stream);
}

}  // namespace eo::mxfp4::cuda
