#include "runtime/setup.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <thread>
#include <tuple>

#include "common/checksum.h"
#include "common/error.h"
#include "common/log.h"
#include "common/text.h"
#include "models/grouped_mm.h"
#include "models/moe_model.h"
#include "offload/disk_homes.h"
#include "offload/engine.h"
#include "offload/homes.h"
#include "offload/host_memory.h"
#include "runtime/adapter_files.h"
#include "runtime/data/batcher.h"
#include "runtime/data/jsonl.h"
#include "runtime/data/tokens.h"
#include "runtime/device.h"
#include "runtime/ddp/comm.h"
#include "runtime/ddp/home_sharing.h"
#include "runtime/ddp/reducer.h"
#include "runtime/ddp/world.h"
#include "runtime/expert_lora_offload.h"
#include "runtime/optimizer.h"
#include "runtime/plan.h"
#include "runtime/plan_fixes.h"
#include "runtime/setup_data.h"
#include "runtime/train_state.h"

#ifdef EO_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>

#include "models/expert_gemm_cuda.h"
#endif

namespace eo {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The decoder block a LoRA parameter belongs to, from its peft name (...model.layers.<i>....).
int block_of_parameter(const std::string& name) {
  const std::string key = ".layers.";
  const auto at = name.find(key);
  EO_CHECK(at != std::string::npos, "LoRA parameter ", name, " names no decoder layer (.layers.<i>.)");
  return std::stoi(name.substr(at + key.size()));
}

// What disk homes are made from, for their header: a file made from another checkpoint or with
// other quantisation settings is rebuilt, naming the key that differs. (Every block's checksum is
// compared too; these say why in words.)
std::map<std::string, std::string> disk_homes_identity(const TrainConfig& cfg, const RunSpec& spec) {
  std::error_code ec;
  const std::filesystem::path model = std::filesystem::weakly_canonical(cfg.base_model, ec);
  std::string config_json;
  std::ifstream in(std::filesystem::path(cfg.base_model) / "config.json", std::ios::binary);
  config_json.assign(std::istreambuf_iterator<char>(in), {});
  char sum[24];
  std::snprintf(sum, sizeof sum, "%016llx", static_cast<unsigned long long>(hash_bytes(config_json.data(), config_json.size())));
  return {{"base_model", ec ? cfg.base_model : model.string()},
          {"config.json", sum},
          {"model_type", spec.model.model_type},
          {"weights", cfg.synthetic_weights ? "synthetic, seed " + std::to_string(cfg.seed) : "checkpoint"},
          {"experts", std::string(quant_format_name(spec.expert_format.value_or(QuantFormat::Nf4))) +
                          (spec.expert_format && quant_format_traits(*spec.expert_format).checkpoint_own ? " (the checkpoint's)" : "")},
          {"bnb_4bit_blocksize", std::to_string(spec.blocksize)},
          {"bnb_4bit_use_double_quant", spec.double_quant ? "true" : "false"}};
}

// Moves the model's NF4 experts into this rank's homes and streams them from there.
std::shared_ptr<offload::ExpertOffloader> start_offload(model::MoeModel& model, const TrainConfig& cfg, const RunSpec& spec,
                                                        const at::Device& device, ddp::World& world) {
  auto* resident = dynamic_cast<model::ResidentWeights*>(&model.weight_provider());
  EO_CHECK(resident, "expert_offload: the model's experts are not held by a ResidentWeights store");
  bool any = false;
  for (const auto& layer : resident->bank()) any |= !layer.empty();
  if (!any)
    throw UsageError("expert_offload: true, but " + model.config().model_type + " checkpoint " + cfg.base_model +
                     " has no MoE expert blocks (looked for layers whose config makes them sparse — num_experts > 0, "
                     "decoder_sparse_step, mlp_only_layers — with " + model.config().moe_prefix() +
                     ".experts.* weights); set expert_offload: false");
  offload::OffloadOptions oo;
  oo.device = device;
  oo.pin_memory = cfg.expert_offload_pin_memory;
  oo.prefetch = cfg.expert_offload_prefetch;
  oo.prefetch_depth = cfg.expert_offload_prefetch_depth;
  oo.copy_pace_gbps = cfg.expert_offload_copy_pace_gbps;
  oo.group_size = spec.group_size;  // the plan's (expert_group_size, or auto's choice)
  // auto: sized after the first step, once the activation peak is known (see size_auto_budget).
  oo.vram_budget_bytes = spec.budget_auto ? 0 : spec.budget_bytes;
  if (!device.is_cuda() && oo.vram_budget_bytes > 0)
    log::info("expert_offload_vram_budget applies to GPU memory; on the CPU the 'device' slots are host memory too");
  if (spec.homes == offload::HomesKind::PerNumaNode) {
    const ddp::HomeGroup g = ddp::home_group(world, device);
    oo.sharing = ddp::make_home_sharing(world, g);
    log::info("expert homes: one copy per NUMA node, shared by " + std::to_string(g.size) + " rank(s) (leader: rank " +
              std::to_string(g.leader) + ")");
  }
  if (spec.homes == offload::HomesKind::Disk) {
    const ddp::HomeGroup g = ddp::home_group(world, device, /*by_numa_node=*/false);
    oo.sharing = ddp::make_home_sharing(world, g);
    oo.disk = offload::DiskHomesOptions{};
    oo.disk->dir = cfg.expert_offload_disk_path;
    oo.disk->identity = disk_homes_identity(cfg, spec);
    log::info("expert homes: on disk in " + cfg.expert_offload_disk_path + ", one file for this host's " + std::to_string(g.size) +
              " rank(s) (written or checked by rank " + std::to_string(g.leader) + ")");
  }
  auto off = std::make_shared<offload::ExpertOffloader>(std::move(resident->bank()), oo);
  model.set_weight_provider(off);
  return off;
}

// expert_offload_homes: disk, before any weight is read: a homes file that must be (re)written
// needs its bytes free on the drive. A file already there of the right size is most likely reused
// (if not, the writer's own ENOSPC error still says what happened).
void check_disk_space_for_homes(const TrainConfig& cfg, const offload::DiskHomesSize& disk) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const std::string file = offload::disk_homes_path(cfg.expert_offload_disk_path);
  const auto existing = fs::file_size(file, ec);
  if (!ec && static_cast<std::int64_t>(existing) == disk.file_bytes) return;
  fs::path dir = fs::absolute(cfg.expert_offload_disk_path);
  while (!fs::exists(dir, ec) && dir != dir.parent_path()) dir = dir.parent_path();
  const fs::space_info space = fs::space(dir, ec);
  if (ec) return;
  if (static_cast<std::int64_t>(space.available) >= disk.file_bytes) return;
  throw Error("not enough space for the disk homes: the homes file " + file + " needs " + std::to_string(disk.file_bytes) +
              " bytes (" + human_bytes(double(disk.file_bytes)) + "), but " + dir.string() + " has " +
              std::to_string(space.available) + " bytes (" + human_bytes(double(space.available)) +
              ") free. Free space there, or set expert_offload_disk_path to a local drive with room.");
}

