#include "common/checksum.h"

#include <cstdio>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

namespace eo {
namespace {
inline std::uint64_t rotl(std::uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
}  // namespace

std::uint64_t mix64(std::uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

std::uint64_t hash_bytes(const void* data, std::size_t n, std::uint64_t seed) {
  const auto* p = static_cast<const unsigned char*>(data);
  constexpr std::uint64_t kMul = 0x9E3779B97F4A7C15ULL;
  std::uint64_t lane[4] = {seed ^ 0x243F6A8885A308D3ULL, seed ^ 0x13198A2E03707344ULL, seed ^ 0xA4093822299F31D0ULL,
                           seed ^ 0x082EFA98EC4E6C89ULL};
  std::size_t i = 0;
  for (; i + 32 <= n; i += 32)
    for (int l = 0; l < 4; ++l) {
      std::uint64_t w;
      std::memcpy(&w, p + i + 8 * l, 8);
      lane[l] = rotl(lane[l] ^ (w * kMul), 31) * 0xC2B2AE3D27D4EB4FULL;
    }
  std::uint64_t h = mix64(n) ^ lane[0] ^ rotl(lane[1], 17) ^ rotl(lane[2], 29) ^ rotl(lane[3], 43);
  for (; i < n; ++i) h = (h ^ p[i]) * 0x100000001B3ULL;
  return mix64(h);
}

bool hash_file(const std::string& path, std::uint64_t& hash, std::uint64_t& bytes) {
  // O_NONBLOCK and a regular file only: a FIFO or a device is never waited on nor read forever.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return false;
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    errno = EINVAL;
    return false;
  }
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  std::vector<unsigned char> buf(std::size_t(16) << 20);
  std::uint64_t h = 0x6A09E667F3BCC908ULL, total = 0, piece = 0;
  for (;;) {
    std::size_t got = 0;
    while (got < buf.size()) {  // whole pieces, so the hash does not depend on how read() splits them
      const ssize_t n = ::read(fd, buf.data() + got, buf.size() - got);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        const int err = errno;
        ::close(fd);
        errno = err;
        return false;
      }
      if (n == 0) break;
      got += static_cast<std::size_t>(n);
    }
    if (got == 0) break;
    h = mix64(h ^ hash_bytes(buf.data(), got, piece++));
    total += got;
    if (got < buf.size()) break;
  }
  ::close(fd);
  hash = mix64(h ^ total);
  bytes = total;
  return true;
}

void Fnv1a64::add(const void* data, std::size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
}

std::string Fnv1a64::hex() const {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

}  // namespace eo
