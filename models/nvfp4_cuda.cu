// NVFP4 dequantise kernel (interface and bit-exactness contract: nvfp4_cuda.h).
//
// The kernel and launch loop are fp4_cuda.cuh's, shared with MXFP4 (mxfp4_cuda.cu); this file
// gives them NVFP4's decode: the shared code_times_scale of each code under its 16-value group's
// scale byte, times the matrix's global scale (__fmul_rn: one IEEE rounding, no contraction).
#include "models/nvfp4_cuda.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "models/fp4_cuda.cuh"
#include "models/nvfp4_decode.h"
#include "models/quant_format.h"

namespace eo::nvfp4::cuda {
namespace {

template <typename T>
struct Store;
template <>
struct Store<__nv_bfloat16> {
  static __device__ __nv_bfloat16 cvt(float v) { return __float2bfloat16_rn(v); }
};
template <>
struct Store<float> {
  static __device__ float cvt(float v) { return v; }
};
template <>
struct Store<__half> {
  static __device__ __half cvt(float v) { return __float2half_rn(v); }
};

struct Nvfp4 {  // fp4_cuda.cuh's format struct
  using Source = Nvfp4Source;
  using Window = Nvfp4Window;
  static constexpr int kGroup = quant_format_traits(QuantFormat::Nvfp4).group;
  static constexpr int kMaxSources = kMaxSourcesPerLaunch;
  struct Matrix {
    float global;
  };
  static bool usable(const Source& s) { return s.global != nullptr; }
  static __device__ Matrix matrix(const Source& s) { return {__ldg(s.global)}; }
  template <typename T>
  static __device__ T value(Matrix m, unsigned code, unsigned scale) {
    return Store<T>::cvt(__fmul_rn(code_times_scale(code, scale), m.global));
  }
};

}  // namespace

cudaError_t dequantize(const Nvfp4Source* sources, int count, const Nvfp4Window& window, void* out, OutType type,
                       cudaStream_t stream) {
  return fp4::cuda::dequantize<Nvfp4>(sources, count, window, out, type, stream);
}

}  // namespace eo::nvfp4::cuda