// Before any weight is read: the homes of every rank on this node must fit in the host RAM (and
// cgroup limit) available. Every rank measures, then the job takes the smallest measurement — an
// all-reduce that is also a barrier, so no rank has started filling its homes while another measures.
void check_host_memory_for_homes(const TrainConfig& cfg, const RunSpec& spec, ddp::World& world, const at::Device& device) {
  const QuantFormat format = spec.expert_format.value_or(QuantFormat::Nf4);
  const std::int64_t per_rank = offload::estimate_home_bytes(spec.model, spec.blocksize, spec.double_quant, format);
  // The ring as the engine sizes it (offload/engine.cpp: the slots asked for).
  const offload::DiskHomesSize disk =
      offload::estimate_disk_homes(spec.model, spec.blocksize, spec.double_quant,
                                   offload::slots_asked(spec.prefetch, cfg.expert_offload_prefetch_depth), format);
  offload::HostMemory mem = offload::host_memory_available();
  double v[2] = {-(mem.available < 0 ? 1e18 : double(mem.available)),
                 double(world.info().local_size)};
  world.allreduce_max(v, 2);
  const auto smallest = static_cast<std::int64_t>(-v[0]);
  if (mem.available >= 0 && smallest < mem.available) {
    mem.available = smallest;
    mem.source += ", the smallest of all ranks";
  }
  // per_rank: a copy per rank on the node; per_numa_node: a copy per NUMA node used on this host;
  // disk: a read ring per rank on the node.
  const bool shared = spec.homes == offload::HomesKind::PerNumaNode;
  const bool on_disk = spec.homes == offload::HomesKind::Disk;
  const int copies = shared ? ddp::home_group(world, device).copies_on_host : static_cast<int>(v[1]);
  // expert_lora_offload: every rank's experts' LoRA state comes out of the same RAM first.
  const double host_lora = spec.expert_lora_offload ? plan_memory(spec).host_lora * v[1] : 0;
  if (host_lora > 0 && mem.available >= 0) {
    mem.available = std::max<std::int64_t>(0, mem.available - static_cast<std::int64_t>(host_lora));
    mem.source += ", less " + human_bytes(host_lora) + " for the ranks' expert LoRA state";
  }
  const std::string available =
      mem.available < 0 ? std::string("available unknown") : human_bytes(double(mem.available)) + " available (" + mem.source + ")";
  if (on_disk) {
    offload::check_homes_fit(disk.ring_bytes, copies, mem, offload::HomesKind::Disk);
    check_disk_space_for_homes(cfg, disk);
    log::info("host memory: disk homes need a read ring of " + std::to_string(disk.ring) + " x " +
              human_bytes(double(disk.ring_bytes / disk.ring)) + " = " + human_bytes(double(disk.ring_bytes)) + " per rank x " +
              std::to_string(copies) + " rank(s) on the node (the homes, " + human_bytes(double(per_rank)) +
              ", stay on the drive); " + available);
    return;
  }
  offload::check_homes_fit(per_rank, copies, mem, shared ? offload::HomesKind::PerNumaNode : offload::HomesKind::PerRank,
                           disk.ring_bytes);
  log::info("host memory: expert homes need " + human_bytes(double(per_rank)) + " per copy x " + std::to_string(copies) +
            (shared ? " NUMA node copy(ies)" : " rank(s)") + " on the node; " + available);
}

