// Errors and exit codes shared by every module.
//
// eo-ddp distinguishes two kinds of failure because users (and schedulers) act on them
// differently: a UsageError means "fix your command line or config" (exit 2), any other
// Error is a runtime failure (exit 1). Messages are complete sentences meant for users.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

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
}  // namespace detail

}  // namespace eo

// EO_CHECK(cond, "message ", value, ...): throw eo::Error with the streamed message.
#define EO_CHECK(cond, ...)                                    \
  do {                                                         \
    if (!(cond)) throw ::eo::Error(::eo::detail::concat(__VA_ARGS__)); \
  } while (0)

#define EO_FAIL(...) throw ::eo::Error(::eo::detail::concat(__VA_ARGS__))
