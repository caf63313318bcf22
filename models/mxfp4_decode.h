// One MXFP4 value as bf16 bits: the decode the CPU path (mxfp4.cpp) and the CUDA kernel
// (mxfp4_cuda.cu) share, so both give the same bits by construction. Plain C++, no libtorch.
//
// FP4 E2M1 code c (transformers' FP4_VALUES): bit 3 the sign, then 0, 0.5, 1, 1.5, 2, 3, 4, 6.
// Scale byte s (E8M0): 2^(s - 127). transformers' convert_moe_packed_tensors computes
// ldexp(value_bf16, s - 127) into bf16, which is the exact product rounded once to bf16: every
// product has at most two significant bits and an exponent of at least 2^-128, so it is exact in
// bf16 (subnormal below 2^-126) unless it reaches 2^128, which is ±inf. Hence integer bit
// assembly, independent of any flush-to-zero mode; checked for all 16 x 256 (code, scale) pairs
// against transformers (tests/test_model.cpp, Mxfp4.*).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define EO_MXFP4_HD __host__ __device__ __forceinline__
#else
#define EO_MXFP4_HD inline
#endif

namespace eo::mxfp4 {

EO_MXFP4_HD std::uint16_t bf16_bits(unsigned code, unsigned scale) {
  const unsigned sign = (code & 8u) << 12;  // code bit 3 -> bf16 bit 15
  const unsigned k = code & 7u;
  if (k == 0) return static_cast<std::uint16_t>(sign);  // ±0 at any scale
  // magnitude (1 + half / 2) * 2^p: k = 1 -> 0.5; 2, 3 -> 1, 1.5; 4, 5 -> 2, 3; 6, 7 -> 4, 6
  const int p = k == 1 ? -1 : static_cast<int>(k >> 1) - 1;
  const unsigned half = k == 1 ? 0u : (k & 1u);
  const int e = p + static_cast<int>(scale);  // the result's biased bf16 exponent
  if (e >= 255) return static_cast<std::uint16_t>(sign | 0x7F80u);  // 2^128 and beyond: ±inf
  if (e >= 1) return static_cast<std::uint16_t>(sign | (static_cast<unsigned>(e) << 7) | (half << 6));
  // e is 0 or -1: subnormal, (2 + half) * 2^(e - 128) = ((2 + half) << (e + 5)) * 2^-133
  return static_cast<std::uint16_t>(sign | ((2u + half) << (e + 5)));
}

}  // namespace eo::mxfp4
