// What to change when a run does not fit: each change the user can make to the config, re-planned
// by the real planner (fit_plan, auto's own alternatives included) on a changed copy of the
// config, listed cheapest first with the peak it would give; when no single change fits, the
// changes taken together in the same order until the run fits.
//
// The order is what each change costs the user: expert_offload (experts streamed from host RAM:
// the step waits on copies), gradient checkpointing (one recompute per block), activation
// offloading (block inputs parked in host RAM), the micro-batch-major step order (with offload the
// experts are copied once per micro-batch), the expert homes on a drive (when host RAM cannot pin
// them), then the changes to what is trained: micro_batch_size, sequence_len, lora_r, and LoRA on
// the attention linears only.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "runtime/runspec.h"

namespace eo {

struct PlanFix {
  std::vector<std::pair<std::string, std::string>> sets;  // (dotted key, YAML value), as --set takes them
  std::string what;      // what it changes for the user, briefly
  double peak = 0;       // the predicted allocator peak with the change
  double margin = 0;     // the start-up check's headroom with it
  double host_pinned_per_node = 0;  // pinned host RAM per node with it (0: none)
  bool fits = false;
};

struct FixPlan {
  std::vector<PlanFix> singles;  // the single changes that fit, cheapest first
  PlanFix combined;              // when none does: the changes together (fits says whether that is enough)
  bool need_combination() const { return singles.empty() && !combined.sets.empty(); }
};

// `available`: the device bytes the run may use (the card, or device_memory_limit); `host_ram`:
// pinned host bytes per node a change may take (0: not checked), else the expert homes are put on
// a drive (expert_offload_disk_path must then be chosen by the user).
FixPlan plan_fixes(const RunSpec& spec, double available, double host_ram = 0);

// The list for a person: each change as `--set key=value ...` and as YAML lines, with its peak.
// `limit` names what was fitted ("a 24.00 GiB card", "device_memory_limit 8.00 GiB").
std::string describe_fixes(const FixPlan& fixes, const std::string& limit);

}  // namespace eo
