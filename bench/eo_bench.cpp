// eo-bench: eo-ddp's trainer on real model shapes (synthetic NF4 weights, synthetic tokens), four
// expert modes side by side in one process, and the pinned host-to-device bandwidth measured in
// the same run so every offload row can be set against its transfer floor.
//
//   eo-bench --model configs/models/qwen3-30b-a3b --points 2048x1,2048x4 [--accum G] [--steps 6]
//            [--warmup 2] [--modes resident,sync,prefetch,budget] [--budget-fraction 0.5]
//            [--targets attn|all|experts] [--json FILE]
//   modes: resident | sync (one slot) | prefetch (default depth) | prefetchN (N blocks ahead) |
//          budget (prefetch + budget-fraction of the experts resident); a suffix ":park" adds
//          activation_offloading, ":mm" the micro-batch-major step order, ":shared" the homes in
//          one shared memory file (expert_offload_homes: per_numa_node), ":disk" the homes on a
//          drive (expert_offload_homes: disk, the file in --disk-dir, default WORKDIR/disk-homes;
//          the row is followed by the drive's raw O_DIRECT sequential read rate of that file beside
//          the rate the read ring reached in training), ":whole" / ":sliced" the expert bank
//          dequantised whole / in 64 MiB slices, ":eager" / ":graphs" without / with CUDA graphs (cuda_graphs:
//          false / true), ":redequant" / ":keepdown" the backward dequantising every bank again /
//          all but the down projection's (expert_bank_reuse: none / down), ":smallk" the expert
//          LoRA's rank-wide GEMMs on eo's small-K kernel (off by default, models/grouped_mm.h),
//          ":packed" rows of four documents each (sample_packing: flash varlen where it runs),
//          ":dr-aten" the gated delta rule without its CUDA kernels (models/delta_rule.h);
//          they combine (":park:mm", "prefetch:disk")
//   --accum G: gradient_accumulation_steps (tokens per step = seq x mb x G)
//   --workdir DIR: tokens, outputs and (by default) the disk homes; default /dev/shm/eo-bench, a
//                  tmpfs: pass a directory on the drive to measure :disk
//   --targets all: LoRA on every linear, experts included (axolotl's lora_target_linear recipe);
//   attn (default): the attention linears, as the architecture names them; experts: those and the
//   fused experts (lora_target_parameters: gate_up_proj, down_proj)
//   --h2d-gbps R: take R GB/s as the pinned host-to-device rate of the floors instead of measuring it
//   --card NAME: run as a card of runtime/cards.cpp's table (a2000, 3090, 4090, 5090, ...; simulated
//                on this GPU, and every row says so): its memory as device_memory_limit, its pinned
//                host-to-device rate as the expert copies' pace (expert_offload_copy_pace_gbps; the
//                floors use it too) and the portable expert GEMM (it has no device-scheduled
//                at::_grouped_mm); a row also says whether the memory plan said it fits and whether it ran
//   a mode suffix ":portable" / ":torch" picks the expert GEMM kernel (expert_gemm; default auto)
//   --breakdown: profile the first timed step of every mode (PyTorch's Kineto profiler) and print
//                its GPU time by phase (bench/breakdown.h)
//
// Each (point, mode) is a real eo::train() run (the CLI's code path) whose metrics.jsonl is read
// back. A row's s/step is the steady rate over the timed window, one interval on the device's
// clock: (end of the last timed step - end of the last warm-up step) / timed steps; the per-step
// device times' min / median / max stand beside it. Warm-up (at least 2 steps: the CUDA graphs
// are captured at a block's second use) is not timed. Also: allocator peak VRAM, staged bytes,
// H2D rate and stall; the memory plan's prediction beside the measured peak. A row faster than
// its own transfer floor (the staged bytes at the pinned rate measured in this run) is refused:
// such a number comes from a wrong timer or a wrong floor, not from the hardware.
#include <ATen/Context.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench/args.h"
#include "common/error.h"
#include "common/files.h"
#include "common/log.h"
#include "common/text.h"
#include "models/delta_rule.h"
#include "models/grouped_mm.h"
#include "models/hf_config.h"
#include "runtime/cards.h"
#include "runtime/config.h"
#include "runtime/device.h"
#include "runtime/ddp/world.h"
#include "runtime/plan.h"
#include "runtime/step_time.h"
#include "runtime/trainer.h"
#include "offload/disk_homes.h"
#include "bench/breakdown.h"

