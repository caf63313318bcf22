#include "runtime/plan.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "common/text.h"
#include "models/block_memory.h"
#include "models/linear4bit.h"
#include "models/lm_loss.h"
#include "offload/disk_homes.h"
#include "offload/layout.h"
#include "offload/staging.h"
#include "runtime/expert_lora_offload.h"
#include "runtime/schedule.h"

namespace eo {
namespace {

// The step's shape and settings as the blocks' bytes depend on them.
model::BlockRun block_run(const RunSpec& spec) {
  model::BlockRun run;
  run.micro_batch_size = double(spec.micro_batch_size);
  run.sequence_len = double(spec.sequence_len);
  run.dtype_bytes = spec.compute == Compute::Fp32 ? 4 : 2;  // bf16 and fp16 alike
  run.on_gpu = spec.on_gpu;
  run.load_in_4bit = spec.load_in_4bit;
  run.blocksize = spec.blocksize;
  run.lora = &spec.lora;
  run.lora_all_linear = spec.lora_all_linear;
  run.experts_quantised = spec.expert_format.has_value();  // held 4-bit (NVFP4 without load_in_4bit too)
  run.group_size = spec.offload && spec.group_size > 0 && spec.group_size < spec.model.experts ? spec.group_size : 0;
  run.bank_bytes = spec.bank_bytes;
  run.bank_reuse = spec.bank_reuse;
  return run;
}

std::string count(double n) { return std::to_string(static_cast<long long>(n)); }

// The offloaded experts: the device slots (whole blocks, or groups of a block's experts) and the
// budget's resident blocks, the homes in pinned host RAM (disk: its read ring), and the copies a
// warm step makes, the engine's own staging policy run dry along the step's staging order.
void plan_offloaded_experts(const RunSpec& spec, const std::string& held, MemoryPlan& p) {
  const model::ModelConfig& c = spec.model;
  const int moe_layers = static_cast<int>(spec.moe_layers.size());
  const std::vector<int>& moe_list = spec.moe_layers;
  std::vector<bool> is_moe(static_cast<std::size_t>(c.layers));
  for (int i : moe_list) is_moe[static_cast<std::size_t>(i)] = true;
  const std::vector<int> order = make_step_schedule(int(c.layers), spec.accum, spec.order).staging_order(is_moe);
  int slots = spec.slots;
  double budget = 0;
  if (!spec.budget_auto && spec.budget_bytes > 0)
    budget = std::floor(double(spec.budget_bytes) / p.block_bytes) * p.block_bytes;
  budget = std::min(budget, p.expert_bytes);
  const int resident_count = p.block_bytes > 0 ? int(budget / p.block_bytes) : 0;
  // The blocks within the VRAM budget are resident: the first ones, in layer order, as the engine.
  const std::vector<int> resident(moe_list.begin(),
                                  moe_list.begin() + std::min<std::size_t>(moe_list.size(), resident_count));
  const int streamed = moe_layers - int(resident.size());
  const std::string budget_text = budget > 0 ? " + " + human_bytes(budget) + " of resident blocks" : std::string();
  if (p.group_size > 0) {
    // Streamed in groups (offload/engine.h): two slots of a group (one computes, the next
    // copies), one without prefetch; none when every block is budget-resident.
    slots = resident_count >= moe_layers ? 0 : spec.prefetch ? 2 : 1;
    p.slot_bytes =
        double(offload::expert_group_bytes(c, spec.blocksize, spec.double_quant, p.expert_format, p.group_size));
    p.device.push_back({"experts", double(slots) * p.slot_bytes + budget,
                        std::to_string(slots) + " slot(s) of " + human_bytes(p.slot_bytes) + ", each a group of " +
                            std::to_string(p.group_size) + " of a block's " + std::to_string(c.experts) +
                            " experts (expert_group_size; blocks of " + human_bytes(p.block_bytes) +
                            " stream group by group)" + budget_text + held});
  } else {
    p.slot_bytes = p.block_bytes;
    p.device.push_back({"experts", double(slots) * p.block_bytes + budget,
                        std::to_string(slots) + " slot(s) of " + human_bytes(p.block_bytes) + budget_text + held});
  }
  p.host_pinned = p.expert_bytes;
  p.shared_homes = spec.homes == offload::HomesKind::PerNumaNode;
  if (!moe_list.empty() && p.group_size > 0) {
    // Groups: every group of a streamed block's stagings is copied (forward, recompute), and its
    // backward copies all but the two groups its recompute left in the slots.
    const std::int64_t groups = (c.experts + p.group_size - 1) / p.group_size;
    std::int64_t stagings = 0;
    for (int l : order) stagings += std::find(resident.begin(), resident.end(), l) == resident.end() ? 1 : 0;
    p.copies_per_step =
        stagings * groups + (spec.checkpointing ? stagings / 2 * std::max<std::int64_t>(0, groups - 2) : 0);
  } else if (!moe_list.empty()) {
    p.copies_per_step =
        offload::steady_copies_per_step(order, int(c.layers), std::min(slots, streamed), spec.prefetch, resident);
  }
  if (spec.homes == offload::HomesKind::Disk) {
    const offload::DiskHomesSize z =
        offload::estimate_disk_homes(c, spec.blocksize, spec.double_quant, slots, p.expert_format);
    p.disk_homes = true;
    p.disk_file_bytes = double(z.file_bytes);
    p.disk_ring = z.ring;
    p.disk_ring_bytes = double(z.ring_bytes);
    p.disk_reads_per_step = double(p.copies_per_step) * p.block_bytes;
    p.host_pinned = p.disk_ring_bytes;
  }
}

// The routed experts: NF4, or the checkpoint's MXFP4 / NVFP4 kept (expert_quant; NVFP4 without
// load_in_4bit too); one MoE block's exactly as the offload engine lays them out (offload/layout.h).
void plan_experts(const RunSpec& spec, MemoryPlan& p) {
  const model::ModelConfig& c = spec.model;
  const std::optional<QuantFormat> fmt = spec.expert_format;
  p.expert_format = fmt.value_or(QuantFormat::Nf4);
  const std::string held = !fmt                         ? std::string()
                           : std::string(" (") + quant_format_name(*fmt) +
                                 (quant_format_traits(*fmt).checkpoint_own ? ", the checkpoint's own bytes)" : ")");
  p.block_bytes = double(offload::expert_block_bytes(c, spec.blocksize, spec.double_quant, p.expert_format));
  p.group_size = spec.offload && spec.group_size > 0 && spec.group_size < c.experts ? spec.group_size : 0;
  p.expert_bytes = p.block_bytes * double(spec.moe_layers.size());
  if (spec.offload) return plan_offloaded_experts(spec, held, p);
  // Resident experts are separate tensors (no arena alignment).
  const QuantFormatTraits& sf = quant_format_traits(p.expert_format);
  const double I = double(c.expert_width), H = double(c.hidden), d = spec.compute == Compute::Fp32 ? 4 : 2;
  const double n = I * H;
  const double matrix = !fmt                        ? I * H * d
                        : *fmt == QuantFormat::Nf4 ? std::ceil(n / 2) + std::ceil(n / spec.blocksize) * 4
                                                     : I * H / 2 + I * H / sf.group + sf.per_matrix;
  p.device.push_back(
      {"experts", double(spec.moe_layers.size()) * double(c.experts) * 3 * matrix, "every expert resident" + held});
}

// LoRA: fp32 parameter, gradient and two AdamW moments of what the layers report; with
// expert_lora_offload the experts' state in host RAM (runtime/expert_lora_offload.h) and, on the
// device, the working copies of a few blocks with their gradients.
void plan_lora(const RunSpec& spec, double lora_params, double expert_lora_params, MemoryPlan& p) {
  const int moe_layers = static_cast<int>(spec.moe_layers.size());
  if (spec.expert_lora_offload && expert_lora_params > 0) {
    const double copies = std::min<double>(kExpertLoraWorkingCopies, moe_layers);
    const ExpertLoraBytes b = expert_lora_bytes(expert_lora_params, expert_lora_params / moe_layers);
    p.host_lora = b.host;
    p.expert_lora_params = expert_lora_params;
    p.device.push_back({"lora", lora_params * 16 + b.device * copies / kExpertLoraWorkingCopies,
                        count(lora_params) + " parameters x 16 bytes + the experts' LoRA of " + count(copies) +
                            " block(s) x 8 bytes (the rest in host RAM)"});
    return;
  }
  lora_params += expert_lora_params;
  p.device.push_back({"lora", lora_params * 16, count(lora_params) + " parameters x 16 bytes"});
}

// Block inputs kept by checkpointing (embedding output .. last block) and the RoPE tables of every
// micro-batch of the step (the layer-major step keeps all g until backward; micro-batch-major,
// one), the hidden state or incoming gradient of each, and the outgoing gradient of the block under
// backward. With activation_offloading the inputs wait in pinned host RAM and about two blocks'
// worth are on the device (the one in backward and the one being copied back).
void plan_checkpoints(const RunSpec& spec, MemoryPlan& p) {
  const model::ModelConfig& c = spec.model;
  const double N = double(spec.micro_batch_size) * double(spec.sequence_len), H = double(c.hidden);
  const double d = spec.compute == Compute::Fp32 ? 4 : 2;
  const double g = spec.order == StepOrder::LayerMajor ? double(spec.accum) : 1.0;
  const double kept = spec.activation_offloading ? std::min(2.0, double(c.layers)) : double(c.layers);
  const double checkpoints = (g * (kept + 1) + 2) * N * H * d + g * 2 * N * model::rope_table_columns(c) * d;
  p.device.push_back({"checkpoints", checkpoints,
                      count(kept) + " block inputs of [tokens, hidden] x " + count(g) + " micro-batch(es) + gradients" +
                          (spec.activation_offloading ? " (the rest parked in host RAM)" : "")});
  if (spec.activation_offloading) p.host_pinned += g * double(c.layers) * N * H * d;
  if (const model::BlockContextBytes ctx =
          model::block_context_bytes(c, double(spec.micro_batch_size), double(spec.sequence_len), g);
      ctx.bytes > 0)
    p.device.push_back({ctx.name, ctx.bytes, ctx.what});
}

// The head: the normed hidden and per-row log-sum-exp saved, the targets; one chunk of logits in
// flight (forward: the GEMM's output, its fp32 copy and logsumexp's fp32 temporary; backward: the
// GEMM's output, its fp32 softmax gradient and that cast back), the hidden's gradient. It runs
// before the blocks' backward, so the peak holds the larger of head and block.
MemoryPart head_part(const RunSpec& spec) {
  const double H = double(spec.model.hidden), V = double(spec.model.vocab), d = spec.compute == Compute::Fp32 ? 4 : 2;
  const double rows = double(spec.micro_batch_size) * double(std::max(1, spec.sequence_len - 1));
  const double chunk = double(model::loss_chunk_rows(std::int64_t(rows), std::int64_t(V)));
  const double head = rows * (H * d + 4 + 8) +
                      std::max(chunk * V * (d + 4 + 4), chunk * V * (d + 4 + d) + rows * H * d) + rows * H * d;
  return {"head", head, "chunked cross entropy, " + count(chunk) + " rows per chunk"};
}

MemoryPart block_part(const model::BlockPeak& b, int group_size) {
  std::string what =
      "one block's recompute + backward, peak at the " + b.phase + " (" + count(b.pairs) + " token-expert pairs";
  if (b.bank > 0)
    what += ", dequantised bank " + human_bytes(b.bank) +
            (group_size > 0 ? " (a group of " + std::to_string(group_size) + " experts)" : std::string());
  if (b.banks_kept) what += ", 2 more kept from the recompute for its backward";
  if (b.attn_math_saved > 0)
    what += ", SDPA's math path for heads over 256 keeps " + human_bytes(b.attn_math_saved) + " in fp32";
  return {"block", b.bytes, what + ")"};
}

}  // namespace

MemoryPlan plan_memory(const TrainConfig& cfg, const model::ModelConfig& mc, Compute compute, int ranks_per_node,
                       bool on_gpu) {
  return plan_memory(resolve_run_spec(cfg, mc, compute, on_gpu, ranks_per_node));
}

// The plan sums what the blocks report (models/block_memory.h) and what the offload engine lays
// out (offload/layout.h); it adds the parts outside the blocks: embeddings, lm_head, the final
// norm, checkpoints, the head and the CUDA graphs' buffers.
MemoryPlan plan_memory(const RunSpec& spec) {
  const model::ModelConfig& c = spec.model;
  MemoryPlan p;
  p.on_gpu = spec.on_gpu;
  p.compute = spec.compute;
  p.ranks_per_node = spec.ranks_per_node;
  const model::BlockRun run = block_run(spec);
  const double d = run.dtype_bytes, H = double(c.hidden), V = double(c.vocab);

  // Frozen weights on the device (on a GPU the untied input embedding table stays in host memory:
  // model::LoadOptions::embeddings_on_host) and the LoRA parameters, as each layer reports them.
  const bool host_embeddings = p.on_gpu && !c.tie_word_embeddings;
  double weights = V * H * d * (c.tie_word_embeddings || host_embeddings ? 1 : 2) + H * d;
  double lora_params = 0, expert_lora_params = 0;
  std::vector<bool> is_moe(static_cast<std::size_t>(c.layers));
  for (int i : spec.moe_layers) is_moe[static_cast<std::size_t>(i)] = true;
  for (int i = 0; i < c.layers; ++i) {
    const model::BlockParams b = model::block_params(c, i, is_moe[static_cast<std::size_t>(i)], run);
    weights += b.frozen;
    lora_params += b.lora;
    expert_lora_params += b.expert_lora;
  }
  p.device.push_back({"weights", weights,
                      std::string(host_embeddings ? "lm_head (input embeddings in host RAM)" : "embeddings, lm_head") +
                          ", norms, routers, attention" + (spec.load_in_4bit ? " (NF4)" : "")});
  plan_experts(spec, p);
  plan_lora(spec, lora_params, expert_lora_params, p);
  plan_checkpoints(spec, p);
  // One block under backward (nothing fitted: each term names a tensor of the code), and the head.
  const model::BlockPeak block = model::block_peak(c, run, static_cast<int>(spec.moe_layers.size()));
  p.device.push_back(block_part(block, p.group_size));
  const MemoryPart head = head_part(spec);
  p.device.push_back(head);

  // CUDA graphs (runtime/block_graphs.h) replay on static buffers that are copies beside the eager
  // tensors they stand for: the block input (shared by forward, recompute and the loss), the
  // incoming gradient and the output (shared by every use), each [tokens, hidden], and the two RoPE
  // tables. Planned wherever graphs may run (cuda_graphs not false, and the uses can replay); where
  // auto turns them off for want of room, the plan is over by these bytes. Their temporaries live
  // in the graphs' own pool, which the fit check adds.
  const double N = run.micro_batch_size * run.sequence_len;
  if (spec.on_gpu && spec.cuda_graphs != Setting::Off && spec.graphs_blocked.empty())
    p.device.push_back({"graphs", 3 * N * H * d + 2 * N * model::rope_table_columns(c) * d,
                        "CUDA graphs' static buffers: block input, gradient, output, RoPE tables "
                        "(cuda_graphs: false drops them)"});
  // The portable grouped GEMM's problem table (models/expert_gemm_cuda.h): 60 bytes per expert for
  // each GEMM in flight; a few of a block's GEMMs may be queued at once.
  if (spec.on_gpu && spec.expert_gemm != ExpertGemmSetting::Torch)
    p.device.push_back({"expert gemm", 8.0 * 64 * double(c.experts),
                        "portable grouped GEMM problem tables (expert_gemm: torch has none)"});

  p.device_peak = 0;
  for (const auto& part : p.device)
    if (part.name != "block" && part.name != "head") p.device_peak += part.bytes;
  p.device_peak += std::max(block.bytes, head.bytes);
  // What the caching allocator holds beyond what it hands out at that peak (block rounding,
  // segments split by earlier allocations, cuBLAS workspaces): device_memory_limit caps the held
  // bytes, so the start-up check wants peak + margin. Measured on the H200 (docs/benchmarks.md):
  // held exceeds the allocated peak by 3-26%, but the allocator frees its cached blocks and
  // retries before it fails, so only fragmentation is fatal; 15% + 256 MiB covers the rows
  // measured short of the worst cache.
  p.margin = spec.on_gpu ? 0.15 * p.device_peak + double(std::int64_t(256) << 20) : 0;
  return p;
}

FittedPlan fit_plan(const RunSpec& spec, double available) {
  FittedPlan f{spec, plan_memory(spec)};
  const bool gpu = spec.on_gpu;
  auto over = [&] { return f.plan.device_peak + f.plan.margin > available; };
  if (gpu && spec.bank_reuse_auto && over()) {
    RunSpec down = f.spec;
    down.bank_reuse = bank_reuse_in_effect(gpu, down.bank_bytes, down.checkpointing, model::BankReuse::Down);
    if (const MemoryPlan p = plan_memory(down); p.device_peak < f.plan.device_peak) {
      f.down_from = f.plan.device_peak;
      f.plan = p;
      f.spec = down;
    }
  }
  // expert_group_size: auto: the largest group (the block's experts halved, rounded up, until one
  // does) whose plan fits; where none does, the smallest group if it lowers the peak.
  if (gpu && spec.offload && spec.group_auto && f.spec.group_size == 0 && over()) {
    FittedPlan best = f;
    for (int g = (spec.model.experts + 1) / 2; g >= 1; g = g == 1 ? 0 : (g + 1) / 2) {
      RunSpec grouped = f.spec;
      grouped.group_size = g;
      const MemoryPlan p = plan_memory(grouped);
      if (p.device_peak >= best.plan.device_peak) continue;
      best.spec = grouped;
      best.plan = p;
      if (p.device_peak + p.margin <= available) break;
    }
    if (best.spec.group_size > 0) {
      best.grouped_from = f.plan.device_peak;
      f = best;
    }
  }
  if (gpu && spec.bank_auto && over()) {
    RunSpec sliced = f.spec;
    sliced.bank_bytes = kAutoBankSliceBytes;
    sliced.bank_reuse = bank_reuse_in_effect(gpu, sliced.bank_bytes, sliced.checkpointing, f.spec.bank_reuse);
    if (const MemoryPlan p = plan_memory(sliced); p.device_peak < f.plan.device_peak) {
      f.sliced_from = f.plan.device_peak;
      f.plan = p;
      f.spec = sliced;
    }
  }
  return f;
}

std::string describe_plan(const MemoryPlan& plan, double vram) {
  std::ostringstream os;
  char line[256];
  os << "memory plan (per rank, " << compute_name(plan.compute) << " compute):\n";
  for (const auto& part : plan.device) {
    // The description streamed after the fixed columns: a long one must not be cut (or lose its newline).
    std::snprintf(line, sizeof line, "  %-12s %10s  ", part.name.c_str(), human_bytes(part.bytes).c_str());
    os << line << part.what << "\n";
  }
  std::snprintf(line, sizeof line, "  %-12s %10s  predicted allocator peak: all but block and head, plus the larger of those\n", "peak VRAM",
                human_bytes(plan.device_peak).c_str());
  os << line;
  if (plan.margin > 0) {
    std::snprintf(line, sizeof line, "  %-12s %10s  allocator headroom the start-up check adds (15%% + 256 MiB)\n", "margin",
                  human_bytes(plan.margin).c_str());
    os << line;
  }
  if (plan.disk_homes) {
    std::snprintf(line, sizeof line, "  %-12s %10s  per rank: the disk homes' read ring, %d buffers of %s (%s for %d rank(s) on a node)%s\n",
                  "pinned host", human_bytes(plan.host_pinned).c_str(), plan.disk_ring,
                  human_bytes(plan.disk_ring_bytes / std::max(1, plan.disk_ring)).c_str(),
                  human_bytes(plan.host_pinned * plan.ranks_per_node).c_str(), plan.ranks_per_node,
                  plan.host_pinned > plan.disk_ring_bytes ? " (+ parked block inputs)" : "");
    os << line;
    std::snprintf(line, sizeof line, "  %-12s %10s  one homes file per host on the drive (expert_offload_disk_path)\n", "disk homes",
                  human_bytes(plan.disk_file_bytes).c_str());
    os << line;
    std::snprintf(line, sizeof line,
                  "  %-12s %10s  per rank and optimizer step: %lld block copies read from the drive (%s per step for %d rank(s) on a node)\n",
                  "disk reads", human_bytes(plan.disk_reads_per_step).c_str(), static_cast<long long>(plan.copies_per_step),
                  human_bytes(plan.disk_reads_per_step * plan.ranks_per_node).c_str(), plan.ranks_per_node);
    os << line;
  } else if (plan.host_pinned > 0 && plan.shared_homes) {
    std::snprintf(line, sizeof line, "  %-12s %10s  per NUMA node: one copy of the homes mapped by its %d rank(s)%s\n", "pinned host",
                  human_bytes(plan.host_pinned).c_str(), plan.ranks_per_node,
                  plan.host_pinned > plan.expert_bytes ? " (+ each rank's parked block inputs)" : "");
    os << line;
  } else if (plan.host_pinned > 0) {
    std::snprintf(line, sizeof line, "  %-12s %10s  per rank (%s for %d rank(s) on a node)\n", "pinned host",
                  human_bytes(plan.host_pinned).c_str(), human_bytes(plan.host_pinned * plan.ranks_per_node).c_str(),
                  plan.ranks_per_node);
    os << line;
  }
  if (plan.host_lora > 0) {
    std::snprintf(line, sizeof line, "  %-12s %10s  per rank: the experts' LoRA (%s parameters: fp32 master, gradient, AdamW moments)\n",
                  "host LoRA", human_bytes(plan.host_lora).c_str(),
                  std::to_string(static_cast<long long>(plan.expert_lora_params)).c_str());
    os << line;
  }
  if (vram > 0) {
    const double need = plan.device_peak + plan.margin;
    const bool fits = need <= vram;
    os << "  " << (fits ? "fits" : "does NOT fit") << " a " << human_bytes(vram) << " card ("
       << human_bytes(std::fabs(vram - need)) << (fits ? " to spare" : " short") << ", margin included)\n";
  }
  return os.str();
}

double host_ram_per_node(const MemoryPlan& p) {
  return (p.shared_homes ? p.host_pinned : p.host_pinned * p.ranks_per_node) + p.host_lora * p.ranks_per_node;
}

HostRamFit describe_host_ram(const RunSpec& spec, const MemoryPlan& plan, double host_ram, const std::string& source) {
  HostRamFit out;
  if (!spec.offload || host_ram <= 0) return out;
  // Pinned host RAM per node: a copy per rank (per_rank, and each rank's ring with disk), one per
  // NUMA node (counted as one here: the plan does not know the node's NUMA layout).
  auto per_node = [](const MemoryPlan& p) { return host_ram_per_node(p); };
  const double need = per_node(plan);
  out.fits = need <= host_ram;
  std::ostringstream os;
  os << "  host RAM " << (out.fits ? "fits" : "does NOT fit") << ": " << human_bytes(need) << " pinned per node"
     << (plan.shared_homes ? " (per NUMA node)" : "") << " of " << human_bytes(host_ram) << " (" << source << ")";
  if (!out.fits) {
    std::vector<std::string> tries;
    for (const auto& [homes, name] : {std::pair{offload::HomesKind::PerNumaNode, "per_numa_node"},
                                      std::pair{offload::HomesKind::Disk, "disk"}}) {
      if (spec.homes == homes) continue;
      if (homes == offload::HomesKind::Disk && spec.group_size > 0) continue;  // groups read the homes in RAM
      RunSpec other = spec;
      other.homes = homes;
      const MemoryPlan q = plan_memory(other);
      if (homes == offload::HomesKind::PerNumaNode && plan.ranks_per_node <= 1) continue;  // nothing to share
      tries.push_back(std::string("expert_offload_homes: ") + name + " (" + human_bytes(per_node(q)) +
                      (q.disk_homes ? " per node + " + human_bytes(q.disk_file_bytes) + " on a local drive, reading " +
                                          human_bytes(q.disk_reads_per_step) + " per rank and step"
                                    : std::string(" per NUMA node")) +
                      ")");
    }
    if (!tries.empty()) os << "; try " << join(tries, " or ");
  }
  os << "\n";
  out.text = os.str();
  return out;
}

}  // namespace eo
