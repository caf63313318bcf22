// How much host RAM the expert homes need, how much the machine (and its cgroup) can give, and
// the check that fails early — before any weight is read — when the homes of every rank on a
// node would not fit. Without it an oversized run dies minutes later in the middle of loading,
// killed by the OOM killer with no message, or with a bare allocation error.
#pragma once

#include <cstdint>
#include <string>

#include "models/quant_format.h"

namespace eo::model {
struct ModelConfig;
}

namespace eo::offload {

struct HostMemory {
  std::int64_t available = -1;  // bytes this process can still get; -1 = unknown (no check possible)
  std::string source;           // where the number comes from, for messages
};

// min(MemAvailable of /proc/meminfo, what the cgroup's memory limit leaves: limit − (usage −
// reclaimable page cache)) for cgroup v2 (every level up to the root) and v1.
// The failure tests replace the measurement through the fault seam (common/fault_seam.h).
HostMemory host_memory_available();

// Bytes of one rank's homes for `c` quantised to NF4 with `blocksize` / `double_quant` (or held
// in the checkpoint's MXFP4): the arena layout the ExpertOffloader uses (offload/layout.h). Exact
// for checkpoints quantised at load time and for MXFP4; a bitsandbytes checkpoint keeps its
// stored layout, which may differ slightly.
std::int64_t estimate_home_bytes(const model::ModelConfig& c, int blocksize, bool double_quant,
                                 QuantFormat format = QuantFormat::Nf4);

// expert_offload_homes: what one copy of `bytes` in the check below is, and how many there are.
enum class HomesKind {
  PerRank,      // every rank its homes: copies = ranks on the node
  PerNumaNode,  // one copy per NUMA node: copies = NUMA nodes used on the host
  Disk,         // the homes on a drive; in RAM each rank's read ring: copies = ranks on the node
};

// Throws eo::Error when `copies` copies of `bytes` need more host RAM than `mem.available`; the
// message gives both numbers and what to do: one copy per NUMA node (per_numa_node, when every
// rank keeps its own), the homes on a local drive (disk: `disk_ring_bytes` per rank, suggested
// when > 0), fewer ranks per node, more RAM. No-op when available is unknown.
void check_homes_fit(std::int64_t bytes, int copies, const HostMemory& mem, HomesKind kind = HomesKind::PerRank,
                     std::int64_t disk_ring_bytes = 0);

// "N bytes needed, M available (source)" for allocation failures of homes.
std::string describe_host_shortfall(std::int64_t bytes_needed);

}  // namespace eo::offload
