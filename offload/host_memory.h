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

// Throws eo::Error when `copies` copies of `home_bytes` of homes need more than `mem.available`;
// the message gives both numbers and what to do (with one copy per rank and several ranks: one
// copy per NUMA node, expert_offload_homes: per_numa_node). No-op when available is unknown.
void check_homes_fit(std::int64_t home_bytes, int copies, const HostMemory& mem, bool copy_per_rank = true);

// "N bytes needed, M available (source)" for allocation failures of homes.
std::string describe_host_shortfall(std::int64_t bytes_needed);

}  // namespace eo::offload
