// The one MPI error check: EO_MPI_CHECK(MPI_Xxx(...), "what", ...) throws eo::Error with the call,
// what it was for, MPI's own message and file:line. Only for code that links MPI (runtime/ddp).
#pragma once

#include <mpi.h>

#include <string>

#include "common/error.h"

namespace eo::detail {

inline std::string mpi_error_string(int rc) {
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, msg, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(rc);
  return std::string(msg, static_cast<std::size_t>(len));
}

}  // namespace eo::detail

// `what` may be empty: the call's own text names it.
#define EO_MPI_CHECK(call, ...)                                                                          \
  do {                                                                                                   \
    const int eo_mpi_rc_ = (call);                                                                       \
    if (eo_mpi_rc_ != MPI_SUCCESS) {                                                                     \
      const std::string eo_mpi_what_ = ::eo::detail::concat(__VA_ARGS__);                                \
      ::eo::detail::fail_at(__FILE__, __LINE__, #call, eo_mpi_what_.empty() ? "" : " (" + eo_mpi_what_ + ")", \
                            " failed: ", ::eo::detail::mpi_error_string(eo_mpi_rc_));                    \
    }                                                                                                    \
  } while (0)
