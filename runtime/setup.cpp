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
#include "runtime/data/batcher.h"
#include "runtime/data/jsonl.h"
#include "runtime/data/tokens.h"
#include "runtime/device.h"
#include "runtime/dist/comm.h"
#include "runtime/dist/home_sharing.h"
#include "runtime/dist/reducer.h"
#include "runtime/dist/world.h"
#include "runtime/optimizer.h"
#include "runtime/plan.h"
#include "runtime/plan_fixes.h"
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

// One list of datasets (datasets or test_datasets) as one document source; token ids are checked
// against the vocabulary here, before training starts, with the file and line that is wrong. The
// axolotl formats are read from their prepared cache and, as axolotl does, a completion text is
// cut into sequence_len pieces while a longer row of the other formats is dropped (and counted).
std::shared_ptr<const data::DocumentSource> load_documents(const TrainConfig& cfg, const std::vector<DatasetSpec>& list,
                                                           std::int64_t vocab) {
  std::vector<std::shared_ptr<const data::DocumentSource>> parts;
  const std::size_t L = static_cast<std::size_t>(cfg.sequence_len);
  for (const auto& d : list) {
    if (d.type == "tokens") {
      parts.push_back(std::make_shared<data::TokenFileDocuments>(d.path, data::parse_token_dtype(d.dtype, d.path),
                                                                 d.eos_token_id, cfg.sequence_len, vocab));
      continue;
    }
    EO_CHECK(!d.formatted() || !d.prepared.empty(), "dataset ", d.path, " (type ", d.type, ") was not tokenised");
    std::vector<data::Example> examples;
    std::size_t rows = 0, dropped = 0;
    for (auto& line : data::read_tokenized_jsonl(d.formatted() ? d.prepared : d.path, vocab)) {
      ++rows;
      const std::size_t n = line.input_ids.size();
      if (d.formatted() && d.type != "completion" && n > L) {
        ++dropped;
        continue;
      }
      for (std::size_t at = 0; at < n; at += (d.type == "completion" ? L : n)) {
        const std::size_t e = d.type == "completion" ? std::min(n, at + L) : n;
        data::Example ex;
        ex.input_ids.assign(line.input_ids.begin() + at, line.input_ids.begin() + e);
        ex.labels.assign(line.labels.begin() + at, line.labels.begin() + e);
        examples.push_back(std::move(ex));
      }
    }
    if (dropped > 0)
      log::info("dataset " + d.path + ": " + std::to_string(dropped) + " of " + std::to_string(rows) +
                " rows are longer than sequence_len " + std::to_string(L) + " tokens and are dropped (as axolotl does)");
    if (examples.empty())
      throw UsageError("dataset " + d.path + ": every row is longer than sequence_len " + std::to_string(L) +
                       " tokens; raise sequence_len");
    // In a mix, a dataset that trains nothing would hide behind the others (the Batcher checks
    // the mix as a whole): each must have a target token (a label past its sequence's first).
    if (list.size() > 1 &&
        std::none_of(examples.begin(), examples.end(), [&](const data::Example& ex) {
          for (std::size_t t = 1; t < ex.labels.size() && t < L; ++t)
            if (ex.labels[t] != data::kIgnoreIndex) return true;
          return false;
        }))
      throw UsageError("dataset " + d.path + " (type " + d.type + ", one of " + std::to_string(list.size()) +
                       " in datasets) has no trainable token: every label is " + std::to_string(data::kIgnoreIndex) +
                       (d.formatted() ? " (roles_to_train / train_on_inputs / train_on_eos mark no token of it for training)"
                                      : "") + ". Fix its labels or remove it from the mix.");
    parts.push_back(std::make_shared<data::InMemoryDocuments>(std::move(examples), d.path));
  }
  if (parts.size() == 1) return parts[0];
  return std::make_shared<data::ConcatDocuments>(std::move(parts));
}

