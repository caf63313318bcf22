// Disk homes, the read ring (offload/disk_homes.h).
#include "offload/disk_homes.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>

#include "common/error.h"
#include "common/log.h"

namespace eo::offload {
namespace {
using Clock = std::chrono::steady_clock;
}  // namespace

// ---- the ring ---------------------------------------------------------------------------------

struct DiskReader::Buffer {
  std::unique_ptr<HostBuffer> mem;
  int layer = -1;
  enum class State { Empty, Reading, Ready } state = State::Empty;
  bool in_use = false;
  bool used = false;  // acquired since it was read
  std::function<void()> copied;  // an asynchronous copy from this buffer that must end before it is overwritten
};

DiskReader::DiskReader(const std::string& path, const std::vector<DiskBlock>& blocks, int ring, bool pinned,
                       const HomeNode& node, std::pair<std::uint64_t, std::uint64_t> expect_file_id)
    : path_(path), blocks_(blocks) {
  EO_CHECK(ring >= 2, "disk homes: the read ring needs at least 2 buffers, got ", ring);
  for (const auto& b : blocks_) {
    EO_CHECK(b.offset % kDiskAlign == 0, "disk homes: block of layer ", b.layer, " at an unaligned offset ", b.offset);
    buffer_bytes_ = std::max(buffer_bytes_, b.padded());
  }
  file_ = open_direct(path);
  direct_ = file_.direct;
  how_ = file_.how;
  struct stat st {};
  if (::fstat(file_.fd, &st) == 0) file_id_ = {std::uint64_t(st.st_dev), std::uint64_t(st.st_ino)};
  if (expect_file_id.second != 0 && file_id_ != expect_file_id) {
    ::close(file_.fd);
    EO_FAIL("the expert homes file ", path, " was replaced while this run started (is another job using the same "
            "expert_offload_disk_path?); give each job its own directory");
  }
  for (int i = 0; i < ring; ++i) {
    auto b = std::make_unique<Buffer>();
    b->mem = std::make_unique<HostBuffer>(static_cast<std::size_t>(buffer_bytes_), node, pinned);
    EO_CHECK(reinterpret_cast<std::uintptr_t>(b->mem->data()) % kDiskAlign == 0, "disk homes: a ring buffer is not ",
             kDiskAlign, "-byte aligned");
    buffers_.push_back(std::move(b));
  }
  thread_ = std::thread([this] { run(); });
}

DiskReader::~DiskReader() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_.notify_all();
  if (thread_.joinable()) thread_.join();
  for (auto& b : buffers_)
    if (b->copied) {
      try {
        b->copied();
      } catch (...) {
      }
    }
  if (file_.fd >= 0) ::close(file_.fd);
}

const DiskBlock* DiskReader::block_of(int layer) const {
  for (const auto& b : blocks_)
    if (b.layer == layer) return &b;
  return nullptr;
}

bool DiskReader::direct() const {
  std::lock_guard<std::mutex> lock(mu_);
  return direct_;
}

std::string DiskReader::how() const {
  std::lock_guard<std::mutex> lock(mu_);
  return how_;
}

bool DiskReader::pinned() const { return !buffers_.empty() && buffers_.front()->mem->pinned(); }

std::vector<int> DiskReader::held_layers() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int> out;
  for (const auto& b : buffers_)
    if (b->state != Buffer::State::Empty) out.push_back(b->layer);
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<int> DiskReader::buffer_nodes() const {
  std::vector<int> out;
  for (const auto& b : buffers_)
    for (int n : b->mem->resident_nodes())
      if (std::find(out.begin(), out.end(), n) == out.end()) out.push_back(n);
  return out;
}

// Under mu_: the next read — the first of the wanted blocks (the one acquire() waits for, then the
// first `ring` distinct planned ones) that no buffer holds, into a buffer that is not in use and
// holds no wanted block (an empty one first).
bool DiskReader::next_job(std::size_t* buffer, int* layer) const {
  if (!error_.empty()) return false;
  std::vector<int> wanted;
  if (urgent_ >= 0) wanted.push_back(urgent_);
  for (int l : plan_) {
    if (wanted.size() >= buffers_.size()) break;
    if (std::find(wanted.begin(), wanted.end(), l) == wanted.end()) wanted.push_back(l);
  }
  auto held = [&](int l) {
    for (const auto& b : buffers_)
      if (b->layer == l && b->state != Buffer::State::Empty) return true;
    return false;
  };
  const auto next = std::find_if(wanted.begin(), wanted.end(), [&](int l) { return !held(l); });
  if (next == wanted.end()) return false;
  int pick = -1;
  for (std::size_t i = 0; i < buffers_.size() && pick < 0; ++i)
    if (buffers_[i]->state == Buffer::State::Empty) pick = static_cast<int>(i);
  for (std::size_t i = 0; i < buffers_.size() && pick < 0; ++i) {
    const Buffer& b = *buffers_[i];
    if (b.state == Buffer::State::Ready && !b.in_use && std::find(wanted.begin(), wanted.end(), b.layer) == wanted.end())
      pick = static_cast<int>(i);
  }
  if (pick < 0) return false;
  *buffer = static_cast<std::size_t>(pick);
  *layer = *next;
  return true;
}

