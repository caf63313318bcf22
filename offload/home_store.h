// Homes behind one interface (expert_offload_homes): where every offloaded block's arena lives
// between its copies to the device. The engine (offload/engine.h) owns the arenas' layout, the
// slots and the staging; a HomeStore only keeps bytes and hands them out for a copy.
//
//  - per_rank (per_rank_homes.cpp): each block in its own exact-size host buffer of this rank.
//  - per_numa_node (node_shared_homes.cpp): every block in one memory file per NUMA node, filled by
//    the node's leader and mapped read-only by its other ranks.
//  - disk (disk_home_store.cpp): every block in one file per host, read ahead along the schedule into
//    a ring of a few page-locked buffers (offload/disk_homes.h).
//
// Homes shared by several ranks meet through two collectives that the trainer provides
// (HomeSharing), so this module needs no MPI.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "offload/homes.h"

namespace eo::offload {

// One block's arena: its bytes, and where it starts in one contiguous, page-aligned copy of every
// arena (the shared memory file; the disk file after its header).
struct ArenaExtent {
  int layer = -1;
  std::int64_t bytes = 0;
  std::int64_t offset = 0;
};

// What homes are filled from: `fill(layer, dst)` writes the layer's arena into `dst` (zeroed, its
// bytes long); `drop(layer)` says the checkpoint's tensors of that layer are no longer needed, so
// host RAM holds the checkpoint's experts and the homes at once for one block, not for all.
struct ArenaSource {
  std::function<void(int layer, std::uint8_t* dst)> fill;
  std::function<void(int layer)> drop;
};

// The collectives of homes one rank makes for several. Every rank of the job calls them, in this
// order: `exchange(mine)` returns once every leader's homes are ready, with the share handle of this
// rank's leader (a follower, and every rank with disk homes, passes an empty handle); `barrier()`
// returns once every rank has opened its homes.
struct HomeSharing {
  bool leader = true;
  std::function<ShareHandle(const ShareHandle& mine)> exchange;
  std::function<void()> barrier;
};

// expert_offload_homes: disk.
struct DiskHomesOptions {
  std::string dir;  // expert_offload_disk_path: the homes file goes there (created if missing)
  // What the homes are made from (model, quantisation settings): written into the file's header,
  // so a later run of another model or setting rebuilds the file and says which key differs.
  std::map<std::string, std::string> identity;
  int ring_buffers = 0;  // read buffers; 0 = disk_ring_buffers(slots)
};

enum class HomeKind { PerRank, NodeShared, Disk };

// Reads from a drive since the last take_reads() (zero for homes in RAM).
struct HomeReads {
  std::int64_t reads = 0, read_bytes = 0, unplanned = 0, ring_hits = 0;
  double read_seconds = 0, wait_seconds = 0;
};

class HomeStore {
 public:
  virtual ~HomeStore() = default;
  virtual HomeKind kind() const = 0;

  // Block `layer`'s arena bytes for a copy, held until release(). `copied`, when set, returns once
  // an asynchronous copy out of them has ended; only homes that reuse their buffers need it.
  virtual const std::uint8_t* acquire(int layer) = 0;
  virtual void release(int layer, std::function<void()> copied = {}) = 0;
  virtual bool reuses_buffers() const { return false; }
  // Homes that read ahead: how many blocks they hold at once (0: every block is always there), and
  // the blocks the next copies will take, soonest first.
  virtual int read_ahead_depth() const { return 0; }
  virtual void read_ahead(std::vector<int> upcoming) { (void)upcoming; }
  virtual HomeReads take_reads() { return {}; }

  virtual bool pinned() const = 0;
  virtual std::int64_t host_ram_bytes() const = 0;  // host RAM the homes take on this rank
  virtual std::vector<int> page_nodes() const = 0;  // NUMA nodes their pages are really on
  // (st_dev, st_ino) of the file holding them, equal on every rank sharing one copy; (0, 0) for none.
  virtual std::pair<std::uint64_t, std::uint64_t> file_id() const { return {0, 0}; }
  // What the ranks' cross-check compares: every block's bytes, or for disk homes the checksums of
  // every block as this rank built it from its own checkpoint (what it checked the file against).
  virtual std::vector<std::pair<const void*, std::size_t>> checked_ranges() const = 0;
  virtual std::string file() const { return {}; }  // the disk homes file ("" for homes in RAM)
  // Where and how, for the start-up log ("1.2 GiB in pinned host homes (NUMA node 0: ...)").
  virtual std::string describe(std::int64_t total_bytes) const = 0;
};

std::unique_ptr<HomeStore> make_per_rank_homes(const std::vector<ArenaExtent>& blocks, const ArenaSource& source,
                                               const HomeNode& node, bool pinned);
// `copy_bytes`: the contiguous copy's size (the last extent's offset + bytes, page-aligned).
std::unique_ptr<HomeStore> make_node_shared_homes(const std::vector<ArenaExtent>& blocks, std::int64_t copy_bytes,
                                                  const ArenaSource& source, const HomeNode& node, bool pinned,
                                                  const HomeSharing& sharing);
// `slots`: the device slots the engine will make (the ring is sized from them).
std::unique_ptr<HomeStore> make_disk_homes(const std::vector<ArenaExtent>& blocks, const ArenaSource& source,
                                           const HomeNode& node, bool pinned, const DiskHomesOptions& options,
                                           const std::optional<HomeSharing>& sharing, int slots);

}  // namespace eo::offload
