#include "offload/homes.h"

#include <hwloc.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "common/error.h"
#include "common/log.h"
#include "common/text.h"
#include "offload/host_memory.h"

#ifdef EO_WITH_CUDA
#include <cuda_runtime.h>
#include <hwloc/cudart.h>
#endif

namespace eo::offload {
namespace {

std::vector<int> nodeset_to_list(hwloc_const_nodeset_t set) {
  std::vector<int> out;
  unsigned i;
  hwloc_bitmap_foreach_begin(i, set) out.push_back(static_cast<int>(i));
  hwloc_bitmap_foreach_end();
  return out;
}

// The first node of a cpuset's nodeset; "first" keeps the choice deterministic when a binding
// spans several nodes.
HomeNode node_of_cpuset(const Topology& topo, hwloc_const_cpuset_t cpus, const std::string& why) {
  hwloc_nodeset_t nodes = hwloc_bitmap_alloc();
  hwloc_cpuset_to_nodeset(topo.handle(), cpus, nodes);
  HomeNode h;
  const int first = hwloc_bitmap_first(nodes);
  const int count = hwloc_bitmap_weight(nodes);
  hwloc_bitmap_free(nodes);
  if (first < 0) {
    h.reason = why + ": no NUMA node found; homes are left to the OS";
    return h;
  }
  h.node = first;
  h.reason = why + " -> NUMA node " + std::to_string(first) +
             (count > 1 ? " (first of " + std::to_string(count) + " nodes covered)" : "");
  return h;
}

}  // namespace

Topology& Topology::get() {
  static Topology* t = [] {
    auto* topo = new Topology();
    EO_CHECK(hwloc_topology_init(&topo->topo_) == 0, "hwloc_topology_init failed");
    hwloc_topology_set_io_types_filter(topo->topo_, HWLOC_TYPE_FILTER_KEEP_IMPORTANT);
    EO_CHECK(hwloc_topology_load(topo->topo_) == 0, "hwloc_topology_load failed");
    return topo;
  }();
  return *t;
}

std::unique_ptr<Topology> Topology::synthetic(const std::string& description) {
  std::unique_ptr<Topology> t(new Topology());
  EO_CHECK(hwloc_topology_init(&t->topo_) == 0, "hwloc_topology_init failed");
  EO_CHECK(hwloc_topology_set_synthetic(t->topo_, description.c_str()) == 0, "bad synthetic topology '", description, "'");
  EO_CHECK(hwloc_topology_load(t->topo_) == 0, "hwloc_topology_load failed");
  return t;
}

Topology::~Topology() {
  if (topo_) hwloc_topology_destroy(topo_);
}

int Topology::num_numa_nodes() const { return hwloc_get_nbobjs_by_type(topo_, HWLOC_OBJ_NUMANODE); }

HomeNode node_of_cpus(const Topology& topo, const std::vector<int>& pus) {
  hwloc_cpuset_t set = hwloc_bitmap_alloc();
  for (int p : pus) hwloc_bitmap_set(set, static_cast<unsigned>(p));
  HomeNode h = node_of_cpuset(topo, set, "CPU binding");
  hwloc_bitmap_free(set);
  return h;
}

HomeNode choose_home_node(const Topology& topo, int cuda_index) {
  hwloc_cpuset_t set = hwloc_bitmap_alloc();
#ifdef EO_WITH_CUDA
  if (cuda_index >= 0 && hwloc_cudart_get_device_cpuset(topo.handle(), cuda_index, set) == 0 &&
      !hwloc_bitmap_isfull(set) && !hwloc_bitmap_iszero(set) &&
      !hwloc_bitmap_isequal(set, hwloc_topology_get_complete_cpuset(topo.handle()))) {
    HomeNode h = node_of_cpuset(topo, set, "GPU " + std::to_string(cuda_index) + " locality");
    hwloc_bitmap_free(set);
    return h;
  }
#endif
  const std::string why = cuda_index >= 0 ? "GPU " + std::to_string(cuda_index) +
                                                " reports no NUMA locality; using this rank's CPU binding"
                                          : "no GPU; using this rank's CPU binding";
  if (hwloc_get_cpubind(topo.handle(), set, HWLOC_CPUBIND_THREAD) != 0)
    hwloc_bitmap_copy(set, hwloc_topology_get_topology_cpuset(topo.handle()));
  HomeNode h = node_of_cpuset(topo, set, why);
  hwloc_bitmap_free(set);
  return h;
}

bool bind_threads_to_node(const Topology& topo, int node, std::string* why) {
  if (node < 0) return true;
  hwloc_obj_t obj = hwloc_get_numanode_obj_by_os_index(topo.handle(), static_cast<unsigned>(node));
  if (!obj) {
    if (why) *why = "NUMA node " + std::to_string(node) + " not found";
    return false;
  }
  if (hwloc_set_cpubind(topo.handle(), obj->cpuset, HWLOC_CPUBIND_PROCESS) != 0) {
    if (why) *why = std::string("hwloc_set_cpubind: ") + std::strerror(errno);
    return false;
  }
  return true;
}

namespace {
[[noreturn]] void fail_alloc(std::size_t bytes, const char* what, int err) {
  throw Error(std::string("cannot ") + what + " " + human_bytes(double(bytes)) + " of host memory for the expert homes (" +
              std::strerror(err) + "): " + describe_host_shortfall(static_cast<std::int64_t>(bytes)) +
              ". Run fewer ranks per node, use nodes with more RAM, or expert_offload_homes: per_numa_node.");
}
}  // namespace

HostBuffer::HostBuffer(std::size_t bytes, const HomeNode& node, bool pinned) : bytes_(bytes) {
  if (bytes == 0) return;
  Topology& topo = Topology::get();
  if (node.node >= 0) {
    hwloc_nodeset_t set = hwloc_bitmap_alloc();
    hwloc_bitmap_only(set, static_cast<unsigned>(node.node));
    data_ = static_cast<std::uint8_t*>(
        hwloc_alloc_membind(topo.handle(), bytes, set, HWLOC_MEMBIND_BIND, HWLOC_MEMBIND_BYNODESET));
    hwloc_bitmap_free(set);
    hwloc_allocated_ = data_ != nullptr;
  }
  if (!data_) {
    data_ = static_cast<std::uint8_t*>(hwloc_alloc(topo.handle(), bytes));
    hwloc_allocated_ = data_ != nullptr;
  }
  if (!data_) fail_alloc(bytes, "allocate", errno);
  // Touch every page now so placement happens here, on the bound node, not at first copy.
  std::memset(data_, 0, bytes);
  if (!pinned) return;
  try {
    pin(/*read_only=*/false);
  } catch (...) {
    hwloc_free(topo.handle(), data_, bytes);
    data_ = nullptr;
    throw;
  }
}

std::unique_ptr<HostBuffer> HostBuffer::create_shared(std::size_t bytes, const HomeNode& node) {
  std::unique_ptr<HostBuffer> b(new HostBuffer());
  b->bytes_ = bytes;
  b->mapped_ = true;
  b->fd_ = static_cast<int>(syscall(SYS_memfd_create, "eo-ddp-expert-homes", 0u));  // no MFD_CLOEXEC: /proc/<pid>/fd must stay openable
  if (b->fd_ < 0) fail_alloc(bytes, "create a shared memory file for", errno);
  if (ftruncate(b->fd_, static_cast<off_t>(bytes)) != 0) fail_alloc(bytes, "size a shared memory file of", errno);
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, b->fd_, 0);
  if (p == MAP_FAILED) fail_alloc(bytes, "map", errno);
  b->data_ = static_cast<std::uint8_t*>(p);
  // Bind before the first touch, so the pages are placed on the node.
  if (node.node >= 0) {
    hwloc_nodeset_t set = hwloc_bitmap_alloc();
    hwloc_bitmap_only(set, static_cast<unsigned>(node.node));
    hwloc_set_area_membind(Topology::get().handle(), p, bytes, set, HWLOC_MEMBIND_BIND, HWLOC_MEMBIND_BYNODESET);
    hwloc_bitmap_free(set);
  }
  struct stat st{};
  if (fstat(b->fd_, &st) == 0) b->file_id_ = {std::uint64_t(st.st_dev), std::uint64_t(st.st_ino)};
  return b;
}