std::string DiskReader::read_block(std::uint8_t* dst, const DiskBlock& b) {
  const std::int64_t n = b.padded();
  std::int64_t got = pread_full(file_.fd, dst, n, b.offset);
  if (got < 0 && errno == EINVAL && direct_) {
    // The file system took O_DIRECT at open but refuses the read itself: read through the cache.
    DirectFile buffered;
    buffered.fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (buffered.fd >= 0) {
      ::close(file_.fd);
      file_ = buffered;
      const std::string how = "buffered reads: the file system refused an O_DIRECT read (EINVAL) of " + path_ +
                              ", so reads go through the page cache";
      {
        std::lock_guard<std::mutex> lock(mu_);
        direct_ = false;
        how_ = how;
      }
      log::warn("expert homes on disk: " + how);
      got = pread_full(file_.fd, dst, n, b.offset);
    }
  }
  if (got < 0)
    return "reading the expert homes file " + path_ + " (layer " + std::to_string(b.layer) + ", " + std::to_string(n) +
           " bytes at " + std::to_string(b.offset) + ") failed: " + std::strerror(errno);
  if (got < n)
    return "the expert homes file " + path_ + " ends " + std::to_string(n - got) + " bytes short of the block of layer " +
           std::to_string(b.layer) + " (it was truncated after this run checked it)";
  return "";
}

void DiskReader::run() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    std::size_t bi = 0;
    int layer = -1;
    work_.wait(lock, [&] { return stop_ || next_job(&bi, &layer); });
    if (stop_) return;
    Buffer& buf = *buffers_[bi];
    buf.layer = layer;
    buf.state = Buffer::State::Reading;
    std::function<void()> copied = std::move(buf.copied);
    buf.copied = nullptr;
    const DiskBlock& block = *block_of(layer);
    lock.unlock();
    const auto t0 = Clock::now();
    std::string err;
    try {
      if (copied) copied();
    } catch (const std::exception& e) {
      err = std::string("waiting for a copy out of the disk homes' read ring failed: ") + e.what();
    }
    if (err.empty()) err = read_block(buf.mem->data(), block);
    // Every read is checked, not only a block's first: the file can change on the drive at any
    // time, and a slot must never hold bytes that were not verified (docs/benchmarks.md: cost).
    if (err.empty()) {
      const std::uint64_t sum = arena_checksum(buf.mem->data(), block.bytes);
      if (sum != block.checksum)
        err = "the expert homes file " + path_ + ": the block of layer " + std::to_string(layer) + " reads back with checksum " +
              checksum_hex(sum) + ", its header says " + checksum_hex(block.checksum) +
              ": the file changed on the drive after it was written (or the drive returns bad data). Delete it; the next "
              "run rebuilds it";
    }
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    lock.lock();
    stats_.read_seconds += dt;
    if (!err.empty()) {
      if (error_.empty()) error_ = err;
      buf.state = Buffer::State::Empty;
      buf.layer = -1;
    } else {
      buf.state = Buffer::State::Ready;
      buf.used = false;
      ++stats_.reads;
      stats_.read_bytes += block.bytes;
    }
    done_.notify_all();
  }
}

void DiskReader::plan(std::vector<int> upcoming) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    plan_ = std::move(upcoming);
  }
  work_.notify_all();
}

const std::uint8_t* DiskReader::acquire(int layer) {
  EO_CHECK(block_of(layer), "disk homes: layer ", layer, " has no block in ", path_);
  std::unique_lock<std::mutex> lock(mu_);
  auto ready = [&]() -> Buffer* {
    for (auto& b : buffers_)
      if (b->layer == layer && b->state == Buffer::State::Ready) return b.get();
    return nullptr;
  };
  bool held = false;
  for (const auto& b : buffers_) held = held || (b->layer == layer && b->state != Buffer::State::Empty);
  if (!held) {
    std::vector<int> wanted;
    for (int l : plan_)
      if (wanted.size() < buffers_.size() && std::find(wanted.begin(), wanted.end(), l) == wanted.end()) wanted.push_back(l);
    if (std::find(wanted.begin(), wanted.end(), layer) == wanted.end()) ++stats_.unplanned;
    urgent_ = layer;
    work_.notify_all();
  }
  const auto t0 = Clock::now();
  done_.wait(lock, [&] { return !error_.empty() || ready() != nullptr; });
  stats_.wait_seconds += std::chrono::duration<double>(Clock::now() - t0).count();
  if (!error_.empty()) throw Error(error_);
  Buffer* b = ready();
  b->in_use = true;
  ++stats_.acquires;
  if (b->used) ++stats_.ring_hits;
  b->used = true;
  if (urgent_ == layer) urgent_ = -1;
  return b->mem->data();
}

void DiskReader::release(int layer, std::function<void()> copied) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    Buffer* b = nullptr;
    for (auto& x : buffers_)
      if (x->layer == layer && x->in_use) b = x.get();
    EO_CHECK(b, "disk homes: release(", layer, ") of a block that was not acquired");
    b->in_use = false;
    if (copied) {
      if (b->copied) b->copied = [first = std::move(b->copied), second = std::move(copied)] { first(); second(); };
      else b->copied = std::move(copied);
    }
    // That copy is done: the block leaves the front of the plan.
    const auto it = std::find(plan_.begin(), plan_.end(), layer);
    if (it != plan_.end()) plan_.erase(it);
  }
  work_.notify_all();
}

DiskReader::Stats DiskReader::take_stats() {
  std::lock_guard<std::mutex> lock(mu_);
  Stats s = stats_;
  stats_ = Stats{};
  return s;
}

}  // namespace eo::offload