// Before any weight is read: cap the allocator (device_memory_limit) and refuse a run whose
// planned peak cannot fit, with the plan's numbers instead of an out-of-memory error mid-step.
// On the CPU only an explicit device_memory_limit is checked (host RAM is the "device").
// Where the plan does not fit, auto's alternatives are tried (fit_plan). Every decision is taken
// before any is logged; the room the plan leaves for CUDA graphs' pool is one of the facts they are
// decided from once the model is loaded (decide_cuda_graphs).
PlanFit check_memory_plan(const TrainConfig& cfg, const RunSpec& spec, const at::Device& device) {
  const bool gpu = device.is_cuda();
  if (gpu) set_device_memory_limit(device, cfg.device_memory_limit);
  const bool limited = cfg.device_memory_limit > 0;
  if (!limited && !gpu) return PlanFit{spec, GraphFacts{"", false, "the CPU", ""}};
  const double available = limited ? double(cfg.device_memory_limit) : double(free_device_memory(device));
  const FittedPlan fitted = fit_plan(spec, available);
  const MemoryPlan& plan = fitted.plan;
  const bool fits = plan.device_peak + plan.margin <= available;
  // Graphs replay from their own memory pool, which keeps the largest working set of a use (a
  // block's recompute + backward, or the loss head) beside the default pool's.
  double extra = 0;
  for (const auto& part : plan.device)
    if (part.name == "block" || part.name == "head") extra = std::max(extra, part.bytes);
  const std::string what = limited ? "device_memory_limit " + human_bytes(available)
                                   : human_bytes(available) + " free on " + describe_device(device);
  const PlanFit fit{fitted.spec,
                    GraphFacts{human_bytes(extra), fits && plan.device_peak + plan.margin + extra <= available, what, ""}};

  if (fitted.down_from > 0)
    log::info("expert_bank_reuse: auto -> down: keeping gate's and up's dequantised banks for the backward would not fit (" +
              human_bytes(fitted.down_from) + " + margin); the backward dequantises them again");
  if (fitted.grouped_from > 0)
    log::info("expert_group_size: auto -> " + std::to_string(fitted.spec.group_size) + ": whole blocks would not fit (" +
              human_bytes(fitted.grouped_from) + " + margin); each block streams in groups of " +
              std::to_string(fitted.spec.group_size) + " experts");
  if (gpu && fitted.spec.group_size > 0 && expand_allocator_segments(device))
    log::info("allocator: expandable segments (blocks streamed in groups free and take back a dequantised bank of each "
              "group's experts per matrix; fixed segments fragment them past the plan's margin)");
  if (fitted.sliced_from > 0)
    log::info("expert_dequant_chunk: auto -> " + std::to_string(kAutoBankSliceBytes >> 20) + "MiB: the whole bank would not fit (" +
              human_bytes(fitted.sliced_from) + " + margin); slices of the experts are dequantised one at a time (slower)");
  log::info("memory plan: peak " + human_bytes(plan.device_peak) + " + margin " + human_bytes(plan.margin) + " of " + what +
            (plan.host_pinned > 0 ? "; " + human_bytes(plan.host_pinned) + " pinned host RAM per rank" : std::string()));
  if (fits) return fit;
  throw UsageError("this run does not fit: the plan needs " + human_bytes(plan.device_peak) + " + a margin of " +
                   human_bytes(plan.margin) + " of device memory, " + what + ".\n" + describe_plan(plan, available) +
                   describe_fixes(plan_fixes(cfg, spec, available), what) +
                   "(eo-ddp plan --config F --vram SIZE shows the plan without starting.)");
}

