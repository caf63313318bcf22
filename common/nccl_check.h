// The one NCCL error check: EO_NCCL_CHECK(ncclXxx(...), "what", ...) throws eo::Error with what
// failed, NCCL's own message and file:line. Only for code built with NCCL (EO_WITH_CUDA).
#pragma once

#include <nccl.h>

#include "common/error.h"

#define EO_NCCL_CHECK(expr, ...)                                                                        \
  do {                                                                                                  \
    const ncclResult_t eo_nccl_rc_ = (expr);                                                            \
    if (eo_nccl_rc_ != ncclSuccess)                                                                     \
      ::eo::detail::fail_at(__FILE__, __LINE__, __VA_ARGS__, " failed: ", ncclGetErrorString(eo_nccl_rc_)); \
  } while (0)