// val_set_size: a seeded shuffle of the training documents (epoch_permutation(n, seed, -1)); the
// last ones are held out. Both parts keep the documents' original order.
std::pair<std::shared_ptr<const data::DocumentSource>, std::shared_ptr<const data::DocumentSource>> split_documents(
    const std::shared_ptr<const data::DocumentSource>& docs, double val_set_size, std::int64_t seed) {
  const std::size_t n = docs->num_documents();
  const auto held = static_cast<std::size_t>(val_set_size < 1 ? std::ceil(val_set_size * double(n)) : val_set_size);
  if (held == 0 || held >= n)
    throw UsageError("val_set_size " + std::to_string(val_set_size) + " holds out " + std::to_string(held) + " of " +
                     std::to_string(n) + " documents; it must leave at least one for training and one for evaluation");
  const std::vector<std::size_t> perm = data::epoch_permutation(n, seed, -1);
  std::vector<std::size_t> train(perm.begin(), perm.end() - static_cast<std::ptrdiff_t>(held));
  std::vector<std::size_t> eval(perm.end() - static_cast<std::ptrdiff_t>(held), perm.end());
  std::sort(train.begin(), train.end());
  std::sort(eval.begin(), eval.end());
  return {std::make_shared<data::SubsetDocuments>(docs, std::move(train), docs->name()),
          std::make_shared<data::SubsetDocuments>(docs, std::move(eval), docs->name() + " (val_set_size)")};
}

// What disk homes are made from, for their header: a file made from another checkpoint or with
// other quantisation settings is rebuilt, naming the key that differs. (Every block's checksum is
// compared too; these say why in words.)
std::map<std::string, std::string> disk_homes_identity(const RunSpec& spec) {
  const TrainConfig& cfg = *spec.cfg;
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
          {"experts", spec.expert_format == QuantFormat::Mxfp4   ? "MXFP4 (the checkpoint's)"
                      : spec.expert_format == QuantFormat::Nvfp4 ? "NVFP4 (the checkpoint's)"
                                                                 : "NF4"},
          {"bnb_4bit_blocksize", std::to_string(cfg.bnb_4bit_blocksize)},
          {"bnb_4bit_use_double_quant", cfg.bnb_4bit_use_double_quant ? "true" : "false"}};
}