// Each rank's intra-op thread pool (host-side tensor work: the embedding gather, data, CPU
// compute) gets its share of the host's cores, not all of them: N ranks with a pool each the size
// of the host oversubscribe it N times over, and a descheduled thread delays the kernel launches
// behind it. An explicit OMP_NUM_THREADS is the user's choice and is left alone.
void size_thread_pool(int local_size) {
  if (std::getenv("OMP_NUM_THREADS") || local_size <= 1) return;
  const int cores = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  const int share = std::max(1, cores / local_size);
  if (share < at::get_num_threads()) {
    at::set_num_threads(share);
    log::info("intra-op threads: " + std::to_string(share) + " per rank (" + std::to_string(cores) + " cores / " +
              std::to_string(local_size) + " ranks on this node; set OMP_NUM_THREADS to choose)");
  }
}

}  // namespace

void check_gpu_served(const at::Device& device, const ComputeChoice& compute) {
  if (!device.is_cuda()) return;
  const GpuCard card = gpu_card(device);
  const std::string which = device.str() + " (" + card.name + ", sm_" + std::to_string(card.major) +
                            std::to_string(card.minor) + ")";
  // A card without bf16 tensor cores (T4, V100) computes in fp16, which bf16: auto picks there.
  if (card.major < 8 && compute.dtype != Compute::Fp16)
    throw UsageError(which + " has no bf16 tensor cores (" + compute.why + "): on it eo-ddp computes in fp16 with loss "
                     "scaling; set fp16: true (or leave bf16: auto and fp16 unset), or train on sm_80 or newer (A100, "
                     "RTX 30xx / 40xx / 50xx, RTX A-series, H100 / H200, B200) in bf16");
#ifdef EO_WITH_CUDA
  c10::cuda::CUDAGuard guard(device);
  if (expert_gemm::cuda::probe_kernel_image() != cudaSuccess) {
    (void)cudaGetLastError();
    throw UsageError("this eo-ddp was built without machine code for " + which +
                     ": rebuild with the default architecture list (drop -DCMAKE_CUDA_ARCHITECTURES) or with "
                     "-DCMAKE_CUDA_ARCHITECTURES=" + std::to_string(card.major) + std::to_string(card.minor));
  }
#endif
}