#include <sys/vfs.h>

#ifdef EO_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace fs = std::filesystem;
using namespace eo;

namespace {

using bench::arg;
using bench::split;

struct Point {
  int seq = 2048, mb = 1;
};

struct Row {
  std::string model, mode;
  Point point;
  double s_per_step = 0, step_min = 0, step_median = 0, step_max = 0, tokens_per_s = 0, peak_vram = 0, plan_vram = 0, pinned = 0, reserved_vram = 0;
  double staged_per_step = 0, h2d_gbps = 0, stall_s = 0, floor_s = 0;
  std::string plan_fit, ran;  // with --card: whether the memory plan said it fits, and what the run did
  double disk_read_per_step = 0, disk_gbps = 0, disk_raw_gbps = 0, disk_wait_s = 0;  // :disk
  std::string error;
};

// Below the floor by more than the device timer's resolution (CUDA events: about 0.5 us).
bool below_floor(double seconds, double floor_s) { return floor_s > 0 && seconds < floor_s - 1e-6; }

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// Pinned host → device bandwidth, measured like the staging copies (1 GiB, best of 5).
double pinned_h2d_gbps() {
#ifdef EO_WITH_CUDA
  if (!at::hasCUDA()) return 0;
  const std::size_t bytes = std::size_t(1) << 30;
  void *host = nullptr, *dev = nullptr;
  if (cudaHostAlloc(&host, bytes, cudaHostAllocDefault) != cudaSuccess) return 0;
  if (cudaMalloc(&dev, bytes) != cudaSuccess) {
    cudaFreeHost(host);
    return 0;
  }
  std::memset(host, 1, bytes);
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  float best = 1e30f;
  for (int i = 0; i < 5; ++i) {
    cudaEventRecord(a);
    cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice);
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    best = std::min(best, ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  cudaFree(dev);
  cudaFreeHost(host);
  return double(bytes) / (best / 1e3) / 1e9;
#else
  return 0;
#endif
}

// Random token ids (uint32) for `tokens` sequences: one long document, so rows are unmasked causal;
// or (doc_len > 0) documents of doc_len tokens, each ended by kPackedEos (never drawn otherwise), for
// `sample_packing` rows of several documents.
constexpr std::uint32_t kPackedEos = 0;
std::string write_tokens(const std::string& dir, std::int64_t vocab, std::int64_t tokens, std::uint64_t seed,
                         std::int64_t doc_len = 0) {
  const std::string path = dir + (doc_len > 0 ? "/packed-tokens.u32" : "/tokens.u32");
  std::vector<std::uint32_t> ids(static_cast<std::size_t>(tokens));
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<std::uint32_t> pick(1, static_cast<std::uint32_t>(vocab - 1));
  for (std::size_t i = 0; i < ids.size(); ++i)
    ids[i] = doc_len > 0 && (std::int64_t(i) + 1) % doc_len == 0 ? kPackedEos : pick(rng);
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(ids.data()), ids.size() * 4);
  return path;
}

// Useful FLOPs of one step, for the breakdown's achieved rates: the step-time prediction's counts
// (runtime/step_time.h: frozen weights forward, recompute and input gradient, LoRA, attention, the
// head), the expert GEMMs and in all.
std::map<std::string, double> useful_flops(const StepWork& w) {
  return {{"grouped GEMM (experts)", w.expert_gemm_flops},
          {"", w.expert_gemm_flops + w.other_gemm_flops + w.attention_flops + w.head_flops}};
}

}  // namespace

