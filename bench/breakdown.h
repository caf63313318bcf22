// eo-bench --breakdown: where one training step's GPU time goes, from the kernels themselves.
//
// PyTorch's own profiler (Kineto + CUPTI, as `torch.profiler` uses it) records every kernel and
// copy of one step with its device start and duration. Kernels are grouped into phases by name —
// expert grouped GEMMs, other GEMMs (projections, LoRA, LM head), attention, NF4 dequantisation,
// norms / activations / routing / other elementwise work, host<->device copies, NCCL — and the step's
// wall time is set against the time the compute stream(s) were busy: the rest is the GPU waiting
// for the host (launch overhead, host synchronisations, host-side work).
#pragma once

#include <map>
#include <string>
#include <vector>

namespace eo::bench {

struct PhaseTime {
  std::string name;
  double seconds = 0;
  long long kernels = 0;
};

struct StepBreakdown {
  double wall_s = 0;          // from profiler start to stop (one step)
  double compute_busy_s = 0;  // union of kernel intervals (not copies)
  double copy_busy_s = 0;     // union of copy intervals
  std::vector<PhaseTime> phases;  // by total kernel time, largest first
  std::vector<PhaseTime> top_kernels;  // the 12 largest kernels by total time (names shortened)
};

class StepProfiler {
 public:
  void start();             // begins recording CPU + CUDA activity
  StepBreakdown stop();     // synchronises the device, ends recording, summarises
};

// Markdown table of a breakdown. `flops[phase]`: the useful FLOPs of a phase in the step (adds its
// achieved TFLOP/s); `flops[""]`: of the whole step.
std::string describe(const StepBreakdown& b, const std::string& title, const std::map<std::string, double>& flops);

}  // namespace eo::bench
