// The one MPI error check: EO_MPI_CHECK(MPI_Xxx(...), "what") throws eo::Error with the call,
// what it was for, file:line and MPI's own message. (CUDA and NCCL checks: runtime/dist/comm.cpp.)
#pragma once

#include <mpi.h>

#include <string>

#include "common/error.h"

namespace eo::dist::detail {

inline void mpi_check(int rc, const char* call, const std::string& what, const char* file, int line) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  EO_FAIL(call, what.empty() ? "" : " (" + what + ")", " failed at ", file, ":", line, ": ", std::string(msg, len));
}

}  // namespace eo::dist::detail

#define EO_MPI_CHECK(call, what) ::eo::dist::detail::mpi_check((call), #call, (what), __FILE__, __LINE__)
