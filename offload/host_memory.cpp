#include "offload/host_memory.h"

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "common/error.h"
#include "common/fault_seam.h"
#include "offload/layout.h"
#include "common/text.h"
#include "models/hf_config.h"

namespace eo::offload {
namespace {

namespace fs = std::filesystem;


// A number from a one-value file ("max" and absent files: nothing).
bool read_number(const fs::path& p, std::int64_t* out) {
  std::ifstream in(p);
  std::string s;
  if (!(in >> s) || s == "max") return false;
  try {
    *out = std::stoll(s);
    return true;
  } catch (...) {
    return false;
  }
}

// "key value" lines (memory.stat, /proc/meminfo); -1 when the key is missing.
std::int64_t read_key(const fs::path& p, const std::string& key) {
  std::ifstream in(p);
  std::string k;
  std::int64_t v;
  for (std::string line; std::getline(in, line);) {
    std::istringstream ls(line);
    if (ls >> k >> v && (k == key || k == key + ":")) return v;
  }
  return -1;
}

struct Limit {
  std::int64_t left = -1;
  std::string where;
};

// cgroup v2: the tightest limit − (current − inactive_file) from this process' group up to the root.
Limit cgroup_v2() {
  Limit best;
  std::ifstream in("/proc/self/cgroup");
  std::string rel;
  for (std::string line; std::getline(in, line);)
    if (line.rfind("0::", 0) == 0) rel = line.substr(3);
  if (rel.empty()) return best;
  for (fs::path dir = fs::path("/sys/fs/cgroup") / fs::path(rel).relative_path();; dir = dir.parent_path()) {
    std::int64_t limit = 0, current = 0;
    if (read_number(dir / "memory.max", &limit) && read_number(dir / "memory.current", &current)) {
      const std::int64_t reclaimable = std::max<std::int64_t>(0, read_key(dir / "memory.stat", "inactive_file"));
      const std::int64_t left = std::max<std::int64_t>(0, limit - std::max<std::int64_t>(0, current - reclaimable));
      if (best.left < 0 || left < best.left)
        best = {left, "cgroup v2 " + (dir / "memory.max").string() + " = " + human_bytes(double(limit)) + ", " +
                          human_bytes(double(current)) + " in use"};
    }
    if (dir == "/sys/fs/cgroup" || dir == dir.parent_path() || dir.string().size() <= std::string("/sys/fs/cgroup").size()) break;
  }
  return best;
}

// cgroup v1: memory.limit_in_bytes (a huge value means none) − (usage − total_inactive_file).
Limit cgroup_v1() {
  const fs::path dir = "/sys/fs/cgroup/memory";
  std::int64_t limit = 0, usage = 0;
  if (!read_number(dir / "memory.limit_in_bytes", &limit) || !read_number(dir / "memory.usage_in_bytes", &usage)) return {};
  if (limit >= (std::int64_t(1) << 60)) return {};
  const std::int64_t reclaimable = std::max<std::int64_t>(0, read_key(dir / "memory.stat", "total_inactive_file"));
  return {std::max<std::int64_t>(0, limit - std::max<std::int64_t>(0, usage - reclaimable)),
          "cgroup v1 memory.limit_in_bytes = " + human_bytes(double(limit)) + ", " + human_bytes(double(usage)) + " in use"};
}

}  // namespace

HostMemory host_memory_available() {
  HostMemory m;
  if (faults::plan().host_mem_available >= 0) {  // test seam
    m.available = faults::plan().host_mem_available;
    m.source = "the fault-injection plan (test override)";
    return m;
  }
  const std::int64_t kib = read_key("/proc/meminfo", "MemAvailable");
  if (kib >= 0) {
    m.available = kib * 1024;
    m.source = "MemAvailable in /proc/meminfo";
  }
  for (const Limit& l : {cgroup_v2(), cgroup_v1()})
    if (l.left >= 0 && (m.available < 0 || l.left < m.available)) {
      m.available = l.left;
      m.source = l.where;
    }
  return m;
}

std::int64_t estimate_home_bytes(const model::ModelConfig& c, int blocksize, bool double_quant, QuantFormat format) {
  return c.moe_layer_count() * expert_block_bytes(c, blocksize, double_quant, format);
}

std::string describe_host_shortfall(std::int64_t bytes_needed) {
  const HostMemory m = host_memory_available();
  std::string s = std::to_string(bytes_needed) + " bytes (" + human_bytes(double(bytes_needed)) + ") needed, ";
  if (m.available < 0) return s + "host memory available unknown";
  return s + std::to_string(m.available) + " bytes (" + human_bytes(double(m.available)) + ") available now (" + m.source + ")";
}

void check_homes_fit(std::int64_t bytes, int copies, const HostMemory& mem, HomesKind kind, std::int64_t disk_ring_bytes) {
  if (mem.available < 0 || bytes <= 0) return;
  const std::int64_t needed = bytes * std::max(1, copies);
  if (needed <= mem.available) return;
  const std::string disk = disk_ring_bytes > 0
                               ? "set expert_offload_homes: disk (the homes in one file per host on a local drive, " +
                                     human_bytes(double(disk_ring_bytes)) + " of read buffers per rank in RAM, the blocks "
                                     "read from the drive every step) with expert_offload_disk_path, "
                               : std::string();
  std::string what, fix;
  switch (kind) {
    case HomesKind::PerRank:
      what = std::to_string(copies) + " rank(s) on this node x " + human_bytes(double(bytes)) + " of NF4 experts each";
      fix = std::string("Every rank keeps its own copy of the experts in host RAM: ") +
            (copies > 1 ? "set expert_offload_homes: per_numa_node (one copy per NUMA node, shared by its ranks), " : "") + disk +
            "run fewer ranks per node, use nodes with more RAM (or raise the job's memory limit), or free host memory";
      break;
    case HomesKind::PerNumaNode:
      what = std::to_string(copies) + " NUMA node copy(ies) x " + human_bytes(double(bytes)) + " of NF4 experts each";
      fix = "One copy per NUMA node is the least the homes take in RAM: " + disk +
            "use nodes with more RAM (or raise the job's memory limit), or free host memory";
      break;
    case HomesKind::Disk:
      what = std::to_string(copies) + " rank(s) on this node x " + human_bytes(double(bytes)) + " of disk homes read buffers each";
      fix = "Each rank's read ring holds one block per device slot and one more: lower expert_offload_prefetch_depth, run "
            "fewer ranks per node, or free host memory";
      break;
  }
  EO_FAIL("not enough host RAM for the expert homes: ", what, " = ", needed, " bytes (", human_bytes(double(needed)),
          ") needed, but only ", mem.available, " bytes (", human_bytes(double(mem.available)), ") are available (", mem.source,
          "). ", fix, "; expert_offload: false keeps the experts on the GPU instead.");
}

}  // namespace eo::offload