std::unique_ptr<HostBuffer> HostBuffer::open_shared(const ShareHandle& h, std::size_t bytes, bool pinned) {
  std::unique_ptr<HostBuffer> b(new HostBuffer());
  b->bytes_ = bytes;
  b->mapped_ = true;
  b->writable_ = false;
  const std::string path = "/proc/" + std::to_string(h.pid) + "/fd/" + std::to_string(h.fd);
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    throw Error("expert_offload_homes: per_numa_node: cannot open the node leader's shared homes at " + path + " (" +
                std::strerror(errno) + "); every rank of a node must run as the same user with /proc readable. "
                "Use expert_offload_homes: per_rank instead.");
  struct stat st{};
  const bool sized = fstat(fd, &st) == 0 && st.st_size == static_cast<off_t>(bytes);
  if (sized) b->file_id_ = {std::uint64_t(st.st_dev), std::uint64_t(st.st_ino)};
  void* p = sized ? mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0) : MAP_FAILED;
  const int err = errno;
  close(fd);  // the mapping keeps the memory
  if (!sized)
    throw Error("expert_offload_homes: per_numa_node: the shared homes at " + path + " hold " + std::to_string(st.st_size) +
                " bytes, this rank expects " + std::to_string(bytes) + " (do all ranks load the same model?)");
  if (p == MAP_FAILED) fail_alloc(bytes, "map the shared", err);
  b->data_ = static_cast<std::uint8_t*>(p);
  if (pinned) {
    try {
      b->pin(/*read_only=*/true);
    } catch (const std::exception& e) {
      // Not every driver/device can page-lock a read-only mapping: train on, at pageable speed.
      log::warn(std::string(e.what()) + "; this rank's view of the node's shared homes stays pageable (much slower copies). "
                "If that matters, use expert_offload_homes: per_rank.");
    }
  }
  return b;
}

