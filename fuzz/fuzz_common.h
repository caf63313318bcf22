// Shared by the libFuzzer harnesses: a private scratch folder (the parsers that take a path get
// the input as a file there) and an "expected error" filter.
//
// Expected: eo::Error and eo::UsageError, the errors every parser documents. Any other exception
// escaping a parser (std::out_of_range, nlohmann::json::exception, c10::Error...) is a finding:
// the user would get an unexplained message instead of one naming the file and the fix.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

namespace eo::fuzz {

// Made once per process under $TMPDIR (default /dev/shm, else /tmp: no disk writes per input),
// removed at exit.
inline const std::string& scratch_dir() {
  static const std::string dir = [] {
    std::string base = "/tmp";
    if (const char* t = std::getenv("TMPDIR"); t && *t) base = t;
    else if (::access("/dev/shm", W_OK) == 0) base = "/dev/shm";
    std::string tmpl = base + "/eo-fuzz-XXXXXX";
    if (!::mkdtemp(tmpl.data())) {
      std::perror("eo-fuzz: mkdtemp");
      std::abort();
    }
    static std::string keep;  // atexit needs a plain function: remember the folder here
    keep = tmpl;
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(keep, ec);
    });
    return tmpl;
  }();
  return dir;
}

inline void write_file(const std::string& path, const std::uint8_t* data, std::size_t size) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    std::perror(path.c_str());
    std::abort();
  }
  while (size > 0) {
    const ssize_t w = ::write(fd, data, size);
    if (w <= 0) {
      std::perror(path.c_str());
      std::abort();
    }
    data += w;
    size -= static_cast<std::size_t>(w);
  }
  ::close(fd);
}

inline void write_file(const std::string& path, const std::string& text) {
  write_file(path, reinterpret_cast<const std::uint8_t*>(text.data()), text.size());
}

// A broken invariant of a successful parse: report it loudly (libFuzzer saves the input).
#define EO_FUZZ_ASSERT(cond)                                                       \
  do {                                                                             \
    if (!(cond)) {                                                                 \
      std::fprintf(stderr, "eo-fuzz: invariant failed: %s (%s:%d)\n", #cond, __FILE__, __LINE__); \
      std::abort();                                                                \
    }                                                                              \
  } while (0)

}  // namespace eo::fuzz