// Moves the model's NF4 experts into this rank's homes and streams them from there.
std::shared_ptr<offload::ExpertOffloader> start_offload(model::MoeModel& model, const RunSpec& spec, const at::Device& device,
                                                        dist::World& world) {
  const TrainConfig& cfg = *spec.cfg;
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
  // auto: sized after the first step, once the activation peak is known (see size_auto_budget).
  oo.vram_budget_bytes = spec.budget_auto ? 0 : spec.budget_bytes;
  if (!device.is_cuda() && oo.vram_budget_bytes > 0)
    log::info("expert_offload_vram_budget applies to GPU memory; on the CPU the 'device' slots are host memory too");
  if (spec.homes == offload::HomesKind::PerNumaNode) {
    const dist::HomeGroup g = dist::home_group(world, device);
    oo.sharing = dist::make_home_sharing(world, g);
    log::info("expert homes: one copy per NUMA node, shared by " + std::to_string(g.size) + " rank(s) (leader: rank " +
              std::to_string(g.leader) + ")");
  }
  if (spec.homes == offload::HomesKind::Disk) {
    const dist::HomeGroup g = dist::home_group(world, device, /*by_numa_node=*/false);
    oo.sharing = dist::make_home_sharing(world, g);
    oo.disk = offload::DiskHomesOptions{};
    oo.disk->dir = cfg.expert_offload_disk_path;
    oo.disk->identity = disk_homes_identity(spec);
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
void check_host_memory_for_homes(const RunSpec& spec, dist::World& world, const at::Device& device) {
  const TrainConfig& cfg = *spec.cfg;
  const QuantFormat format = spec.expert_format.value_or(QuantFormat::Nf4);
  const std::int64_t per_rank =
      offload::estimate_home_bytes(spec.model, cfg.bnb_4bit_blocksize, cfg.bnb_4bit_use_double_quant, format);
  // The ring as the engine sizes it (offload/engine.cpp: the slots asked for).
  const offload::DiskHomesSize disk =
      offload::estimate_disk_homes(spec.model, cfg.bnb_4bit_blocksize, cfg.bnb_4bit_use_double_quant,
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
  const int copies = shared ? dist::home_group(world, device).copies_on_host : static_cast<int>(v[1]);
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
// before any is logged; CUDA graphs are decided last, from the room the plan leaves.
PlanFit check_memory_plan(const RunSpec& spec, const at::Device& device) {
  const TrainConfig& cfg = *spec.cfg;
  const bool gpu = device.is_cuda();
  if (gpu) set_device_memory_limit(device, cfg.device_memory_limit);
  const bool limited = cfg.device_memory_limit > 0;
  if (!limited && !gpu) {
    PlanFit fit{spec, 0, false, "the CPU"};
    std::tie(fit.cuda_graphs, fit.cuda_graphs_why) = resolve_cuda_graphs(fit);
    return fit;
  }
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
  PlanFit fit{fitted.spec, extra, fits && plan.device_peak + plan.margin + extra <= available, what};
  std::tie(fit.cuda_graphs, fit.cuda_graphs_why) = resolve_cuda_graphs(fit);

  if (fitted.down_from > 0)
    log::info("expert_bank_reuse: auto -> down: keeping gate's and up's dequantised banks for the backward would not fit (" +
              human_bytes(fitted.down_from) + " + margin); the backward dequantises them again");
  if (fitted.sliced_from > 0)
    log::info("expert_dequant_chunk: auto -> " + std::to_string(kAutoBankSliceBytes >> 20) + "MiB: the whole bank would not fit (" +
              human_bytes(fitted.sliced_from) + " + margin); slices of the experts are dequantised one at a time (slower)");
  log::info("memory plan: peak " + human_bytes(plan.device_peak) + " + margin " + human_bytes(plan.margin) + " of " + what +
            (plan.host_pinned > 0 ? "; " + human_bytes(plan.host_pinned) + " pinned host RAM per rank" : std::string()));
  if (fits) return fit;
  throw UsageError("this run does not fit: the plan needs " + human_bytes(plan.device_peak) + " + a margin of " +
                   human_bytes(plan.margin) + " of device memory, " + what + ".\n" + describe_plan(plan, available) +
                   describe_fixes(plan_fixes(spec, available), what) +
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

std::pair<bool, std::string> resolve_cuda_graphs(const PlanFit& fit) {
  const RunSpec& spec = fit.spec;
  if (!spec.on_gpu) return {false, "off (a CPU run)"};
  if (spec.cuda_graphs == Setting::Off) return {false, "off (cuda_graphs: false)"};
  if (!spec.graphs_blocked.empty()) return {false, "off (" + spec.graphs_blocked + ")"};
  const std::string extra = human_bytes(fit.graphs_extra) + " more device memory for their pool";
  if (spec.cuda_graphs == Setting::On) return {true, "on (cuda_graphs: true; up to " + extra + ")"};
  // Offloaded runs too: their step is transfer-bound, but each copy waits for the slot's last
  // reader, so a late kernel launch delays the copy stream. Measured (Qwen3-30B-A3B, mb 1, H200,
  // every host core kept busy by another process): eager 1.012x / 1.062x its idle step, graphs
  // 0.996x / 0.998x, idle step times equal. Graphs cost device memory only where the plan has it.
  if (!fit.graphs_fit)
    return {false, "off (auto: " + extra + " does not fit in " + fit.available + "; cuda_graphs: true forces them)"};
  return {true, "on (auto; " + extra + ")"};
}

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

std::string resolve_expert_gemm(const RunSpec& spec, const at::Device& device) {
  const Compute compute = spec.compute;
  const bool asked_portable = spec.expert_gemm == ExpertGemmSetting::Portable;
  if (!device.is_cuda()) {
    if (asked_portable)
      throw UsageError("expert_gemm: portable runs on a CUDA GPU (bf16 on sm_80 or newer, fp16 on sm_75 or newer); this "
                       "run is on the CPU (use auto)");
    model::set_expert_gemm(model::ExpertGemm::kTorch);
    return "libtorch's (a CPU run)";
  }
  const GpuCard card = gpu_card(device);
  const std::string sm = "sm_" + std::to_string(card.major) + std::to_string(card.minor);
  const std::string per_expert = "libtorch's GEMM per expert, the routing counts read on the host (";
  if (compute == Compute::Fp32) {
    if (asked_portable)
      throw UsageError("expert_gemm: portable computes in bf16 or fp16; this run computes in fp32: use expert_gemm: auto, "
                       "or bf16 / fp16 compute");
    model::set_expert_gemm(model::ExpertGemm::kTorch);
    return per_expert + "fp32 compute: the grouped kernels take bf16 and fp16)";
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
  model::set_expert_gemm(kernel);
  if (!model::grouped_expert_gemm_runs(dtype, device)) return per_expert + why + ")";
  if (kernel == model::ExpertGemm::kPortable)
    return "portable CUTLASS grouped GEMM in " + name + ", sizes read on the device (" + why + ")";
  if (model::auto_expert_gemm(card.major, dtype) == model::ExpertGemm::kTorch)
    return "PyTorch's at::_grouped_mm, device-scheduled on " + sm + " (" + why + ")";
  return "PyTorch's at::_grouped_mm, which on " + sm + " reads the routing counts on the host and loops over experts (" +
         why + "; auto picks the portable kernel)";
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

Run setup_run(const TrainConfig& cfg, const model::ModelConfig& model_config, dist::World& world) {
  Run run;
  const auto& wi = world.info();
  run.device = pick_device(wi.local_rank, wi.local_size);
  const ComputeChoice compute = resolve_compute(cfg, run.device.is_cuda(), device_has_bf16(run.device));
  check_gpu_served(run.device, compute);
  if (wi.rank == 0) log::info(std::string("compute: ") + compute_name(compute.dtype) + " (" + compute.why + ")");
  const RunSpec asked = resolve_run_spec(cfg, model_config, compute.dtype, run.device.is_cuda(), wi.local_size);
  run.expert_gemm_why = resolve_expert_gemm(asked, run.device);
  size_thread_pool(wi.local_size);
  const at::Device device = run.device;
  at::manual_seed(static_cast<std::uint64_t>(cfg.seed));
  const PlanFit fit = check_memory_plan(asked, device);
  run.spec = fit.spec;
  const RunSpec& spec = run.spec;
  const bool bf16 = spec.compute == Compute::Bf16;
  run.cuda_graphs = fit.cuda_graphs;
  run.cuda_graphs_why = fit.cuda_graphs_why;
  const auto t_load = Clock::now();
  if (spec.offload) check_host_memory_for_homes(spec, world, device);

  // ---- data: read and checked before any weight, so a bad file costs no loading time
  const std::int64_t vocab = spec.model.vocab;
  auto docs = load_documents(cfg, cfg.datasets, vocab);
  std::shared_ptr<const data::DocumentSource> eval_docs;
  if (cfg.val_set_size) std::tie(docs, eval_docs) = split_documents(docs, *cfg.val_set_size, cfg.seed);
  if (!cfg.test_datasets.empty()) eval_docs = load_documents(cfg, cfg.test_datasets, vocab);
  if (eval_docs) {
    data::BatcherOptions eo;
    eo.sequence_len = cfg.sequence_len;
    eo.sample_packing = cfg.eval_sample_packing.value_or(cfg.sample_packing);
    eo.shuffle = false;
    run.eval_rows = std::make_unique<data::Batcher>(eval_docs, eo);
    log::info("evaluation: " + std::to_string(eval_docs->num_documents()) + " documents -> " +
              std::to_string(run.eval_rows->num_sequences()) + " sequences of " + std::to_string(cfg.sequence_len) +
              " tokens (" + eval_docs->name() + ")");
  }
  data::BatcherOptions bo;
  bo.sequence_len = cfg.sequence_len;
  bo.sample_packing = cfg.sample_packing;
  bo.micro_batch_size = cfg.micro_batch_size;
  bo.seed = cfg.seed;
  bo.rank = wi.rank;
  bo.world_size = wi.world_size;
  run.batcher = std::make_unique<data::Batcher>(docs, bo);
  data::Batcher& batcher = *run.batcher;
  const std::int64_t per_epoch = batcher.num_batches_per_epoch();
  const std::int64_t accum = cfg.gradient_accumulation_steps;
  run.accum = accum;
  if (per_epoch < accum)  // one optimizer step would see some sequences twice
    throw UsageError("dataset " + docs->name() + " has " + std::to_string(batcher.num_sequences()) + " sequences of " +
                     std::to_string(cfg.sequence_len) + " tokens; one optimizer step needs " +
                     std::to_string(cfg.micro_batch_size * accum * wi.world_size) + " (micro_batch_size " +
                     std::to_string(cfg.micro_batch_size) + " x gradient_accumulation_steps " + std::to_string(accum) + " x " +
                     std::to_string(wi.world_size) + " ranks). Add data or lower micro_batch_size, gradient_accumulation_steps "
                     "or the number of ranks.");
  const std::int64_t total_steps = run.total_steps =
      cfg.max_steps ? *cfg.max_steps
                    : std::max<std::int64_t>(1, static_cast<std::int64_t>(std::ceil(cfg.num_epochs * double(per_epoch) / double(accum))));
  run.warmup = resolve_warmup_steps(cfg, total_steps);
  log::info("data: " + std::to_string(docs->num_documents()) + " documents -> " + std::to_string(batcher.num_sequences()) +
            " sequences of " + std::to_string(cfg.sequence_len) + " tokens; " + std::to_string(per_epoch) +
            " micro-batches per epoch; " + std::to_string(total_steps) + " optimizer steps");

  // ---- model
  model::LoadOptions lo;
  lo.dtype = bf16 ? at::kBFloat16 : spec.compute == Compute::Fp16 ? at::kHalf : at::kFloat;
  lo.load_in_4bit = cfg.load_in_4bit;
  lo.blocksize = cfg.bnb_4bit_blocksize;
  lo.double_quant = cfg.bnb_4bit_use_double_quant;
  lo.expert_quant = model::expert_quant_named(cfg.expert_quant);  // the loader logs the experts' format
  lo.expert_bank_bytes = spec.bank_bytes;
  lo.device = device;
  lo.experts_on_host = cfg.expert_offload;
  if (cfg.synthetic_weights) lo.random_seed = static_cast<std::uint64_t>(cfg.seed);
  log::info("loading " + cfg.base_model + (cfg.load_in_4bit ? " (quantising decoder linears to NF4)" : "") + " on " +
            describe_device(device) + ", " + compute_name(spec.compute) + " compute");
  run.model = model::MoeModel::load(cfg.base_model, spec.model, lo);
  auto& model = run.model;
  const auto& mc = model->config();
  if (spec.offload) run.offloader = start_offload(*model, spec, device, world);
  const auto& offloader = run.offloader;
  model->add_lora(lora_spec(cfg));
  run.lora = model->lora_parameters();
  const NamedTensors& lora = run.lora;
  EO_CHECK(!lora.empty(), "no LoRA target found in ", cfg.base_model, " for lora_target_modules [",
           join(cfg.lora_target_modules, ", "), "]");
  std::int64_t trainable = 0;
  for (const auto& [n, p] : lora) {
    trainable += p.numel();
    run.lora_blocks.push_back(block_of_parameter(n));
  }
  log::info("model " + mc.model_type + ": " + std::to_string(model->num_layers()) + " layers, LoRA r=" +
            std::to_string(cfg.lora_r) + " on " + std::to_string(lora.size() / 2) + " modules (" +
            std::to_string(trainable) + " trainable parameters); loaded in " + std::to_string(seconds_since(t_load)).substr(0, 5) + " s");
  if (cfg.nvfp4_merge_aware) {
    const auto [linears, experts] = model->enable_merge_aware();
    log::info("nvfp4_merge_aware: " + std::to_string(linears) + " NVFP4 linears and " + std::to_string(experts) +
              " NVFP4 expert matrices (per MoE block) train through their NVFP4-snapped effective weight, from step " +
              merge_aware_start_text(cfg) +
              " on; each snapped bank is dense in the compute dtype, kept for its backward");
    if (run.cuda_graphs) {
      run.cuda_graphs = false;
      run.cuda_graphs_why = "off (nvfp4_merge_aware forms its snapped weights anew in every forward)";
    }
  }
  // The grouped expert GEMMs read the routing counts on the device; where they do not run (fp32
  // compute, fp16 without the portable kernel) or the experts' LoRA cannot join them (r not a
  // multiple of 8: its [rows, r] operands must be 16-byte aligned), the GPU runs each MoE block
  // expert by expert, reading the counts on the host, which no CUDA graph can capture. Said once,
  // with the fix.
  const bool grouped = device.is_cuda() && model::grouped_expert_gemm_runs(lo.dtype, device);
  if (device.is_cuda() && !grouped && run.cuda_graphs) {
    run.cuda_graphs = false;
    run.cuda_graphs_why = std::string("off (the expert GEMMs run expert by expert in ") + compute_name(spec.compute) +
                          ", reading the routing counts on the host)";
  }
  if (grouped && !model->expert_lora_grouped_ok()) {
    const std::string r = std::to_string(cfg.lora_r);
    log::warn("lora_r " + r + " is not a multiple of 8, so the experts' LoRA cannot run as grouped GEMMs: each MoE block "
              "runs expert by expert with a host read of its routing counts, several times slower; lora_r 8, 16, 32 or 64 avoids it");
    if (run.cuda_graphs) {
      run.cuda_graphs = false;
      run.cuda_graphs_why = "off (lora_r " + r + " is not a multiple of 8: the per-expert path reads counts on the host)";
    }
  }

  // ---- optimizer and resume
  run.optimizer = std::make_unique<Optimizer>(lora, cfg);
  const std::string resume = resume_folder(cfg);
  if (resume.empty() && !cfg.lora_model_dir.empty()) {
    model->load_adapter_weights(cfg.lora_model_dir);  // its config was checked against this one's
    log::info("LoRA weights from " + cfg.lora_model_dir + " (lora_model_dir); fresh optimizer state");
  }
  if (!resume.empty()) {
    TrainingState s = resume_lora(resume, lora);
    run.optimizer->load_state(std::map<std::string, at::Tensor>(s.optimizer.begin(), s.optimizer.end()));
    restore_rng(s.rng, device);
    batcher.restore(s.data_cursor);
    run.step = s.step;
    run.resumed_from = resume;
    run.resumed_extra = s.extra.is_object() ? s.extra : nlohmann::json::object();
    log::info("resumed from " + resume + " at step " + std::to_string(run.step));
  }

  // ---- data parallel: rank 0's LoRA everywhere, homes checked equal, gradients in buckets.
  // The expert homes are never sent: each rank loaded them itself; a checksum proves they agree.
  run.comm = std::make_unique<dist::Communicator>(world, device, cfg.ddp_timeout);
  dist::Communicator& comm = *run.comm;
  if (wi.world_size > 1) {
    {
      at::NoGradGuard ng;
      dist::broadcast_parameters(lora, comm, 0);
    }
    if (offloader) {
      std::vector<dist::HostBytes> homes;
      for (const auto& [ptr, n] : offloader->home_ranges()) homes.push_back({ptr, n});
      dist::check_same_bytes(homes, comm, "expert homes (did every rank load the same checkpoint?)");
    }
    std::string homes;
    if (offloader && offloader->homes_on_disk()) {
      const auto [dev, ino] = offloader->homes_file_id();
      const auto ids = world.allgather(wi.hostname + " " + std::to_string(dev) + ":" + std::to_string(ino));
      const std::set<std::string> distinct(ids.begin(), ids.end());
      homes = ", expert homes identical on every rank: " + std::to_string(distinct.size()) + " disk file(s) of " +
              human_bytes(double(offloader->home_bytes())) + " read by " + std::to_string(wi.world_size) + " ranks, " +
              human_bytes(double(offloader->host_ram_bytes())) + " of read buffers per rank";
    } else if (offloader && offloader->homes_shared()) {
      // RAM accounting: the ranks that share a copy must map one and the same memory file.
      const auto [dev, ino] = offloader->homes_file_id();
      const auto ids = world.allgather(wi.hostname + " " + std::to_string(dev) + ":" + std::to_string(ino));
      const std::set<std::string> distinct(ids.begin(), ids.end());
      homes = ", expert homes identical on every rank: " + std::to_string(distinct.size()) + " shared cop" +
              (distinct.size() == 1 ? "y" : "ies") + " of " + human_bytes(double(offloader->home_bytes())) + " mapped by " +
              std::to_string(wi.world_size) + " ranks";
    } else if (offloader) {
      homes = ", expert homes identical on every rank (" + human_bytes(double(offloader->home_bytes())) +
              (device.is_cuda() && cfg.expert_offload_pin_memory ? " pinned" : " pageable") + " per rank, " +
              human_bytes(double(offloader->home_bytes()) * wi.local_size) + " on this node)";
    }
    log::info("data parallel: " + std::to_string(wi.world_size) + " ranks, LoRA broadcast from rank 0" + homes);
  }
  dist::ReducerOptions ro;
  ro.bucket_cap_bytes = static_cast<std::int64_t>(cfg.ddp_bucket_cap_mb) << 20;
  ro.op = dist::ReduceOp::kSum;  // the loss is already normalised by the global token count
  if (wi.world_size > 1) run.reducer = std::make_unique<dist::GradReducer>(lora, comm, ro, run.lora_blocks);
  run.aux_coef = cfg.router_aux_loss_coef.value_or(mc.router_aux_loss_coef);
  return run;
}

}  // namespace eo