int main(int argc, char** argv) {
  ddp::World& world = ddp::World::init(&argc, &argv);
  const std::string model_dir = arg(argc, argv, "--model", "");
  if (model_dir.empty()) {
    std::fprintf(stderr, "usage: eo-bench --model DIR [--points 2048x1,2048x4] [--steps N] [--warmup N] [--modes ...]\n");
    return kExitUsage;
  }
  const int steps = std::stoi(arg(argc, argv, "--steps", "6"));
  const int warmup = std::stoi(arg(argc, argv, "--warmup", "2"));
  if (warmup < 2 || steps < 1) {
    std::fprintf(stderr, "eo-bench: --warmup must be at least 2 (CUDA graphs are captured in step 2) and --steps at least 1\n");
    return kExitUsage;
  }
  const double budget_fraction = std::stod(arg(argc, argv, "--budget-fraction", "0.5"));
  const auto modes = split(arg(argc, argv, "--modes", "resident,sync,prefetch,budget"), ',');
  const std::string json_out = arg(argc, argv, "--json", "");
  const int accum = std::stoi(arg(argc, argv, "--accum", "1"));
  const bool breakdown = bench::flag(argc, argv, "--breakdown");
  const std::string work = arg(argc, argv, "--workdir", fs::exists("/dev/shm") ? "/dev/shm/eo-bench" : "/tmp/eo-bench");
  const std::string disk_dir = arg(argc, argv, "--disk-dir", work + "/disk-homes");
  std::vector<Point> points;
  for (const auto& p : split(arg(argc, argv, "--points", "2048x1"), ',')) {
    const auto xy = split(p, 'x');
    if (xy.size() != 2) throw UsageError("--points: expected SEQxMB, e.g. 2048x4, got '" + p + "'");
    points.push_back({std::stoi(xy[0]), std::stoi(xy[1])});
  }
  const model::ModelConfig mc = model::load_config(model_dir);
  // The architecture's names (DeepSeek's latent attention has no k_proj / v_proj).
  std::string targets;
  const std::string target_set = arg(argc, argv, "--targets", "attn");
  for (const auto& t : target_set == "all" ? mc.linear_modules() : mc.attention_linears())
    targets += (targets.empty() ? "[" : ", ") + t;
  targets += "]";
  // --targets experts: the attention linears and the fused experts as peft's ParamWrapper adapts them.
  const std::string expert_params = target_set == "experts" ? "lora_target_parameters: [" + mc.moe_prefix() +
                                                                  ".experts.gate_up_proj, " + mc.moe_prefix() +
                                                                  ".experts.down_proj]\n"
                                                            : "";
  const std::string name = fs::path(model_dir).filename().string();
  fs::create_directories(work);

  const std::string card_name = arg(argc, argv, "--card", "");
  // The card table (runtime/cards.h) that `eo-ddp plan --card` reads.
  std::optional<CardFigures> card;
  if (!card_name.empty()) {
    try {
      card = find_card(card_name, "eo-bench: --card");
    } catch (const UsageError& e) {
      std::fprintf(stderr, "%s\n", e.what());
      return kExitUsage;
    }
  }
  std::string simulated_on;
  if (card) {
    const GpuCard here = gpu_card(at::hasCUDA() ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU));
    simulated_on = "simulated on " + (here.name.empty() ? std::string("the CPU") : here.name);
    std::printf("# --card %s, %s: device_memory_limit %s, expert copies paced to %g GB/s, expert_gemm portable\n",
                card->name.c_str(), simulated_on.c_str(), card_memory(*card).c_str(), card->link_gbps);
  }
  const std::string given_bw = arg(argc, argv, "--h2d-gbps", "");
  const double bw = card ? card->link_gbps : given_bw.empty() ? pinned_h2d_gbps() : std::stod(given_bw);
  if (card)
    std::printf("# %s: floors at the card's %g GB/s\n", name.c_str(), bw);
  else if (given_bw.empty())
    std::printf("# %s: pinned host->device %.1f GB/s (1 GiB copies, best of 5)\n", name.c_str(), bw);
  else
    std::printf("# %s: pinned host->device taken as %g GB/s (--h2d-gbps), not measured\n", name.c_str(), bw);
  std::vector<Row> rows;
  for (const Point& pt : points) {
    const std::int64_t need = std::int64_t(pt.seq) * pt.mb * accum * (steps + warmup + 2) + pt.seq;
    const std::string tokens = write_tokens(work, mc.vocab, need, 1234);
    // :packed rows hold documents of a quarter of the sequence: flash's variable-length form, else the mask.
    const std::string packed_tokens = write_tokens(work, mc.vocab, need, 1234, std::max(1, pt.seq / 4));
    for (const std::string& spec : modes) {
      const auto parts = split(spec, ':');
      const std::string mode = parts.empty() ? spec : parts[0];
      const bool park = std::find(parts.begin(), parts.end(), "park") != parts.end();
      const bool micro_major = std::find(parts.begin(), parts.end(), "mm") != parts.end();
      const bool shared = std::find(parts.begin(), parts.end(), "shared") != parts.end();
      const bool whole = std::find(parts.begin(), parts.end(), "whole") != parts.end();
      const bool sliced = std::find(parts.begin(), parts.end(), "sliced") != parts.end();
      const bool eager = std::find(parts.begin(), parts.end(), "eager") != parts.end();
      const bool graphs = std::find(parts.begin(), parts.end(), "graphs") != parts.end();
      const bool disk = std::find(parts.begin(), parts.end(), "disk") != parts.end();
      // :redequant / :keepdown: expert_bank_reuse none / down (the default auto keeps all when it fits).
      const bool redequant = std::find(parts.begin(), parts.end(), "redequant") != parts.end();
      const bool keepdown = std::find(parts.begin(), parts.end(), "keepdown") != parts.end();
      // :smallk: the expert LoRA's rank-wide GEMMs on eo's small-K kernel (models/grouped_mm.h).
      const bool smallk = std::find(parts.begin(), parts.end(), "smallk") != parts.end();
      // :dr-aten: the gated delta rule as batched ATen ops, without its kernels (models/delta_rule.h).
      const bool delta_aten = std::find(parts.begin(), parts.end(), "dr-aten") != parts.end();
      const bool portable = card || std::find(parts.begin(), parts.end(), "portable") != parts.end();
      const bool torch_gemm = std::find(parts.begin(), parts.end(), "torch") != parts.end();
      const bool packed = std::find(parts.begin(), parts.end(), "packed") != parts.end();
      Row row;
      row.model = name;
      row.mode = spec;
      row.point = pt;
      std::ostringstream yaml;
      yaml << "base_model: " << model_dir << "\nsynthetic_weights: true\nload_in_4bit: true\nadapter: qlora\n"
           << "lora_r: 16\nlora_alpha: 32\nlora_dropout: 0.0\nlora_target_modules: " << targets << "\n" << expert_params
           << "gradient_accumulation_steps: " << accum << "\n"
           << (park ? "activation_offloading: true\n" : "") << (micro_major ? "step_order: micro_batch_major\n" : "")
           << (shared ? "expert_offload_homes: per_numa_node\n" : "")
           << (disk ? "expert_offload_homes: disk\nexpert_offload_disk_path: " + disk_dir + "\n" : std::string())
           << (whole ? "expert_dequant_chunk: whole\n" : sliced ? "expert_dequant_chunk: 64MiB\n" : "")
           << (eager ? "cuda_graphs: false\n" : graphs ? "cuda_graphs: true\n" : "")
           << (redequant ? "expert_bank_reuse: none\n" : keepdown ? "expert_bank_reuse: down\n" : "")
           << (portable ? "expert_gemm: portable\n" : torch_gemm ? "expert_gemm: torch\n" : "")
           << (card ? std::string("device_memory_limit: ") + card_memory(*card) + "\nexpert_offload_copy_pace_gbps: " +
                          std::to_string(card->link_gbps) + "\n"
                    : std::string())
           << (packed ? "sample_packing: true\n" : "")
           << "datasets: [{path: " << (packed ? packed_tokens : tokens) << ", type: tokens, dtype: uint32"
           << (packed ? ", eos_token_id: " + std::to_string(kPackedEos) : std::string()) << "}]\n"
           << "sequence_len: " << pt.seq << "\nmicro_batch_size: " << pt.mb << "\nmax_steps: " << steps + warmup << "\n"
           << "learning_rate: 1e-4\nlr_scheduler: constant\nlogging_steps: 1\ngradient_checkpointing: true\n"
           << "gradient_checkpointing_kwargs: {use_reentrant: false}\nbf16: auto\nsave_steps: 0\nsave_total_limit: 1\n"
           << "output_dir: " << work << "/run\n";
      if (mode != "resident") {
        yaml << "expert_offload: true\nexpert_offload_prefetch: " << (mode == "sync" ? "false" : "true") << "\n";
        // prefetchN: N blocks staged ahead (N + 1 device slots).
        if (mode.rfind("prefetch", 0) == 0 && mode.size() > 8) yaml << "expert_offload_prefetch_depth: " << mode.substr(8) << "\n";
      }
      try {
        TrainConfig cfg = load_config_text(yaml.str(), "eo-bench", {});
        MemoryPlan plan = plan_memory(cfg, mc, resolve_compute(cfg, at::hasCUDA(), true).dtype, 1, at::hasCUDA());
        if (mode == "budget") {
          const double budget = std::floor(plan.expert_bytes * budget_fraction);
          cfg.expert_offload_vram_budget = std::to_string(static_cast<long long>(budget));
          plan = plan_memory(cfg, mc, resolve_compute(cfg, at::hasCUDA(), true).dtype, 1, at::hasCUDA());
        }
        const StepWork work = step_work(
            resolve_run_spec(cfg, mc, resolve_compute(cfg, at::hasCUDA(), true).dtype, at::hasCUDA(), 1), plan);
        row.plan_vram = plan.device_peak;
        row.pinned = plan.host_pinned;
        remove_tree(cfg.output_dir);  // common/files.h (std::filesystem::remove_all crashes in the CUDA build)
        TrainHooks hooks;
        bench::StepProfiler profiler;
        std::string table;
        if (breakdown) {
          const std::int64_t profiled = warmup + 1;
          hooks.before_step = [&profiler, profiled](std::int64_t s) {
            if (s == profiled) profiler.start();
          };
          hooks.after_step = [&, profiled](std::int64_t s) {
            if (s != profiled) return;
            table = bench::describe(profiler.stop(), name + " " + std::to_string(pt.seq) + "x" + std::to_string(pt.mb) + " g" +
                                                         std::to_string(accum) + " " + spec, useful_flops(work));
          };
        }
        const at::Device dev = at::hasCUDA() ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
        release_cached_memory(dev);  // the previous mode's cached blocks would count as reserved
        model::set_small_k_kernel_enabled(smallk);
        const bool delta_kernels = model::delta_rule_kernels_enabled();  // the library's default, restored below
        if (delta_aten) model::set_delta_rule_kernels_enabled(false);
        train(cfg, world, hooks);
        model::set_small_k_kernel_enabled(false);
        model::set_delta_rule_kernels_enabled(delta_kernels);
        row.reserved_vram = double(peak_reserved_bytes(dev));
        if (!table.empty()) std::printf("%s\n", table.c_str());
        std::ifstream in(cfg.output_dir + "/metrics.jsonl");
        std::vector<double> times, staged, h2d, stall, disk_read, disk_rate, disk_wait;
        double window_begin = -1, window_end = -1;  // device clock at the last warm-up / timed step's end
        std::string line;
        while (std::getline(in, line)) {
          const auto j = nlohmann::json::parse(line);
          row.peak_vram = std::max(row.peak_vram, j.value("peak_mem_bytes", 0.0));
          const int s = j.value("step", 0);
          if (s == warmup) window_begin = j.value("device_clock_s", -1.0);
          if (s <= warmup) continue;
          if (s == warmup + steps) window_end = j.value("device_clock_s", -1.0);
          times.push_back(j.value("step_time_s", 0.0));
          // The experts' bytes, and the experts' LoRA's where its state is on the host: one link.
          staged.push_back(j.value("staged_bytes", 0.0) + j.value("lora_h2d_bytes", 0.0));
          h2d.push_back(j.value("h2d_gbps", 0.0));
          stall.push_back(j.value("stall_s", 0.0));
          disk_read.push_back(j.value("disk_read_bytes", 0.0));
          disk_rate.push_back(j.value("disk_gbps", 0.0));
          disk_wait.push_back(j.value("disk_wait_s", 0.0));
        }
        if (window_begin < 0 || window_end <= window_begin || int(times.size()) != steps)
          throw std::runtime_error("metrics.jsonl lacks the timed window's steps " + std::to_string(warmup) + ".." +
                                   std::to_string(warmup + steps));
        row.s_per_step = (window_end - window_begin) / steps;
        row.step_min = *std::min_element(times.begin(), times.end());
        row.step_median = median(times);
        row.step_max = *std::max_element(times.begin(), times.end());
        row.tokens_per_s = row.s_per_step > 0 ? double(pt.seq) * pt.mb * accum / row.s_per_step : 0;
        row.staged_per_step = median(staged);
        row.h2d_gbps = median(h2d);
        row.stall_s = median(stall);
        row.floor_s = bw > 0 ? row.staged_per_step / (bw * 1e9) : 0;
        if (below_floor(row.s_per_step, row.floor_s) || below_floor(row.step_min, row.floor_s)) {
          char why[256];
          std::snprintf(why, sizeof why,
                        "refused: %.4f s/step (fastest step %.4f s) is below this row's transfer floor %.4f s "
                        "(%s staged at %.1f GB/s): the timer or the floor is wrong",
                        row.s_per_step, row.step_min, row.floor_s, human_bytes(row.staged_per_step).c_str(), bw);
          row.error = why;
        }
        if (disk) {
          // The drive's own rate on the homes file just used: one sequential O_DIRECT pass in 64 MiB
          // reads, against what the read ring reached during the timed steps.
          row.disk_read_per_step = median(disk_read);
          row.disk_gbps = median(disk_rate);
          row.disk_wait_s = median(disk_wait);
          const std::string file = offload::disk_homes_path(disk_dir);
          std::int64_t bytes = 0;
          bool direct = false;
          row.disk_raw_gbps = offload::sequential_read_gbps(file, std::int64_t(64) << 20, &bytes, &direct);
          struct statfs fsinfo {};
          const bool tmpfs = ::statfs(disk_dir.c_str(), &fsinfo) == 0 && fsinfo.f_type == 0x01021994;  // TMPFS_MAGIC
          std::printf("# %s %s: disk homes %s (%s): raw sequential read %.2f GB/s (%s, 64 MiB reads); in training the ring "
                      "read %s per step at %.2f GB/s (floor at the raw rate %.3f s/step), copies waited %.3f s per step for "
                      "reads%s\n",
                      name.c_str(), spec.c_str(), file.c_str(), human_bytes(double(bytes)).c_str(), row.disk_raw_gbps,
                      direct ? "O_DIRECT" : "buffered: O_DIRECT refused", human_bytes(row.disk_read_per_step).c_str(),
                      row.disk_gbps, row.disk_raw_gbps > 0 ? row.disk_read_per_step / (row.disk_raw_gbps * 1e9) : 0.0,
                      row.disk_wait_s,
                      tmpfs ? " -- NOTE: the homes are on tmpfs (RAM), not a drive: pass --workdir or --disk-dir on the drive"
                            : "");
        }
        row.plan_fit = "yes";
        row.ran = "yes";
      } catch (const std::exception& e) {
        row.error = e.what();
        const auto nl = row.error.find('\n');
        if (nl != std::string::npos) row.error = row.error.substr(0, nl);
        // The start-up plan refuses before loading; anything later is the run failing.
        const bool refused = row.error.find("this run does not fit") != std::string::npos;
        row.plan_fit = refused ? "no" : row.plan_fit.empty() ? "yes" : row.plan_fit;
        row.ran = refused ? "not started" : row.error.find("out of memory") != std::string::npos ? "out of memory" : "failed";
      }
      rows.push_back(row);
      std::fflush(stdout);
    }
  }

  // The table: offload rows against the same point's resident row and against their floor.
  std::printf("\naccumulation %d, LoRA on %s%s\n", accum, targets.c_str(),
              expert_params.empty() ? "" : (" and the fused experts (" + mc.moe_prefix() + ".experts)").c_str());
  std::printf("\ns/step: the timed window's steady rate (device clock); step min / median / max: the per-step device times\n");
  std::printf("\n| model | seq x mb | mode | s/step | step min / median / max | tokens/s | peak VRAM | plan VRAM | plan vs peak | reserved | pinned host | staged/step | H2D GB/s | stall s | floor s | vs resident | vs floor |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  nlohmann::json all = nlohmann::json::array();
  for (const Row& r : rows) {
    double resident = 0;
    for (const Row& o : rows)
      if (o.mode.rfind("resident", 0) == 0 && o.point.seq == r.point.seq && o.point.mb == r.point.mb && o.error.empty()) resident = o.s_per_step;
    if (!r.error.empty()) {
      std::printf("| %s | %dx%d | %s | error: %s |\n", r.model.c_str(), r.point.seq, r.point.mb, r.mode.c_str(), r.error.c_str());
    } else {
      char vs_res[32] = "", vs_floor[32] = "";
      if (resident > 0) std::snprintf(vs_res, sizeof vs_res, "%.2fx", r.s_per_step / resident);
      if (r.floor_s > 0) std::snprintf(vs_floor, sizeof vs_floor, "%.2fx", r.s_per_step / r.floor_s);
      const double err = r.peak_vram > 0 ? 100 * (r.plan_vram / r.peak_vram - 1) : 0;
      std::printf("| %s | %dx%d | %s | %.3f | %.3f / %.3f / %.3f | %.0f | %s | %s | %+.1f%% | %s | %s | %s | %.1f | %.3f | %.3f | %s | %s |\n",
                  r.model.c_str(), r.point.seq, r.point.mb, r.mode.c_str(), r.s_per_step, r.step_min, r.step_median,
                  r.step_max, r.tokens_per_s,
                  human_bytes(r.peak_vram).c_str(), human_bytes(r.plan_vram).c_str(), err, human_bytes(r.reserved_vram).c_str(),
                  human_bytes(r.pinned).c_str(), human_bytes(r.staged_per_step).c_str(),
                  r.h2d_gbps, r.stall_s, r.floor_s, vs_res, vs_floor);
    }
    all.push_back({{"model", r.model}, {"mode", r.mode}, {"seq", r.point.seq}, {"mb", r.point.mb}, {"accum", accum}, {"s_per_step", r.s_per_step},
                   {"step_min_s", r.step_min}, {"step_median_s", r.step_median}, {"step_max_s", r.step_max},
                   {"tokens_per_s", r.tokens_per_s}, {"peak_vram", r.peak_vram}, {"plan_vram", r.plan_vram}, {"reserved_vram", r.reserved_vram},
                   {"pinned", r.pinned}, {"staged_per_step", r.staged_per_step}, {"h2d_gbps", r.h2d_gbps},
                   {"stall_s", r.stall_s}, {"floor_s", r.floor_s}, {"pinned_bw_gbps", bw}, {"error", r.error},
                   {"disk_read_per_step", r.disk_read_per_step}, {"disk_gbps", r.disk_gbps},
                   {"disk_raw_gbps", r.disk_raw_gbps}, {"disk_wait_s", r.disk_wait_s},
                   {"card", card ? card->name : ""}, {"simulated_on", simulated_on}, {"plan_fit", r.plan_fit}, {"ran", r.ran}});
  }
  if (card) {
    std::printf("\n--card %s (%s memory, %g GB/s pinned host-to-device, portable expert GEMM), %s\n", card->name.c_str(),
                card_memory(*card).c_str(), card->link_gbps, simulated_on.c_str());
    std::printf("\n| card | model | seq x mb x g | mode | plan says fits | ran | peak VRAM | s/step | floor s at %g GB/s | vs floor |\n",
                card->link_gbps);
    std::printf("|---|---|---|---|---|---|---|---|---|---|\n");
    for (const Row& r : rows) {
      char vs_floor[32] = "-", sps[32] = "-", fl[32] = "-";
      if (r.error.empty()) {
        std::snprintf(sps, sizeof sps, "%.3f", r.s_per_step);
        std::snprintf(fl, sizeof fl, "%.3f", r.floor_s);
        if (r.floor_s > 0) std::snprintf(vs_floor, sizeof vs_floor, "%.2fx", r.s_per_step / r.floor_s);
      }
      std::printf("| %s (%s) | %s | %dx%dx%d | %s | %s | %s | %s | %s | %s | %s |\n", card->name.c_str(), simulated_on.c_str(),
                  r.model.c_str(), r.point.seq, r.point.mb, accum, r.mode.c_str(), r.plan_fit.c_str(), r.ran.c_str(),
                  r.error.empty() ? human_bytes(r.peak_vram).c_str() : "-", sps, fl, vs_floor);
    }
  }
  if (!json_out.empty()) std::ofstream(json_out) << all.dump(1) << "\n";
  world.finalize();
  // A row refused for its floor fails the run: a script must not take its table as a result.
  for (const Row& r : rows)
    if (r.error.rfind("refused:", 0) == 0) return 1;
  return 0;
}
