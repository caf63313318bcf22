#include "runtime/output_dir.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <map>
#include <mutex>
#include <set>

#include "common/error.h"
#include "common/files.h"
#include "common/log.h"

namespace eo {
namespace fs = std::filesystem;

namespace {

const char* kLockFile = ".eo-ddp.lock";

struct HeldLock {
  int file_fd = -1, dir_fd = -1;
  bool dir_locked = false;  // false: the file system cannot flock a folder (NFS); the lock file alone
};
std::mutex g_locks_mu;
std::map<std::string, HeldLock> g_locks;  // by output_dir as given to lock_output_dir

std::string host_name() {
  char host[256] = {0};
  ::gethostname(host, sizeof host - 1);
  return host;
}

std::string now_text() {
  const std::time_t t = std::time(nullptr);
  char buf[64];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S", std::localtime(&t));
  return buf;
}

std::string read_holder(int fd) {
  std::string holder;
  char buf[512];
  const ssize_t n = fd < 0 ? 0 : ::pread(fd, buf, sizeof buf - 1, 0);
  if (n > 0) holder.assign(buf, static_cast<std::size_t>(n));
  if (const auto at = holder.find("held by "); at != std::string::npos) holder = holder.substr(at + 8);
  if (const auto nl = holder.find('\n'); nl != std::string::npos) holder.resize(nl);
  return holder;
}

[[noreturn]] void refuse_in_use(const std::string& output_dir, const std::string& path, const std::string& holder) {
  throw UsageError("output_dir " + output_dir + " is in use by another eo-ddp run (" +
                   (holder.empty() ? std::string("holder unknown") : holder) + "; lock " + path +
                   "). Two runs in one folder would overwrite each other's checkpoints. Wait for that run to end, "
                   "stop it, or choose another output_dir.");
}

}  // namespace

std::shared_ptr<void> lock_output_dir(const std::string& output_dir) {
  const std::string path = (fs::path(output_dir) / kLockFile).string();
  const int dir_fd = ::open(output_dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  EO_CHECK(dir_fd >= 0, "cannot open ", output_dir, ": ", std::strerror(errno));
  bool dir_locked = true;
  if (::flock(dir_fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    if (err == EWOULDBLOCK) {
      const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
      const std::string holder = read_holder(fd);
      if (fd >= 0) ::close(fd);
      ::close(dir_fd);
      refuse_in_use(output_dir, output_dir + " itself", holder);
    }
    dir_locked = false;  // e.g. NFS: the lock file alone, checked at every save
  }
  const int fd = open_nofollow(path, O_RDWR | O_CREAT, 0644);
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    const std::string holder = read_holder(fd);
    ::close(fd);
    ::close(dir_fd);
    if (err == EWOULDBLOCK) refuse_in_use(output_dir, path, holder);
    EO_FAIL("cannot lock ", path, ": ", std::strerror(err));
  }
  const std::string me = "eo-ddp run lock: held by pid " + std::to_string(::getpid()) + " on host " + host_name() +
                         ", started " + now_text() +
                         "\nWhile that process runs, no other eo-ddp run may use this folder. The lock ends with the "
                         "process; this file is left behind and is harmless then (deleting it is too).\n";
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, me.data(), me.size(), 0) != static_cast<ssize_t>(me.size())) {
    const int err = errno;
    ::close(fd);
    ::close(dir_fd);
    EO_FAIL("cannot write ", path, ": ", std::strerror(err));
  }
  const HeldLock held{fd, dir_fd, dir_locked};
  {
    std::lock_guard<std::mutex> lk(g_locks_mu);
    g_locks[output_dir] = held;
  }
  return std::shared_ptr<void>(new HeldLock(held), [output_dir](void* p) {
    auto* h = static_cast<HeldLock*>(p);
    {
      std::lock_guard<std::mutex> lk(g_locks_mu);
      g_locks.erase(output_dir);
    }
    ::close(h->file_fd);  // releases the flocks
    ::close(h->dir_fd);
    delete h;
  });
}

std::string held_output_dir(const std::string& output_dir) {
  std::lock_guard<std::mutex> lk(g_locks_mu);
  const auto it = g_locks.find(output_dir);
  if (it == g_locks.end()) return output_dir;
  const HeldLock& h = it->second;
  const std::string through = "/proc/self/fd/" + std::to_string(h.dir_fd);
  struct stat held {}, now {};
  if (!h.dir_locked) {
    const std::string path = (fs::path(through) / kLockFile).string();
    if (!(::fstat(h.file_fd, &held) == 0 && ::lstat(path.c_str(), &now) == 0 && held.st_dev == now.st_dev &&
          held.st_ino == now.st_ino))
      EO_FAIL("the lock file ", output_dir, "/", kLockFile, " was deleted or replaced during this run, and this file "
              "system cannot lock the folder itself: another run may be using ", output_dir, " now. Not saving into it; "
              "check for another run there, then resume (resume_from_checkpoint: auto)");
  }
  if (::fstat(h.dir_fd, &held) != 0 || ::stat(through.c_str(), &now) != 0 || now.st_ino != held.st_ino ||
      now.st_dev != held.st_dev)
    return output_dir;  // no /proc: by path, as before
  struct stat named {};
  if (::stat(output_dir.c_str(), &named) != 0 || named.st_ino != held.st_ino || named.st_dev != held.st_dev) {
    static std::set<std::string> warned;
    if (warned.insert(output_dir).second) {
      std::error_code ec;
      const fs::path where = fs::read_symlink(through, ec);
      log::warn("output_dir " + output_dir + " was moved or replaced during this run; this run goes on writing into "
                "the folder it locked" + (ec ? std::string() : ", now at " + where.string()) +
                ", never into whatever now has its name");
    }
  }
  return through;
}

}  // namespace eo
