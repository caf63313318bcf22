// Homes: where the frozen NF4 experts live between uses — host memory on the NUMA node nearest
// the rank's GPU, allocated at exactly the bytes needed and (on CUDA) page-locked with
// cudaHostRegister so copies run at the link's full rate.
//
// Why not pin_memory(): the caching host allocator behind it rounds blocks up to powers of two
// (1.78x the bytes in one reported case), which at tens of GB per rank is the difference between
// fitting in a node's RAM or not.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

struct hwloc_topology;

namespace eo::offload {

// The machine's topology, loaded once per process (hwloc).
class Topology {
 public:
  static Topology& get();
  // A topology described by hwloc's synthetic syntax, e.g. "pack:2 numa:1 core:4 pu:1" (tests).
  static std::unique_ptr<Topology> synthetic(const std::string& description);
  ~Topology();
  hwloc_topology* handle() const { return topo_; }
  int num_numa_nodes() const;

 private:
  Topology() = default;
  hwloc_topology* topo_ = nullptr;
};

// Which NUMA node a rank's homes go to, and why (for the log).
struct HomeNode {
  int node = -1;          // OS index of the NUMA node; -1 = unknown (no binding is applied)
  std::string reason;
};

// The node nearest CUDA device `cuda_index` (hwloc's CUDA locality); where the device reports no
// locality (numa_node = -1) or there is no GPU (cuda_index < 0), the node(s) of this thread's
// current CPU binding, said so in `reason`.
HomeNode choose_home_node(const Topology& topo, int cuda_index);
// The node covering a CPU set given as a list of PU OS indexes (the fallback rule, testable).
HomeNode node_of_cpus(const Topology& topo, const std::vector<int>& pus);

// Binds this process' threads to the cores of `node` (no-op for node -1). Returns false and says
// why in `why` when the OS refuses.
bool bind_threads_to_node(const Topology& topo, int node, std::string* why);

// Where another process of this host can find a shared buffer: its creator's pid and the file
// descriptor of the anonymous memory file (memfd) holding it, opened as /proc/<pid>/fd/<fd>.
struct ShareHandle {
  std::int64_t pid = 0;
  std::int64_t fd = -1;
};

// One exact-size host allocation bound to a NUMA node, optionally page-locked for the device.
//
// Shared homes (expert_offload_homes: per_numa_node): the frozen experts are identical on every
// rank, so one copy per NUMA node serves all its ranks. The leader creates the buffer in an
// anonymous memory file (memfd_create: it has no name, so a crash leaves nothing in /dev/shm;
// the memory is freed when the last mapping goes), binds its pages to the node before the first
// touch and fills it; every other rank of the node maps the same file read-only through
// /proc/<leader pid>/fd/<fd>, and page-locks its own mapping for its own GPU.
class HostBuffer {
 public:
  // pinned: cudaHostRegister (CUDA builds; on CPU builds the flag only changes the log).
  HostBuffer(std::size_t bytes, const HomeNode& node, bool pinned);
  // The leader's shared buffer (writable, pages placed as they are first written; share() tells
  // the others where it is; pin() once filled).
  static std::unique_ptr<HostBuffer> create_shared(std::size_t bytes, const HomeNode& node);
  // Another rank's view of a leader's buffer: read-only, page-locked read-only where supported.
  static std::unique_ptr<HostBuffer> open_shared(const ShareHandle& handle, std::size_t bytes, bool pinned);
  ~HostBuffer();
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  // Page-locks a shared buffer after it is filled (cudaHostRegister locks every page at once,
  // so locking before would allocate the whole buffer while the checkpoint is still in RAM).
  void pin(bool read_only);

  std::uint8_t* data() const { return data_; }
  std::size_t size() const { return bytes_; }
  bool pinned() const { return registered_; }
  bool writable() const { return writable_; }
  bool shared() const { return mapped_; }
  ShareHandle share() const;  // leader only
  void stop_sharing();        // leader: close the descriptor once every rank has mapped the buffer
  // Identity of the memory file (st_dev, st_ino): equal on every rank mapping the same buffer.
  std::pair<std::uint64_t, std::uint64_t> file_id() const { return file_id_; }
  // OS indexes of the NUMA nodes the pages actually live on (hwloc_get_area_memlocation).
  std::vector<int> resident_nodes() const;

 private:
  HostBuffer() = default;
  std::uint8_t* data_ = nullptr;
  std::size_t bytes_ = 0;
  bool hwloc_allocated_ = false;
  bool mapped_ = false;  // mmap of a memory file (shared homes)
  bool writable_ = true;
  bool registered_ = false;
  int fd_ = -1;
  std::pair<std::uint64_t, std::uint64_t> file_id_{0, 0};
};

}  // namespace eo::offload
