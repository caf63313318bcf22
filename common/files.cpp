#include "common/files.h"

#include <fcntl.h>
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <random>

#include "common/error.h"

namespace eo {
namespace {
int remove_entry(const char* path, const struct stat*, int, struct FTW*) { return ::remove(path); }

std::string parent_of(const std::string& path) {
  const auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

std::string base_of(const std::string& path) {
  const auto slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}
}  // namespace

void remove_tree(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return;  // already gone
  if (::nftw(path.c_str(), remove_entry, 16, FTW_DEPTH | FTW_PHYS) != 0)
    EO_FAIL("cannot remove ", path, ": ", std::strerror(errno));
}

void fsync_path(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  EO_CHECK(fd >= 0, "cannot open ", path, " to sync it: ", std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  EO_CHECK(rc == 0, "fsync of ", path, " failed: ", std::strerror(err));
}

void write_all(int fd, const void* data, std::size_t bytes, const std::string& what) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t w = ::write(fd, p, bytes);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) EO_FAIL("writing ", what, " failed: ", std::strerror(w < 0 ? errno : EIO));
    p += w;
    bytes -= static_cast<std::size_t>(w);
  }
}

void write_file_atomic(const std::string& path, const std::function<void(int fd, const std::string& tmp)>& fill,
                       mode_t mode) {
  // A random suffix (not only the pid): two writers of one path never share a temporary.
  static thread_local std::mt19937_64 rng{std::random_device{}() ^ static_cast<std::uint64_t>(::getpid())};
  const std::string tmp = parent_of(path) + "/." + base_of(path) + ".tmp." + std::to_string(::getpid()) + "." +
                          std::to_string(rng() % 1000000000);
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode);
  EO_CHECK(fd >= 0, "cannot create ", tmp, ": ", std::strerror(errno));
  try {
    fill(fd, tmp);
    if (::fsync(fd) != 0) EO_FAIL("fsync of ", tmp, " failed: ", std::strerror(errno));
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    EO_FAIL("closing ", tmp, " failed: ", std::strerror(err));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    EO_FAIL("cannot rename ", tmp, " to ", path, ": ", std::strerror(err));
  }
  fsync_path(parent_of(path));
}

void write_file_atomic(const std::string& path, const std::string& contents) {
  write_file_atomic(path, [&](int fd, const std::string& tmp) { write_all(fd, contents.data(), contents.size(), tmp); });
}

int open_nofollow(const std::string& path, int flags, mode_t mode) {
  const int fd = ::open(path.c_str(), flags | O_NOFOLLOW | O_CLOEXEC, mode);
  if (fd >= 0) return fd;
  const int err = errno;
  struct stat st {};
  if (err == ELOOP || (::lstat(path.c_str(), &st) == 0 && S_ISLNK(st.st_mode)))
    EO_FAIL(path, " is a symbolic link; eo-ddp does not write or read files under output_dir through links "
                  "(remove the link or choose another output_dir)");
  EO_FAIL("cannot open ", path, ": ", std::strerror(err));
}

// Reads fd to its end into out and closes it; past max_bytes (0: no bound) a UsageError names the file.
static void read_to_end(int fd, const std::string& path, std::string& out, const std::string& what, std::uint64_t max_bytes) {
  out.clear();
  char buf[65536];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      EO_FAIL("reading ", path, " failed: ", std::strerror(err));
    }
    if (n == 0) break;
    out.append(buf, static_cast<std::size_t>(n));
    // The file grew while read (a log being written): still bounded.
    if (max_bytes > 0 && out.size() > max_bytes) {
      ::close(fd);
      throw UsageError(what + " " + path + " grew past " + std::to_string(max_bytes >> 20) + " MiB while read");
    }
  }
  ::close(fd);
}

bool read_file_nofollow(const std::string& path, std::string& out) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return false;
  const int fd = open_nofollow(path, O_RDONLY | O_NONBLOCK);  // a FIFO planted here must not block
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    EO_FAIL(path, " is not a regular file");
  }
  read_to_end(fd, path, out, "", 0);
  return true;
}

bool read_model_file(const std::string& path, std::string& out) {
  return read_input_file(path, out, "model file", kMaxTextFileBytes);
}

int open_input_file(const std::string& path, const std::string& what, std::uint64_t max_bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return -1;
  struct stat st {};
  const bool stat_ok = ::fstat(fd, &st) == 0;
  const int err = errno;
  if (!stat_ok || !S_ISREG(st.st_mode)) {
    ::close(fd);
    const char* kind = !stat_ok               ? std::strerror(err)
                       : S_ISDIR(st.st_mode)  ? "a folder"
                       : S_ISFIFO(st.st_mode) ? "a FIFO (named pipe)"
                       : S_ISCHR(st.st_mode)  ? "a character device"
                       : S_ISBLK(st.st_mode)  ? "a block device"
                       : S_ISSOCK(st.st_mode) ? "a socket"
                                              : "not a plain file";
    throw UsageError(what + " " + path + " is " + (stat_ok ? kind : std::string("unreadable: ") + kind) +
                     "; eo-ddp reads only regular files (give the file itself)");
  }
  if (max_bytes > 0 && static_cast<std::uint64_t>(st.st_size) > max_bytes) {
    ::close(fd);
    throw UsageError(what + " " + path + " is " + std::to_string(st.st_size) + " bytes, more than the " +
                     std::to_string(max_bytes >> 20) + " MiB such a file may be; is it the right file?");
  }
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags >= 0) ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  return fd;
}

bool read_input_file(const std::string& path, std::string& out, const std::string& what, std::uint64_t max_bytes) {
  const int fd = open_input_file(path, what, max_bytes);
  if (fd < 0) {
    if (errno == ENOENT || errno == ENOTDIR) return false;
    throw UsageError("cannot read " + what + " " + path + ": " + std::strerror(errno));
  }
  read_to_end(fd, path, out, what, max_bytes);
  return true;
}

}  // namespace eo
