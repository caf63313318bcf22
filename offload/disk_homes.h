// Disk homes (expert_offload_homes: disk): every MoE block's arena in one file on a local drive,
// read back into a small ring of page-locked buffers ahead of use, so host RAM holds the ring (a
// few blocks), not the model.
//
// The file: [header region][block arenas]. The header region (a multiple of 4096 bytes) starts
// with a fixed 48-byte little-endian prefix — the magic "EODDPHOM", u32 format version, u32 0, u64
// region size, u64 JSON length, u64 JSON checksum, u64 checksum of the 40 bytes before it (both
// common/checksum.h's hash, seeded with the version) — then the JSON: the identity (what the homes were made from: model,
// quantisation settings; given by the trainer), every block's layer, offset, bytes and checksum,
// and the file's size. Each block starts on a 4096-byte boundary, zero-padded to the next one, so
// it reads with O_DIRECT; its bytes are the arena exactly as the engine would hold it in RAM
// (offload/layout.h), whatever they encode.
//
// Written once, atomically (common/files.h): a temporary file in the same folder, the blocks,
// fdatasync, then the header, fsync, rename into place. An error or a full drive leaves nothing
// under the name later runs open. A run reuses the file only when its header, size and every
// block's checksum equal what this run would write; anything else is rebuilt, the reason logged.
// A block's bytes are checked against its checksum every time they are read back (a change on the
// drive stops the run at its next read: exit 1, saying to delete the file, which the next run rebuilds).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <condition_variable>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "models/quant_format.h"
#include "offload/homes.h"

namespace eo::model {
struct ModelConfig;
}

namespace eo::offload {

constexpr std::int64_t kDiskAlign = 4096;  // O_DIRECT alignment of offsets, lengths and buffers
constexpr int kDiskHomesVersion = 1;

struct DiskBlock {
  int layer = -1;
  std::int64_t offset = 0;  // from the start of the file, a multiple of kDiskAlign
  std::int64_t bytes = 0;   // the arena's bytes (the read covers them rounded up to kDiskAlign)
  std::uint64_t checksum = 0;
  std::int64_t padded() const { return (bytes + kDiskAlign - 1) / kDiskAlign * kDiskAlign; }
};

struct DiskHomesHeader {
  std::map<std::string, std::string> identity;
  std::vector<DiskBlock> blocks;
  std::int64_t file_bytes = 0;
};

// A block's checksum: of its arena bytes (padding excluded), as the header records it.
std::uint64_t arena_checksum(const std::uint8_t* data, std::int64_t bytes);
std::string checksum_hex(std::uint64_t checksum);  // "0x" and 16 hex digits
// pread(2) until `n` bytes or the end of the file, retrying EINTR: the bytes read, or -1 (errno).
std::int64_t pread_full(int fd, std::uint8_t* dst, std::int64_t n, std::int64_t offset);

// The homes file of the directory expert_offload_disk_path.
std::string disk_homes_path(const std::string& dir);

// Places `blocks` (layer and bytes set; in file order) after a header region big enough for the
// header: sets every offset and file_bytes. `copy_offsets[i]`, when given, is block i's offset in
// one contiguous copy of the homes (the engine's layout, page-aligned): the file keeps it.
void place_disk_blocks(DiskHomesHeader& header, const std::vector<std::int64_t>& copy_offsets = {});

// Whether the file at `path` holds exactly what `expected` describes: identity, layout, size and
// every block's checksum. `reason` says why not ("no file yet", "its header is corrupted", ...).
struct DiskHomesCheck {
  bool matches = false;
  bool exists = false;
  std::string reason;
  std::pair<std::uint64_t, std::uint64_t> file_id{0, 0};  // (st_dev, st_ino) of the file checked
};
DiskHomesCheck check_disk_homes(const std::string& path, const DiskHomesHeader& expected);

// Writes the file atomically: `fill(block, dst)` puts the block's arena bytes into `dst` (zeroed,
// block.padded() bytes). Throws eo::Error naming the file and the failure (ENOSPC, EIO, ...);
// nothing is left behind then. The test seam can make the drive fill up (disk_homes_full_after).
void write_disk_homes(const std::string& path, const DiskHomesHeader& header,
                      const std::function<void(const DiskBlock& block, std::uint8_t* dst)>& fill);

// The file opened for reading with O_DIRECT — or with buffered reads where the file system refuses
// O_DIRECT (older tmpfs, some network file systems), which `how` says. Throws naming the file.
struct DirectFile {
  int fd = -1;
  bool direct = false;
  std::string how;
};
DirectFile open_direct(const std::string& path);

// Read buffers: one more than the device slots, so the next copies can wait read while one is
// copied (at least 2).
int disk_ring_buffers(int num_slots);

// The disk homes of a model whose experts are NF4 quantised at load time or the checkpoint's MXFP4
// (offload/layout.h's arenas), before anything is loaded: the file (its header estimated at a few
// KiB) and the read ring for `num_slots` device slots (a buffer per block, rounded up to kDiskAlign).
struct DiskHomesSize {
  std::int64_t file_bytes = 0;
  std::int64_t block_bytes = 0;  // one MoE block's arena
  int blocks = 0;                // MoE blocks
  int ring = 0;                  // read buffers
  std::int64_t ring_bytes = 0;   // host RAM of the ring, per rank
};
DiskHomesSize estimate_disk_homes(const model::ModelConfig& c, int blocksize, bool double_quant, int num_slots,
                                  QuantFormat format = QuantFormat::Nf4);

// The ring: blocks read from the file into `ring` page-aligned host buffers (page-locked on CUDA
// builds with `pinned`), ahead of use. The engine says which blocks it will copy next, in order
// (plan(): the staging policy's dry run along the schedule, so the list is exact), takes a block's
// bytes with acquire() and gives them back with release() once its copy to the device is done —
// or, for an asynchronous copy, hands over a call that waits for it, which the reader makes before
// it reuses the buffer. One reader thread; at most `ring` blocks are held at any time.
class DiskReader {
 public:
  DiskReader(const std::string& path, const std::vector<DiskBlock>& blocks, int ring, bool pinned, const HomeNode& node,
             std::pair<std::uint64_t, std::uint64_t> expect_file_id = {0, 0});
  ~DiskReader();
  DiskReader(const DiskReader&) = delete;
  DiskReader& operator=(const DiskReader&) = delete;