void decide_expert_gemm(RunSpec& spec, const at::Device& device) {
  const Compute compute = spec.compute;
  const bool asked_portable = spec.expert_gemm == ExpertGemmSetting::Portable;
  spec.expert_gemm_kernel = model::ExpertGemm::kTorch;
  spec.expert_gemm_grouped = false;
  if (!device.is_cuda()) {
    if (asked_portable)
      throw UsageError("expert_gemm: portable runs on a CUDA GPU (bf16 on sm_80 or newer, fp16 on sm_75 or newer); this "
                       "run is on the CPU (use auto)");
    spec.expert_gemm_why = "libtorch's (a CPU run)";
    return;
  }
  const GpuCard card = gpu_card(device);
  const std::string sm = "sm_" + std::to_string(card.major) + std::to_string(card.minor);
  const std::string per_expert = "libtorch's GEMM per expert, the routing counts read on the host (";
  if (compute == Compute::Fp32) {
    if (asked_portable)
      throw UsageError("expert_gemm: portable computes in bf16 or fp16; this run computes in fp32: use expert_gemm: auto, "
                       "or bf16 / fp16 compute");
    spec.expert_gemm_why = per_expert + "fp32 compute: the grouped kernels take bf16 and fp16)";
    return;
  }
  const at::ScalarType dtype = compute == Compute::Bf16 ? at::kBFloat16 : at::kHalf;
  const std::string name = compute_name(compute);
  model::ExpertGemm kernel = model::auto_expert_gemm(card.major, dtype);
  std::string why = "auto on " + sm + " in " + name;
  if (spec.expert_gemm == ExpertGemmSetting::Torch) kernel = model::ExpertGemm::kTorch, why = "expert_gemm: torch";
  if (asked_portable) kernel = model::ExpertGemm::kPortable, why = "expert_gemm: portable";
  if (kernel == model::ExpertGemm::kPortable && !model::portable_kernel_takes(dtype, device)) {
    // The build's code for this card is older than the kernel needs (fp16: sm_75, bf16: sm_80).
    const std::string lacks = "this build's code for " + device.str() + " (" + card.name + ", " + sm +
                              ") has no " + name + " grouped kernel (" + name + " needs sm_" +
                              (compute == Compute::Bf16 ? "80" : "75") + " or newer)";
    if (asked_portable) throw UsageError("expert_gemm: portable: " + lacks + "; use expert_gemm: auto");
    kernel = model::ExpertGemm::kTorch, why += "; " + lacks;
  }
  spec.expert_gemm_kernel = kernel;
  spec.expert_gemm_grouped = model::grouped_expert_gemm_runs(kernel, dtype, device);
  if (!spec.expert_gemm_grouped)
    spec.expert_gemm_why = per_expert + why + ")";
  else if (kernel == model::ExpertGemm::kPortable)
    spec.expert_gemm_why = "portable CUTLASS grouped GEMM in " + name + ", sizes read on the device (" + why + ")";
  else if (model::auto_expert_gemm(card.major, dtype) == model::ExpertGemm::kTorch)
    spec.expert_gemm_why = "PyTorch's at::_grouped_mm, device-scheduled on " + sm + " (" + why + ")";
  else
    spec.expert_gemm_why = "PyTorch's at::_grouped_mm, which on " + sm +
                           " reads the routing counts on the host and loops over experts (" + why +
                           "; auto picks the portable kernel)";
}

Run::Run() = default;
Run::~Run() = default;
Run::Run(Run&&) noexcept = default;

NamedTensors rng_state(const at::Device& device) {
  NamedTensors out;
  out.emplace_back("cpu", at::detail::getDefaultCPUGenerator().get_state());
  if (device.is_cuda()) out.emplace_back("cuda", at::globalContext().defaultGenerator(device).get_state());
  return out;
}

void restore_rng(const NamedTensors& state, const at::Device& device) {
  for (const auto& [name, t] : state) {
    if (name == "cpu") at::Generator(at::detail::getDefaultCPUGenerator()).set_state(t);  // copy shares the impl
    if (name == "cuda" && device.is_cuda()) {
      at::Generator g = at::globalContext().defaultGenerator(device);
      g.set_state(t);
    }
  }
}

