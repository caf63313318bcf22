// The one CUDA runtime error check: EO_CUDA_CHECK(cudaXxx(...), "what", ...) throws eo::Error with
// what failed, CUDA's own message and file:line. Only for code that already includes the CUDA
// runtime (an EO_WITH_CUDA build): CPU builds never include this header.
#pragma once

#include <cuda_runtime.h>

#include "common/error.h"

#define EO_CUDA_CHECK(expr, ...)                                                                        \
  do {                                                                                                  \
    const cudaError_t eo_cuda_rc_ = (expr);                                                             \
    if (eo_cuda_rc_ != cudaSuccess)                                                                     \
      ::eo::detail::fail_at(__FILE__, __LINE__, __VA_ARGS__, " failed: ", cudaGetErrorString(eo_cuda_rc_)); \
  } while (0)