  // The layers the engine will acquire next, soonest first (replaces the previous list). The ring
  // is kept filled with the first `ring` distinct ones.
  void plan(std::vector<int> upcoming);
  // Block `layer`'s arena bytes (read now if they were not planned), held until release().
  const std::uint8_t* acquire(int layer);
  // Done with `layer`'s buffer; `copied`, if set, returns once an asynchronous copy from it ended.
  void release(int layer, std::function<void()> copied = {});

  struct Stats {
    std::int64_t reads = 0, read_bytes = 0;  // blocks read from the file (bytes as in the arena)
    double read_seconds = 0;                 // time the reader thread spent reading
    double wait_seconds = 0;                 // time acquire() waited for a read
    std::int64_t unplanned = 0;              // acquire() of a block that was not planned (read on demand)
    std::int64_t acquires = 0;
    std::int64_t ring_hits = 0;              // acquire() served by a block still in the ring from an earlier use
  };
  Stats take_stats();

  bool direct() const;    // O_DIRECT in use
  std::string how() const;  // "O_DIRECT", or why reads are buffered
  const std::string& path() const { return path_; }
  int ring_size() const { return static_cast<int>(buffers_.size()); }
  std::int64_t buffer_bytes() const { return buffer_bytes_; }
  std::int64_t ram_bytes() const { return buffer_bytes_ * ring_size(); }
  bool pinned() const;
  std::pair<std::uint64_t, std::uint64_t> file_id() const { return file_id_; }
  std::vector<int> held_layers() const;  // blocks in the ring now (read or being read); tests
  std::vector<int> buffer_nodes() const; // NUMA nodes of the ring's pages

 private:
  struct Buffer;
  void run();
  bool next_job(std::size_t* buffer, int* layer) const;
  const DiskBlock* block_of(int layer) const;
  std::string read_block(std::uint8_t* dst, const DiskBlock& b);

  std::string path_;
  DirectFile file_;
  bool direct_ = false;
  std::string how_;
  std::pair<std::uint64_t, std::uint64_t> file_id_{0, 0};
  std::vector<DiskBlock> blocks_;
  std::vector<std::unique_ptr<Buffer>> buffers_;
  std::int64_t buffer_bytes_ = 0;

  mutable std::mutex mu_;
  std::condition_variable work_, done_;
  std::vector<int> plan_;
  int urgent_ = -1;  // a block acquire() waits for that was not planned
  bool stop_ = false;
  std::string error_;
  Stats stats_;
  std::thread thread_;
};

// A sequential read of the whole file in `chunk` pieces through open_direct() (the drive's raw
// rate, for eo-bench): GB/s, with the bytes read and whether O_DIRECT was used.
double sequential_read_gbps(const std::string& path, std::int64_t chunk, std::int64_t* bytes_read = nullptr,
                            bool* direct = nullptr);

}  // namespace eo::offload