// expert_offload_vram_budget: auto. After the first step: what the device can still give, less the
// step's activation peak (it recurs every step) and a safety margin, becomes resident blocks.
void size_auto_budget(offload::ExpertOffloader& off, const at::Device& device, std::int64_t step_start_allocated) {
  if (!device.is_cuda()) {
    log::info("expert_offload_vram_budget: auto keeps every block streamed on the CPU (no device memory to fill)");
    return;
  }
  synchronize(device);
  const std::int64_t activation_peak = std::max<std::int64_t>(0, peak_memory_bytes(device) - step_start_allocated);
  const std::int64_t margin = std::int64_t(512) << 20;
  const std::int64_t budget = free_device_memory(device) - activation_peak - margin;
  const int n = budget > 0 ? off.promote_resident(budget) : 0;
  log::info("expert_offload_vram_budget: auto -> " + human_bytes(double(std::max<std::int64_t>(0, budget))) + " free after a " +
            human_bytes(double(activation_peak)) + " activation peak: " + std::to_string(n) + " more block(s) resident (" +
            std::to_string(off.resident_layers().size()) + " in all)");
}

namespace {

// expert_lora_offload: the experts' LoRA state to the host, staged with its block; said in the log.
void start_expert_lora_offload(const TrainConfig& cfg, Run& run, int ranks) {
  const RunSpec& spec = run.spec;
  if (!spec.offload || !experts_carry_lora(spec)) return;
  if (!spec.expert_lora_offload) {
    log::info("expert LoRA: its masters, gradients and AdamW moments stay on the device (expert_lora_offload: false)");
    return;
  }
  run.expert_lora = std::make_unique<ExpertLoraOffload>(*run.model, run.device, cfg.expert_offload_pin_memory, cfg, ranks);
  if (run.expert_lora->params().empty()) {  // peft_layers_to_transform left every MoE block out
    run.expert_lora.reset();
    return;
  }
  run.model->set_weight_provider(run.expert_lora->wrap(run.offloader));
  log::info("expert LoRA offloaded: " + std::to_string(run.expert_lora->params().size()) +
            " tensors' fp32 masters, gradients and AdamW moments in host RAM (" +
            human_bytes(double(run.expert_lora->host_bytes())) + "), working copies of " +
            std::to_string(kExpertLoraWorkingCopies) + " blocks with their state in fixed device slots (" +
            human_bytes(double(run.expert_lora->device_bytes())) + "); each block's AdamW update on the device as it is staged");
}

// The model on the device (its experts in this rank's homes with expert_offload), its LoRA, and
// nvfp4_merge_aware's snapped weights. Returns why the expert GEMMs read the routing counts on the
// host (no CUDA graph can capture that), or "" where they read them on the device.
std::string load_model(const TrainConfig& cfg, Run& run, ddp::World& world) {
  const RunSpec& spec = run.spec;
  const at::Device device = run.device;
  const auto t_load = Clock::now();
  model::LoadOptions lo;
  lo.dtype = spec.compute == Compute::Bf16 ? at::kBFloat16 : spec.compute == Compute::Fp16 ? at::kHalf : at::kFloat;
  lo.load_in_4bit = spec.load_in_4bit;
  lo.blocksize = spec.blocksize;
  lo.double_quant = spec.double_quant;
  lo.expert_quant = model::expert_quant_named(cfg.expert_quant);  // the loader logs the experts' format
  lo.expert_bank_bytes = spec.bank_bytes;
  lo.device = device;
  lo.experts_on_host = cfg.expert_offload;
  if (cfg.synthetic_weights) lo.random_seed = static_cast<std::uint64_t>(cfg.seed);
  // The expert GEMMs' dispatch deep in models/ (grouped_mm) reads the kernel process-wide.
  model::set_expert_gemm(spec.expert_gemm_kernel);
  log::info("loading " + cfg.base_model + (cfg.load_in_4bit ? " (quantising decoder linears to NF4)" : "") + " on " +
            describe_device(device) + ", " + compute_name(spec.compute) + " compute");
  run.model = model::MoeModel::load(cfg.base_model, spec.model, lo);
  model::MoeModel& model = *run.model;
  // The banks a recompute keeps for its backward, which follows at once (none without
  // checkpointing, where a forward's graph would outlive it: bank_reuse_in_effect).
  model.set_bank_reuse(spec.bank_reuse);
  if (spec.offload) run.offloader = start_offload(model, cfg, spec, device, world);
  model.add_lora(spec.lora);
  start_expert_lora_offload(cfg, run, world.info().world_size);
  run.lora = model.lora_parameters();
  EO_CHECK(!run.lora.empty(), "no LoRA target found in ", cfg.base_model, " for lora_target_modules [",
           join(spec.lora.targets, ", "), "]");
  std::int64_t trainable = 0;
  for (const auto& [n, p] : run.lora) {
    trainable += p.numel();
    run.lora_blocks.push_back(block_of_parameter(n));
  }
  log::info("model " + model.config().model_type + ": " + std::to_string(model.num_layers()) + " layers, LoRA r=" +
            std::to_string(cfg.lora_r) + " on " + std::to_string(run.lora.size() / 2) + " modules (" +
            std::to_string(trainable) + " trainable parameters); loaded in " + std::to_string(seconds_since(t_load)).substr(0, 5) + " s");
  if (spec.merge_aware) {
    const auto [linears, experts] = model.enable_merge_aware();
    log::info("nvfp4_merge_aware: " + std::to_string(linears) + " NVFP4 linears and " + std::to_string(experts) +
              " NVFP4 expert matrices (per MoE block) train through their NVFP4-snapped effective weight, from step " +
              merge_aware_start_text(cfg) +
              " on; each snapped bank is dense in the compute dtype, kept for its backward");
  }
  // The grouped expert GEMMs read the routing counts on the device; where they do not run (fp32
  // compute, fp16 without the portable kernel) or the experts' LoRA cannot join them (r not a
  // multiple of 8: its [rows, r] operands must be 16-byte aligned), the GPU runs each MoE block
  // expert by expert, reading the counts on the host. Said once, with the fix.
  if (!device.is_cuda()) return "";
  if (!spec.expert_gemm_grouped)
    return std::string("the expert GEMMs run expert by expert in ") + compute_name(spec.compute) +
           ", reading the routing counts on the host";
  if (model.expert_lora_grouped_ok()) return "";
  const std::string r = std::to_string(cfg.lora_r);
  log::warn("lora_r " + r + " is not a multiple of 8, so the experts' LoRA cannot run as grouped GEMMs: each MoE block "
            "runs expert by expert with a host read of its routing counts, several times slower; lora_r 8, 16, 32 or 64 avoids it");
  return "lora_r " + r + " is not a multiple of 8: the per-expert path reads counts on the host";
}

// The LoRA parameters the device updates (all but the host-held experts'), and their blocks.
NamedTensors device_lora(const Run& run, std::vector<int>* blocks = nullptr) {
  NamedTensors out;
  for (std::size_t k = 0; k < run.lora.size(); ++k) {
    if (run.expert_lora && run.expert_lora->holds(run.lora[k].second)) continue;
    out.push_back(run.lora[k]);
    if (blocks) blocks->push_back(run.lora_blocks[k]);
  }
  return out;
}

// The optimizer, and the state a run resumes from: a checkpoint's (LoRA, AdamW, RNG, data
// cursor, the trainer's counters), or lora_model_dir's LoRA weights.
void start_or_resume(const TrainConfig& cfg, Run& run) {
  run.optimizer = std::make_unique<Optimizer>(device_lora(run), cfg);
  const std::string resume = resume_folder(cfg);
  if (resume.empty() && !cfg.lora_model_dir.empty()) {
    run.model->load_adapter_weights(cfg.lora_model_dir);  // its config was checked against this one's
    log::info("LoRA weights from " + cfg.lora_model_dir + " (lora_model_dir); fresh optimizer state");
  }
  if (resume.empty()) return;
  TrainingState s = resume_lora(resume, run.lora);
  const std::map<std::string, at::Tensor> optimizer_state(s.optimizer.begin(), s.optimizer.end());
  run.optimizer->load_state(optimizer_state);
  if (run.expert_lora) run.expert_lora->load_optimizer_state(optimizer_state);
  restore_rng(s.rng, run.device);
  run.batcher->restore(s.data_cursor);
  run.step = s.step;
  run.resumed_from = resume;
  run.resumed_extra = s.extra.is_object() ? s.extra : nlohmann::json::object();
  log::info("resumed from " + resume + " at step " + std::to_string(run.step));
}

// The expert homes proven identical on every rank (never sent: each rank loaded them itself; a
// checksum proves they agree), and how the ranks hold them, for the log.
std::string check_homes_agree(const TrainConfig& cfg, const Run& run, ddp::World& world) {
  const auto& wi = world.info();
  const offload::ExpertOffloader& off = *run.offloader;
  std::vector<ddp::HostBytes> ranges;
  for (const auto& [ptr, n] : off.home_ranges()) ranges.push_back({ptr, n});
  ddp::check_same_bytes(ranges, *run.comm, "expert homes (did every rank load the same checkpoint?)");
  auto distinct_files = [&] {
    const auto [dev, ino] = off.homes_file_id();
    const auto ids = world.allgather(wi.hostname + " " + std::to_string(dev) + ":" + std::to_string(ino));
    return std::set<std::string>(ids.begin(), ids.end()).size();
  };
  if (off.homes_on_disk())
    return ", expert homes identical on every rank: " + std::to_string(distinct_files()) + " disk file(s) of " +
           human_bytes(double(off.home_bytes())) + " read by " + std::to_string(wi.world_size) + " ranks, " +
           human_bytes(double(off.host_ram_bytes())) + " of read buffers per rank";
  if (off.homes_shared()) {
    // RAM accounting: the ranks that share a copy must map one and the same memory file.
    const std::size_t copies = distinct_files();
    return ", expert homes identical on every rank: " + std::to_string(copies) + " shared cop" + (copies == 1 ? "y" : "ies") +
           " of " + human_bytes(double(off.home_bytes())) + " mapped by " + std::to_string(wi.world_size) + " ranks";
  }
  return ", expert homes identical on every rank (" + human_bytes(double(off.home_bytes())) +
         (run.device.is_cuda() && cfg.expert_offload_pin_memory ? " pinned" : " pageable") + " per rank, " +
         human_bytes(double(off.home_bytes()) * wi.local_size) + " on this node)";
}

// Data parallel: rank 0's LoRA everywhere, the homes checked equal, gradients in buckets.
void start_data_parallel(const TrainConfig& cfg, Run& run, ddp::World& world) {
  const auto& wi = world.info();
  run.comm = std::make_unique<ddp::Communicator>(world, run.device, cfg.ddp_timeout);
  if (wi.world_size == 1) return;
  {
    at::NoGradGuard ng;
    ddp::broadcast_parameters(run.lora, *run.comm, 0);
  }
  const std::string homes = run.offloader ? check_homes_agree(cfg, run, world) : std::string();
  log::info("data parallel: " + std::to_string(wi.world_size) + " ranks, LoRA broadcast from rank 0" + homes);
  ddp::ReducerOptions ro;
  ro.bucket_cap_bytes = static_cast<std::int64_t>(cfg.ddp_bucket_cap_mb) << 20;
  ro.op = ddp::ReduceOp::kSum;  // the loss is already normalised by the global token count
  std::vector<int> blocks;
  NamedTensors on_device = device_lora(run, &blocks);
  run.reducer = std::make_unique<ddp::GradReducer>(std::move(on_device), *run.comm, ro, std::move(blocks));
}

}  // namespace

