// Errors and exit codes shared by every module.
//
// eo-ddp distinguishes two kinds of failure because users (and schedulers) act on them
// differently: a UsageError means "fix your command line or config" (exit 2), any other
// Error is a runtime failure (exit 1). Messages are complete sentences meant for users.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace eo {

enum ExitCode : int {
  kExitOk = 0,
  kExitRuntime = 1,
  kExitUsage = 2,
  kExitPreempted = 3,  // SIGTERM/SIGINT: a checkpoint was saved, resume with resume_from_checkpoint
};

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class UsageError : public Error {
 public:
  using Error::Error;
};

namespace detail {
template <typename... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

// `file` (a __FILE__) relative to the source tree: "models/nf4.cpp" rather than the build's
// absolute or ccache-relative path, so messages are the same on every machine.
const char* source_path(const char* file);

// The message, then where it was raised: "... (at models/nf4.cpp:214)". Every check of this code
// base (EO_CHECK, EO_FAIL, EO_CUDA_CHECK, EO_NCCL_CHECK, EO_MPI_CHECK) ends here, so a report from
// a user names the line that failed whatever the library.
template <typename... Args>
[[noreturn]] void fail_at(const char* file, int line, Args&&... args) {
  throw Error(concat(std::forward<Args>(args)..., " (at ", source_path(file), ":", line, ")"));
}
}  // namespace detail

}  // namespace eo

// EO_CHECK(cond, "message ", value, ...): throw eo::Error with the streamed message and file:line.
#define EO_CHECK(cond, ...)                                                   \
  do {                                                                        \
    if (!(cond)) ::eo::detail::fail_at(__FILE__, __LINE__, __VA_ARGS__);      \
  } while (0)

#define EO_FAIL(...) ::eo::detail::fail_at(__FILE__, __LINE__, __VA_ARGS__)
