#include "offload/homes.h"

#include <hwloc.h>
#include <sys/mman.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "common/error.h"
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
  if (!data_) {
    const int err = errno;
    throw Error("cannot allocate " + human_bytes(double(bytes)) + " of host memory for an expert home (" + std::strerror(err) +
                "): " + describe_host_shortfall(static_cast<std::int64_t>(bytes)) +
                ". Run fewer ranks per node or use nodes with more RAM.");
  }
  // Touch every page now so placement happens here, on the bound node, not at first copy.
  std::memset(data_, 0, bytes);
#ifdef EO_WITH_CUDA
  if (pinned) {
    const cudaError_t rc = cudaHostRegister(data_, bytes, cudaHostRegisterDefault);
    if (rc != cudaSuccess) {
      cudaGetLastError();
      hwloc_free(topo.handle(), data_, bytes);
      data_ = nullptr;
      throw Error("cannot pin " + human_bytes(double(bytes)) + " of host memory for an expert home (cudaHostRegister: " +
                  cudaGetErrorString(rc) + "): " + describe_host_shortfall(static_cast<std::int64_t>(bytes)) +
                  "; raise the locked-memory limit (ulimit -l), run fewer ranks per node, or set expert_offload_pin_memory: false");
    }
    registered_ = true;
  }
#else
  (void)pinned;
#endif
}

HostBuffer::~HostBuffer() {
  if (!data_) return;
#ifdef EO_WITH_CUDA
  if (registered_) cudaHostUnregister(data_);
#endif
  if (hwloc_allocated_) hwloc_free(Topology::get().handle(), data_, bytes_);
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