Run setup_run(const TrainConfig& cfg, const model::ModelConfig& model_config, ddp::World& world) {
  Run run;
  const auto& wi = world.info();
  run.device = pick_device(wi.local_rank, wi.local_size);
  const ComputeChoice compute = resolve_compute(cfg, run.device.is_cuda(), device_has_bf16(run.device));
  check_gpu_served(run.device, compute);
  if (wi.rank == 0) log::info(std::string("compute: ") + compute_name(compute.dtype) + " (" + compute.why + ")");
  RunSpec asked = resolve_run_spec(cfg, model_config, compute.dtype, run.device.is_cuda(), wi.local_size);
  decide_expert_gemm(asked, run.device);
  size_thread_pool(wi.local_size);
  at::manual_seed(static_cast<std::uint64_t>(cfg.seed));
  PlanFit fit = check_memory_plan(cfg, asked, run.device);
  run.spec = fit.spec;
  run.adapter = adapter_record(cfg);
  if (run.spec.offload) check_host_memory_for_homes(cfg, run.spec, world, run.device);
  load_run_data(cfg, run, wi);
  fit.graphs.counts_on_host = load_model(cfg, run, world);
  decide_cuda_graphs(run.spec, fit.graphs);
  start_or_resume(cfg, run);
  start_data_parallel(cfg, run, world);
  return run;
}

}  // namespace eo
