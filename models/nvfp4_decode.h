// One NVFP4 value in fp32: the decode the CPU path (nvfp4.cpp) and the CUDA kernel
// (nvfp4_cuda.cu) share, so both give the same bits by construction. Plain C++, no libtorch.
//
// modelopt's NVFP4 (what vLLM's and modelopt's dequantisers compute): value = e2m1(code) *
// e4m3(scale byte) * global, with e2m1 code c: bit 3 the sign, then 0, 0.5, 1, 1.5, 2, 3, 4, 6;
// the scale byte FP8 E4M3 (float8_e4m3fn: bias 7, subnormals, no infinities, 0x7F / 0xFF NaN);
// global the matrix's fp32 weight_scale_2. e2m1 * e4m3 has at most 5 significant bits and lies in
// [2^-10, 2688], so it is exact in fp32; the product with `global` is then rounded once (IEEE
// round to nearest even, subnormals kept): the fp32 value is the exact product correctly rounded,
// and bf16 / fp16 are that fp32 value rounded to nearest even. tests/ref/nvfp4_ref.py computes the
// same in float64 from the bit patterns; tests/test_model.cpp (Nvfp4.*) compares all of them.
#pragma once

#include <cstdint>
#include <limits>

#if defined(__CUDACC__)
#define EO_NVFP4_HD __host__ __device__ __forceinline__
#else
#define EO_NVFP4_HD inline
#endif

namespace eo::nvfp4 {

// e2m1(code) * e4m3(scale), exact, as fp32 (NaN for the NaN scale bytes).
EO_NVFP4_HD float code_times_scale(unsigned code, unsigned scale) {
  // e2m1 magnitude in halves: 0, 1, 2, 3, 4, 6, 8, 12
  const unsigned k = code & 7u;
  const unsigned halves = k < 4 ? k : (k == 4 ? 4u : k == 5 ? 6u : k == 6 ? 8u : 12u);
  const unsigned e = (scale >> 3) & 15u, m = scale & 7u;
  float s;  // |e4m3| in units of 2^-9: normal (8 + m) * 2^(e - 1), subnormal m
  if (e == 15u && m == 7u) {
#if defined(__CUDA_ARCH__)
    s = __int_as_float(0x7FC00000);
#else
    s = std::numeric_limits<float>::quiet_NaN();
#endif
  } else {
    s = static_cast<float>(e == 0 ? m : (8u + m) << (e - 1));  // < 2^18: exact
  }
  // halves * s * 2^-10: both exact small integers (product < 2^22), the power of two exact.
  const float v = static_cast<float>(halves) * s * 0.0009765625f;
  const bool negative = ((code >> 3) ^ (scale >> 7)) & 1u;
  return negative ? -v : v;
}

}  // namespace eo::nvfp4
