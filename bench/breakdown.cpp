#include "bench/breakdown.h"

#include <ATen/Context.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <sstream>
#include <utility>

#include "runtime/device.h"

namespace eo::bench {
namespace {

namespace prof = torch::autograd::profiler;
namespace impl = torch::profiler::impl;

bool has(const std::string& s, const char* sub) { return s.find(sub) != std::string::npos; }

bool is_copy(const std::string& n) { return has(n, "Memcpy") || has(n, "Memset"); }

// The phase of a kernel, from its (demangled) name.
std::string phase_of(const std::string& n) {
  if (is_copy(n)) return has(n, "HtoD") ? "copy host->device" : has(n, "DtoH") ? "copy device->host" : "copy / memset on device";
  if (has(n, "nccl")) return "NCCL";
  if (has(n, "dequantize_vec8") || has(n, "dequantize_window_vec8") || has(n, "dequantize_bytes") || has(n, "quantize_blocks"))
    return "NF4 (de)quantisation";
  if (has(n, "flash") || has(n, "fmha") || has(n, "attention") || has(n, "Attention")) return "attention (SDPA)";
  const bool gemm = has(n, "gemm") || has(n, "Gemm") || has(n, "GEMM") || has(n, "nvjet") || has(n, "xmma") ||
                    has(n, "cutlass") || has(n, "sm90_") || has(n, "cublas");
  if (gemm && (has(n, "rouped") || has(n, "ptr_array") || has(n, "Group") || has(n, "grouped"))) return "grouped GEMM (experts)";
  if (gemm) return "GEMM (projections, LoRA, head, combine)";
  if (has(n, "rms") || has(n, "RMS") || has(n, "norm")) return "norms";
  if (has(n, "softmax") || has(n, "topk") || has(n, "sort") || has(n, "Sort") || has(n, "cumsum") || has(n, "scan") ||
      has(n, "scatter") || has(n, "gather") || has(n, "index"))
    return "routing / permutation / loss gathers";
  if (has(n, "reduce") || has(n, "Reduce")) return "reductions";
  return "elementwise / other";
}

double union_seconds(std::vector<std::pair<std::uint64_t, std::uint64_t>> v) {
  std::sort(v.begin(), v.end());
  double total = 0;
  std::uint64_t cur_s = 0, cur_e = 0;
  bool open = false;
  for (const auto& [s, e] : v) {
    if (!open || s > cur_e) {
      if (open) total += double(cur_e - cur_s);
      cur_s = s;
      cur_e = e;
      open = true;
    } else {
      cur_e = std::max(cur_e, e);
    }
  }
  if (open) total += double(cur_e - cur_s);
  return total / 1e9;
}

// A kernel's name without the noise that hides what it is: "void ", namespaces that every ATen
// kernel shares, "(anonymous namespace)", and the argument list.
std::string shorten(std::string n) {
  for (const char* noise : {"(anonymous namespace)::", "void ", "at::native::", "at_cuda_detail::", "c10::"}) {
    const std::string w(noise);
    for (auto p = n.find(w); p != std::string::npos; p = n.find(w)) n.erase(p, w.size());
  }
  if (const auto p = n.find('('); p != std::string::npos && p > 0) n = n.substr(0, p);
  if (n.size() > 130) n = n.substr(0, 127) + "...";
  for (auto& c : n)
    if (c == '|') c = '/';
  return n;
}

std::chrono::steady_clock::time_point g_start;

}  // namespace

void StepProfiler::start() {
  std::set<impl::ActivityType> activities{impl::ActivityType::CPU};
  if (at::hasCUDA()) activities.insert(impl::ActivityType::CUDA);
  const impl::ProfilerConfig config(impl::ProfilerState::KINETO);
  prof::prepareProfiler(config, activities);
  prof::enableProfiler(config, activities);
  g_start = std::chrono::steady_clock::now();
}

StepBreakdown StepProfiler::stop() {
  if (at::hasCUDA()) synchronize(at::Device(at::kCUDA, 0));
  StepBreakdown out;
  out.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - g_start).count();
  const auto result = prof::disableProfiler();
  std::map<std::string, PhaseTime> phases, kernels;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> compute, copies;
  for (const auto& e : result->events()) {
    if (e.deviceType() != c10::DeviceType::CUDA) continue;
    const std::string name = e.name();
    const std::uint64_t s = e.startNs(), d = e.durationNs();
    (is_copy(name) ? copies : compute).emplace_back(s, s + d);
    PhaseTime& p = phases[phase_of(name)];
    p.name = phase_of(name);
    p.seconds += double(d) / 1e9;
    ++p.kernels;
    PhaseTime& k = kernels[shorten(name)];
    k.name = shorten(name);
    k.seconds += double(d) / 1e9;
    ++k.kernels;
  }
  out.compute_busy_s = union_seconds(compute);
  out.copy_busy_s = union_seconds(copies);
  for (auto& [n, p] : phases) out.phases.push_back(p);
  for (auto& [n, k] : kernels) out.top_kernels.push_back(k);
  auto by_time = [](const PhaseTime& a, const PhaseTime& b) { return a.seconds > b.seconds; };
  std::sort(out.phases.begin(), out.phases.end(), by_time);
  std::sort(out.top_kernels.begin(), out.top_kernels.end(), by_time);
  if (out.top_kernels.size() > 40) out.top_kernels.resize(40);
  return out;
}

std::string describe(const StepBreakdown& b, const std::string& title, const std::map<std::string, double>& flops) {
  auto flops_of = [&](const std::string& k) { const auto it = flops.find(k); return it == flops.end() ? 0.0 : it->second; };
  const double useful_flops = flops_of("");
  std::ostringstream o;
  char line[512];
  o << "\n### breakdown: " << title << "\n\n";
  std::snprintf(line, sizeof line,
                "step wall %.3f s; compute stream(s) busy %.3f s (%.0f%%), so the GPU waited %.3f s for the host; "
                "copies busy %.3f s%s\n\n",
                b.wall_s, b.compute_busy_s, 100 * b.compute_busy_s / std::max(1e-9, b.wall_s), b.wall_s - b.compute_busy_s,
                b.copy_busy_s, "");
  o << line;
  if (useful_flops > 0) {
    std::snprintf(line, sizeof line, "useful work %.1f TFLOP per step: %.0f TFLOP/s over the wall time, %.0f over busy time\n\n",
                  useful_flops / 1e12, useful_flops / b.wall_s / 1e12, useful_flops / std::max(1e-9, b.compute_busy_s) / 1e12);
    o << line;
  }
  o << "| phase | GPU s | % of wall | kernels | achieved |\n|---|---|---|---|---|\n";
  for (const auto& p : b.phases) {
    char rate[64] = "";
    if (flops_of(p.name) > 0 && p.seconds > 0) std::snprintf(rate, sizeof rate, "%.0f TFLOP/s", flops_of(p.name) / p.seconds / 1e12);
    std::snprintf(line, sizeof line, "| %s | %.4f | %.1f%% | %lld | %s |\n", p.name.c_str(), p.seconds, 100 * p.seconds / b.wall_s,
                  p.kernels, rate);
    o << line;
  }
  o << "\n| largest kernels | GPU s | calls |\n|---|---|---|\n";
  for (const auto& k : b.top_kernels) {
    std::snprintf(line, sizeof line, "| `%s` | %.4f | %lld |\n", k.name.c_str(), k.seconds, k.kernels);
    o << line;
  }
  return o.str();
}

}  // namespace eo::bench
