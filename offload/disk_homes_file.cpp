// Disk homes, the file: its layout, header, check and atomic writer, and reading it (offload/disk_homes.h).
#include "offload/disk_homes.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "common/checksum.h"
#include "common/error.h"
#include "common/fault_seam.h"
#include "common/files.h"
#include "common/json_depth.h"
#include "common/text.h"
#include "models/hf_config.h"
#include "offload/layout.h"

namespace eo::offload {
namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

constexpr char kMagic[8] = {'E', 'O', 'D', 'D', 'P', 'H', 'O', 'M'};
constexpr std::size_t kPrefixBytes = 48;  // magic, version, reserved, region, json bytes, json sum, prefix sum
constexpr std::int64_t kMaxRegion = std::int64_t(64) << 20;
// While writing, the file's pages are pushed to the drive and dropped from the page cache every so
// often: it is read with O_DIRECT later, and cached pages would only take RAM the ring saved.
constexpr std::int64_t kFlushEvery = std::int64_t(256) << 20;

std::int64_t align_up(std::int64_t x) { return (x + kDiskAlign - 1) / kDiskAlign * kDiskAlign; }


void put_u64(std::uint8_t* p, std::uint64_t v) { std::memcpy(p, &v, 8); }
std::uint64_t get_u64(const std::uint8_t* p) {
  std::uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

json header_json(const DiskHomesHeader& h) {
  json blocks = json::array();
  for (const auto& b : h.blocks) blocks.push_back({b.layer, b.offset, b.bytes, checksum_hex(b.checksum)});
  return {{"identity", h.identity}, {"blocks", blocks}, {"file_bytes", h.file_bytes}};
}

std::int64_t region_bytes(const DiskHomesHeader& h) {
  // Room for the JSON however large the numbers placed later get (each block entry stays under 100 bytes).
  const std::size_t identity = json(h.identity).dump().size();
  return align_up(static_cast<std::int64_t>(kPrefixBytes + identity + 100 * h.blocks.size() + 256));
}

// The header region: prefix + JSON, zero-padded to the first block.
std::vector<std::uint8_t> encode_header(const DiskHomesHeader& h, std::int64_t region) {
  const std::string text = header_json(h).dump();
  EO_CHECK(static_cast<std::int64_t>(kPrefixBytes + text.size()) <= region, "disk homes: header of ", text.size(),
           " bytes does not fit its region of ", region);
  std::vector<std::uint8_t> out(static_cast<std::size_t>(region), 0);
  std::memcpy(out.data(), kMagic, 8);
  const std::uint32_t version = kDiskHomesVersion;
  std::memcpy(out.data() + 8, &version, 4);
  put_u64(out.data() + 16, static_cast<std::uint64_t>(region));
  put_u64(out.data() + 24, text.size());
  put_u64(out.data() + 32, hash_bytes(text.data(), text.size(), kDiskHomesVersion));
  put_u64(out.data() + 40, hash_bytes(out.data(), 40, kDiskHomesVersion));
  std::memcpy(out.data() + kPrefixBytes, text.data(), text.size());
  return out;
}


struct AlignedBuffer {
  explicit AlignedBuffer(std::int64_t bytes) : size(bytes) {
    void* p = nullptr;
    if (bytes > 0 && ::posix_memalign(&p, static_cast<std::size_t>(kDiskAlign), static_cast<std::size_t>(bytes)) != 0)
      EO_FAIL("disk homes: cannot allocate a buffer of ", human_bytes(double(bytes)), " for writing the homes file");
    data = static_cast<std::uint8_t*>(p);
  }
  ~AlignedBuffer() { std::free(data); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  std::uint8_t* data = nullptr;
  std::int64_t size = 0;
};

// The writes of one homes file, counted so a failure says how far it got; the test seam's full
// drive (disk_homes_full_after) fails a write the way a real one does: part written, then ENOSPC.
class FileWriter {
 public:
  FileWriter(int fd, std::string tmp, std::int64_t total) : fd_(fd), tmp_(std::move(tmp)), total_(total) {}
  void put(const std::uint8_t* p, std::int64_t n, std::int64_t off, const std::string& what) {
    const std::int64_t limit = faults::plan().disk_homes_full_after;
    std::int64_t done = 0;
    while (done < n) {
      std::int64_t want = n - done;
      if (limit >= 0) want = std::min(want, std::max<std::int64_t>(0, limit - written_));
      ssize_t w = -1;
      if (want == 0) {
        errno = ENOSPC;  // the seam's drive is full
      } else {
        w = ::pwrite(fd_, p + done, static_cast<std::size_t>(want), off + done);
        if (w < 0 && errno == EINTR) continue;
      }
      if (w <= 0) fail(what, w < 0 ? errno : EIO);
      done += w;
      written_ += w;
      since_flush_ += w;
    }
    if (since_flush_ >= kFlushEvery) {
      flush();
      since_flush_ = 0;
    }
  }
  void flush() {
    if (::fdatasync(fd_) != 0) fail("flushing it to the drive (fdatasync)", errno);
    ::posix_fadvise(fd_, 0, 0, POSIX_FADV_DONTNEED);
  }

 private:
  [[noreturn]] void fail(const std::string& what, int err) {
    EO_FAIL("cannot write the expert homes file ", tmp_, " (", what, "): ", std::strerror(err), " after ", written_, " of ",
            total_, " bytes (", human_bytes(double(total_)), ")",
            err == ENOSPC || err == EDQUOT || err == EFBIG
                ? std::string("; the drive needs ") + human_bytes(double(total_)) +
                      " free for the homes: free space there or set expert_offload_disk_path to a drive with room"
                : std::string());
  }
  int fd_;
  std::string tmp_;
  std::int64_t total_, written_ = 0, since_flush_ = 0;
};

// A whole number of the header's JSON, or a throw (which the check reports as a corrupted header):
// nlohmann's get<> would convert a float or an out-of-range number with undefined behaviour.
std::int64_t whole_number(const json& v, std::int64_t lo, std::int64_t hi) {
  if (v.is_number_unsigned() && v.get<std::uint64_t>() <= static_cast<std::uint64_t>(hi)) {
    const auto x = static_cast<std::int64_t>(v.get<std::uint64_t>());
    if (x >= lo) return x;
  } else if (v.is_number_integer() && !v.is_number_unsigned()) {
    const auto x = v.get<std::int64_t>();
    if (x >= lo && x <= hi) return x;
  }
  throw std::runtime_error("'" + v.dump() + "' is not a whole number in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
}

// The first difference between two identities, for the log.
std::string identity_difference(const std::map<std::string, std::string>& file, const std::map<std::string, std::string>& run) {
  std::map<std::string, std::pair<std::string, std::string>> keys;
  for (const auto& [k, v] : file) keys[k].first = v;
  for (const auto& [k, v] : run) keys[k].second = v;
  for (const auto& [k, v] : keys)
    if (v.first != v.second)
      return k + ": the file's is '" + (file.count(k) ? v.first : "(none)") + "', this run's '" + (run.count(k) ? v.second : "(none)") + "'";
  return "";
}

}  // namespace

std::string checksum_hex(std::uint64_t v) {
  char b[24];
  std::snprintf(b, sizeof b, "0x%016llx", static_cast<unsigned long long>(v));
  return b;
}

std::int64_t pread_full(int fd, std::uint8_t* p, std::int64_t n, std::int64_t off) {
  std::int64_t done = 0;
  while (done < n) {
    const ssize_t r = ::pread(fd, p + done, static_cast<std::size_t>(n - done), off + done);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return -1;
    if (r == 0) break;
    done += r;
  }
  return done;
}

std::uint64_t arena_checksum(const std::uint8_t* data, std::int64_t bytes) {
  return hash_bytes(data, static_cast<std::size_t>(bytes), 0);
}

std::string disk_homes_path(const std::string& dir) {
  std::string d = dir;
  while (d.size() > 1 && d.back() == '/') d.pop_back();
  return d + "/eo-ddp-expert-homes.bin";
}

void place_disk_blocks(DiskHomesHeader& h, const std::vector<std::int64_t>& copy_offsets) {
  EO_CHECK(copy_offsets.empty() || copy_offsets.size() == h.blocks.size(), "disk homes: ", copy_offsets.size(),
           " copy offsets for ", h.blocks.size(), " blocks");
  const std::int64_t region = region_bytes(h);
  std::int64_t next = 0, end = region;
  for (std::size_t i = 0; i < h.blocks.size(); ++i) {
    DiskBlock& b = h.blocks[i];
    const std::int64_t at = copy_offsets.empty() ? next : copy_offsets[i];
    EO_CHECK(at % kDiskAlign == 0 && at >= next, "disk homes: block of layer ", b.layer, " at copy offset ", at,
             " is not aligned or overlaps the previous one");
    b.offset = region + at;
    next = at + b.padded();
    end = std::max(end, b.offset + b.padded());
  }
  h.file_bytes = end;
}

DiskHomesCheck check_disk_homes(const std::string& path, const DiskHomesHeader& expected) {
  DiskHomesCheck c;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    c.exists = errno != ENOENT;
    c.reason = errno == ENOENT ? "no homes file yet" : std::string("it cannot be opened (") + std::strerror(errno) + ")";
    return c;
  }
  c.exists = true;
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    c.reason = "it is not a regular file";
    return c;
  }
  c.file_id = {std::uint64_t(st.st_dev), std::uint64_t(st.st_ino)};
  std::uint8_t prefix[kPrefixBytes];
  const std::int64_t got = pread_full(fd, prefix, kPrefixBytes, 0);
  if (got < 0) {
    c.reason = std::string("it cannot be read (") + std::strerror(errno) + ")";
    return c;
  }
  if (got < static_cast<std::int64_t>(kPrefixBytes) || std::memcmp(prefix, kMagic, 8) != 0) {
    c.reason = "it is not an eo-ddp homes file (no EODDPHOM header; " + std::to_string(st.st_size) + " bytes)";
    return c;
  }
  if (get_u64(prefix + 40) != hash_bytes(prefix, 40, kDiskHomesVersion)) {
    c.reason = "its header is corrupted (the header prefix does not match its checksum)";
    return c;
  }
  std::uint32_t version = 0;
  std::memcpy(&version, prefix + 8, 4);
  if (version != kDiskHomesVersion) {
    c.reason = "it has format version " + std::to_string(version) + ", this build writes version " + std::to_string(kDiskHomesVersion);
    return c;
  }
  const auto region = static_cast<std::int64_t>(get_u64(prefix + 16));
  const auto text_bytes = static_cast<std::int64_t>(get_u64(prefix + 24));
  if (region % kDiskAlign != 0 || region > kMaxRegion || text_bytes < 0 || static_cast<std::int64_t>(kPrefixBytes) + text_bytes > region) {
    c.reason = "its header is corrupted (header region " + std::to_string(region) + " bytes, JSON " + std::to_string(text_bytes) + ")";
    return c;
  }
  std::string text(static_cast<std::size_t>(text_bytes), '\0');
  if (pread_full(fd, reinterpret_cast<std::uint8_t*>(text.data()), text_bytes, kPrefixBytes) != text_bytes) {
    c.reason = "it is truncated inside its header (" + std::to_string(st.st_size) + " bytes)";
    return c;
  }
  if (get_u64(prefix + 32) != hash_bytes(text.data(), text.size(), kDiskHomesVersion)) {
    c.reason = "its header is corrupted (the header's JSON does not match its checksum)";
    return c;
  }
  DiskHomesHeader file;
  try {
    const json j = json::parse(text, json_depth_limit([] { throw std::runtime_error("nested too deeply"); }));
    file.identity = j.at("identity").get<std::map<std::string, std::string>>();
    constexpr std::int64_t kMax = std::int64_t(1) << 62;
    file.file_bytes = whole_number(j.at("file_bytes"), 0, kMax);
    for (const auto& e : j.at("blocks")) {
      DiskBlock b;
      b.layer = static_cast<int>(whole_number(e.at(0), 0, 1 << 20));
      b.offset = whole_number(e.at(1), 0, kMax);
      b.bytes = whole_number(e.at(2), 0, kMax);
      const std::string sum = e.at(3).get<std::string>();
      std::size_t used = 0;
      b.checksum = std::stoull(sum, &used, 16);
      if (used != sum.size()) throw std::runtime_error("checksum '" + sum + "' is not hexadecimal");
      file.blocks.push_back(b);
    }
  } catch (const std::exception& e) {
    c.reason = std::string("its header is corrupted (") + e.what() + ")";
    return c;
  }
  if (const std::string d = identity_difference(file.identity, expected.identity); !d.empty()) {
    c.reason = "it holds the homes of another model or quantisation (" + d + ")";
    return c;
  }
  if (file.blocks.size() != expected.blocks.size()) {
    c.reason = "its arena layout differs: " + std::to_string(file.blocks.size()) + " blocks, this run has " +
               std::to_string(expected.blocks.size());
    return c;
  }
  for (std::size_t i = 0; i < file.blocks.size(); ++i) {
    const DiskBlock &a = file.blocks[i], &b = expected.blocks[i];
    if (a.layer != b.layer || a.offset != b.offset || a.bytes != b.bytes) {
      c.reason = "its arena layout differs: block " + std::to_string(i) + " is layer " + std::to_string(a.layer) + ", " +
                 std::to_string(a.bytes) + " bytes at " + std::to_string(a.offset) + "; this run's is layer " +
                 std::to_string(b.layer) + ", " + std::to_string(b.bytes) + " bytes at " + std::to_string(b.offset);
      return c;
    }
  }
  if (file.file_bytes != expected.file_bytes || static_cast<std::int64_t>(st.st_size) != file.file_bytes) {
    c.reason = (static_cast<std::int64_t>(st.st_size) < file.file_bytes ? "it is truncated: " : "its size is wrong: ") +
               std::to_string(st.st_size) + " bytes on the drive, its header says " + std::to_string(file.file_bytes) +
               (file.file_bytes != expected.file_bytes ? " and this run's layout " + std::to_string(expected.file_bytes) : std::string());
    return c;
  }
  for (std::size_t i = 0; i < file.blocks.size(); ++i)
    if (file.blocks[i].checksum != expected.blocks[i].checksum) {
      c.reason = "its bytes differ from this run's experts (layer " + std::to_string(file.blocks[i].layer) + ": checksum " +
                 checksum_hex(file.blocks[i].checksum) + " in the file, " + checksum_hex(expected.blocks[i].checksum) + " from the checkpoint)";
      return c;
    }
  c.matches = true;
  return c;
}

void write_disk_homes(const std::string& path, const DiskHomesHeader& h,
                      const std::function<void(const DiskBlock& block, std::uint8_t* dst)>& fill) {
  std::int64_t largest = 0;
  for (const auto& b : h.blocks) largest = std::max(largest, b.padded());
  const std::int64_t region = h.blocks.empty() ? region_bytes(h) : h.blocks.front().offset;
  const std::vector<std::uint8_t> header = encode_header(h, region);
  write_file_atomic(path, [&](int fd, const std::string& tmp) {
    AlignedBuffer buf(largest);
    FileWriter w(fd, tmp, h.file_bytes);
    for (const auto& b : h.blocks) {
      std::memset(buf.data, 0, static_cast<std::size_t>(b.padded()));
      fill(b, buf.data);
      w.put(buf.data, b.padded(), b.offset, "the block of layer " + std::to_string(b.layer));
    }
    // The blocks are on the drive before the header that vouches for them is written.
    w.flush();
    w.put(header.data(), static_cast<std::int64_t>(header.size()), 0, "its header");
  });
}

DirectFile open_direct(const std::string& path) {
  DirectFile f;
  int err = EINVAL;
  if (!faults::plan().refuse_o_direct) {
    f.fd = ::open(path.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC | O_NOFOLLOW);
    if (f.fd >= 0) {
      f.direct = true;
      f.how = "O_DIRECT";
      return f;
    }
    err = errno;
  }
  if (err != EINVAL) EO_FAIL("cannot open the expert homes file ", path, ": ", std::strerror(err));
  f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (f.fd < 0) EO_FAIL("cannot open the expert homes file ", path, ": ", std::strerror(errno));
  f.how = std::string("buffered reads: ") +
          (faults::plan().refuse_o_direct ? "the fault-injection plan refused O_DIRECT" : "the file system refused O_DIRECT (EINVAL)") +
          " for " + path + ", so reads go through the page cache (tmpfs, or a network file system?)";
  ::posix_fadvise(f.fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  return f;
}

int disk_ring_buffers(int num_slots) { return std::max(2, num_slots + 1); }

DiskHomesSize estimate_disk_homes(const model::ModelConfig& c, int blocksize, bool double_quant, int num_slots,
                                  QuantFormat format) {
  DiskHomesSize z;
  z.blocks = c.moe_layer_count();
  z.block_bytes = expert_block_bytes(c, blocksize, double_quant, format);
  DiskHomesHeader h;
  h.identity["arena"] = std::string(200, 'x');  // the engine's and the trainer's identity: a few hundred bytes
  h.blocks.resize(static_cast<std::size_t>(z.blocks));
  for (auto& b : h.blocks) b.bytes = z.block_bytes;
  place_disk_blocks(h);
  z.file_bytes = h.file_bytes;
  z.ring = disk_ring_buffers(std::min(num_slots, z.blocks));
  z.ring_bytes = z.ring * align_up(z.block_bytes);
  return z;
}

double sequential_read_gbps(const std::string& path, std::int64_t chunk, std::int64_t* bytes_read, bool* direct) {
  chunk = std::max<std::int64_t>(kDiskAlign, chunk / kDiskAlign * kDiskAlign);
  DirectFile f = open_direct(path);
  AlignedBuffer buf(chunk);
  std::int64_t total = 0;
  const auto t0 = Clock::now();
  for (;;) {
    const std::int64_t got = pread_full(f.fd, buf.data, chunk, total);
    if (got < 0) {
      const int err = errno;
      ::close(f.fd);
      EO_FAIL("reading ", path, " failed: ", std::strerror(err));
    }
    total += got;
    if (got < chunk) break;
  }
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  ::close(f.fd);
  if (bytes_read) *bytes_read = total;
  if (direct) *direct = f.direct;
  return s > 0 ? double(total) / s / 1e9 : 0;
}

}  // namespace eo::offload
