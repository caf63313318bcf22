// expert_offload_homes: disk. Every rank builds each block's arena from its checkpoint once, to
// checksum it (the file must hold exactly these bytes); the writer (the host's leader, or this rank
// alone) reuses the file when it matches and otherwise (re)writes it, dropping the checkpoint's
// tensors as it goes; the others open it once exchange() says it is ready and check its header
// against their own checksums. Then the ring is opened: host RAM from here on is the ring.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "common/error.h"
#include "common/log.h"
#include "common/text.h"
#include "offload/disk_homes.h"
#include "offload/home_store.h"
#include "offload/layout.h"

namespace eo::offload {
namespace {

class DiskHomes final : public HomeStore {
 public:
  DiskHomes(const std::vector<ArenaExtent>& blocks, const ArenaSource& source, const HomeNode& node, bool pinned,
            const DiskHomesOptions& d, const std::optional<HomeSharing>& sharing, int slots) {
    const bool writer = !sharing || sharing->leader;
    const std::string path = disk_homes_path(d.dir);
    DiskHomesHeader header;
    header.identity = d.identity;
    // The arenas' layout (offload/layout.h); what the bytes encode is the engine's and the
    // identity's business, not the file's.
    header.identity["arena"] = "4-bit expert arenas: per expert gate, up, down; packed codes then statistics, " +
                               std::to_string(kArenaAlign) + "-byte aligned";
    std::vector<std::int64_t> offsets;
    {
      std::int64_t largest = 0;
      for (const ArenaExtent& b : blocks) largest = std::max(largest, b.bytes);
      HostBuffer scratch(static_cast<std::size_t>(largest), HomeNode{}, /*pinned=*/false);
      for (const ArenaExtent& b : blocks) {
        std::memset(scratch.data(), 0, static_cast<std::size_t>(b.bytes));
        source.fill(b.layer, scratch.data());
        DiskBlock db;
        db.layer = b.layer;
        db.bytes = b.bytes;
        db.checksum = arena_checksum(scratch.data(), b.bytes);
        header.blocks.push_back(db);
        offsets.push_back(b.offset);
        checksums_.push_back(db.checksum);
        total_ += b.bytes;
      }
    }
    place_disk_blocks(header, offsets);
    DiskHomesCheck check;
    if (writer) {
      std::error_code ec;
      std::filesystem::create_directories(d.dir, ec);
      check = check_disk_homes(path, header);
      if (check.matches) {
        log::info("expert homes on disk: reusing " + path + " (" + std::to_string(header.blocks.size()) + " blocks, " +
                  human_bytes(double(header.file_bytes)) + "; its header and size match this run's experts, and so do the block checksums it records: each block's bytes "
                  "are checked against them as they are read)");
      } else {
        if (::access(d.dir.c_str(), W_OK) != 0 || ec) {
          const std::string why = ec ? ec.message() : std::strerror(errno);
          throw Error("expert_offload_homes: disk: expert_offload_disk_path " + d.dir + " is not a writable directory (" + why +
                      ") and holds no usable homes file (" + path + ": " + check.reason +
                      "); make it writable or set expert_offload_disk_path to a directory on a local drive with " +
                      human_bytes(double(header.file_bytes)) + " free");
        }
        log::info("expert homes on disk: " + std::string(check.exists ? "rebuilding " : "writing ") + path + " (" +
                  human_bytes(double(header.file_bytes)) + "): " + check.reason);
        const auto t0 = std::chrono::steady_clock::now();
        std::size_t at = 0;
        write_disk_homes(path, header, [&](const DiskBlock& db, std::uint8_t* dst) {
          source.fill(db.layer, dst);
          EO_CHECK(arena_checksum(dst, db.bytes) == header.blocks[at++].checksum, "offload: layer ", db.layer,
                   "'s arena changed between its checksum and its write");
          source.drop(db.layer);
        });
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        check = check_disk_homes(path, header);
        EO_CHECK(check.matches, "expert homes on disk: the file just written to ", path, " does not check out: ", check.reason);
        log::info("expert homes on disk: wrote " + path + " in " + std::to_string(s).substr(0, 5) + " s");
      }
    }
    for (const ArenaExtent& b : blocks) source.drop(b.layer);
    if (sharing) {
      sharing->exchange(ShareHandle{});  // returns once every host's leader has its file ready
      if (!writer) {
        check = check_disk_homes(path, header);
        if (!check.matches)
          throw Error("expert_offload_homes: disk: the homes file " + path + " that this host's leader rank wrote does not " +
                      "match this rank's experts: " + check.reason + " (do all ranks load the same checkpoint with the same "
                      "settings, and does expert_offload_disk_path name a directory on this host's own drive?)");
      }
    }
    const int slots_planned = std::min<int>(static_cast<int>(header.blocks.size()), slots);
    const int ring = d.ring_buffers > 0 ? d.ring_buffers : disk_ring_buffers(slots_planned);
    reader_ = std::make_unique<DiskReader>(path, header.blocks, ring, pinned, node, check.file_id);
    node_ = node;
    if (sharing) sharing->barrier();
  }

  HomeKind kind() const override { return HomeKind::Disk; }
  const std::uint8_t* acquire(int layer) override { return reader_->acquire(layer); }
  void release(int layer, std::function<void()> copied) override { reader_->release(layer, std::move(copied)); }
  bool reuses_buffers() const override { return true; }
  int read_ahead_depth() const override { return reader_->ring_size(); }
  void read_ahead(std::vector<int> upcoming) override { reader_->plan(std::move(upcoming)); }
  HomeReads take_reads() override {
    const DiskReader::Stats s = reader_->take_stats();
    HomeReads r;
    r.reads = s.reads;
    r.read_bytes = s.read_bytes;
    r.read_seconds = s.read_seconds;
    r.wait_seconds = s.wait_seconds;
    r.unplanned = s.unplanned;
    r.ring_hits = s.ring_hits;
    return r;
  }
  bool pinned() const override { return reader_->pinned(); }
  std::int64_t host_ram_bytes() const override { return reader_->ram_bytes(); }
  std::vector<int> page_nodes() const override { return reader_->buffer_nodes(); }
  std::pair<std::uint64_t, std::uint64_t> file_id() const override { return reader_->file_id(); }
  std::vector<std::pair<const void*, std::size_t>> checked_ranges() const override {
    return {{checksums_.data(), checksums_.size() * sizeof(std::uint64_t)}};
  }
  std::string file() const override { return reader_->path(); }
  std::string describe(std::int64_t total_bytes) const override {
    return human_bytes(double(total_bytes)) + " in " + reader_->path() + " (" + reader_->how() + "), read ahead into " +
           std::to_string(reader_->ring_size()) + " " + (reader_->pinned() ? "pinned" : "pageable") + " buffers of " +
           human_bytes(double(reader_->buffer_bytes())) + " (" + node_.reason + ")";
  }

 private:
  std::unique_ptr<DiskReader> reader_;
  std::vector<std::uint64_t> checksums_;  // every block's, in layer order
  std::int64_t total_ = 0;
  HomeNode node_;
};

}  // namespace

std::unique_ptr<HomeStore> make_disk_homes(const std::vector<ArenaExtent>& blocks, const ArenaSource& source,
                                           const HomeNode& node, bool pinned, const DiskHomesOptions& options,
                                           const std::optional<HomeSharing>& sharing, int slots) {
  return std::make_unique<DiskHomes>(blocks, source, node, pinned, options, sharing, slots);
}

}  // namespace eo::offload