void HostBuffer::pin(bool read_only) {
  if (registered_ || !data_) return;
#ifdef EO_WITH_CUDA
  // A read-only mapping can only be registered read-only (cudaHostRegisterReadOnly, CUDA 11.1+).
  const unsigned flags = read_only ? cudaHostRegisterReadOnly : cudaHostRegisterDefault;
  const cudaError_t rc = cudaHostRegister(data_, bytes_, flags);
  if (rc != cudaSuccess) {
    cudaGetLastError();
    throw Error("cannot pin " + human_bytes(double(bytes_)) + " of host memory for the expert homes (cudaHostRegister" +
                std::string(read_only ? " read-only" : "") + ": " + cudaGetErrorString(rc) + "): " +
                describe_host_shortfall(static_cast<std::int64_t>(bytes_)) +
                "; raise the locked-memory limit (ulimit -l), run fewer ranks per node, or set expert_offload_pin_memory: false");
  }
  registered_ = true;
#else
  (void)read_only;
#endif
}

ShareHandle HostBuffer::share() const {
  EO_CHECK(fd_ >= 0, "HostBuffer::share: not a shared buffer this rank created (or sharing has stopped)");
  return {static_cast<std::int64_t>(getpid()), fd_};
}

void HostBuffer::stop_sharing() {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
}

HostBuffer::~HostBuffer() {
  stop_sharing();
  if (!data_) return;
#ifdef EO_WITH_CUDA
  if (registered_) cudaHostUnregister(data_);
#endif
  if (mapped_) munmap(data_, bytes_);
  else if (hwloc_allocated_) hwloc_free(Topology::get().handle(), data_, bytes_);
}

std::vector<int> HostBuffer::resident_nodes() const {
  if (!data_) return {};
  hwloc_nodeset_t set = hwloc_bitmap_alloc();
  std::vector<int> out;
  if (hwloc_get_area_memlocation(Topology::get().handle(), data_, bytes_, set, HWLOC_MEMBIND_BYNODESET) == 0)
    out = nodeset_to_list(set);
  hwloc_bitmap_free(set);
  return out;
}

}  // namespace eo::offload
