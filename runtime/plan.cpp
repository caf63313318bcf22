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

// The routed experts as the offload engine lays them out (offload/layout.h) and, offloaded, what
// it keeps on the device and copies: its slots (whole blocks, or groups of a block's experts), the
// budget's resident blocks (the first ones, in layer order, as the engine), the copies of a warm
// step (the engine's own staging policy run dry along the step's staging order), the disk homes.
struct ExpertsLaidOut {
  double block_bytes = 0, slot_bytes = 0, budget = 0;
  int slots = 0, group_size = 0;
  std::int64_t copies_per_step = 0;
  std::optional<offload::DiskHomesSize> disk;
};
ExpertsLaidOut lay_out_experts(const RunSpec& spec, QuantFormat format, int group_size) {
  const model::ModelConfig& c = spec.model;
  ExpertsLaidOut x;
  x.group_size = group_size;
  const std::vector<int>& moe_list = spec.moe_layers;
  const int moe_layers = static_cast<int>(moe_list.size());
  std::vector<bool> is_moe(static_cast<std::size_t>(c.layers));
  for (int i : moe_list) is_moe[static_cast<std::size_t>(i)] = true;
  std::vector<int> order;  // the step's staging order, offloaded
  if (spec.offload) order = make_step_schedule(int(c.layers), spec.accum, spec.order).staging_order(is_moe);
  x.block_bytes = double(offload::expert_block_bytes(c, spec.blocksize, spec.double_quant, format));
  if (!spec.offload) return x;
  if (!spec.budget_auto && spec.budget_bytes > 0)
    x.budget = std::floor(double(spec.budget_bytes) / x.block_bytes) * x.block_bytes;
  x.budget = std::min(x.budget, x.block_bytes * moe_layers);
  const int resident_count = x.block_bytes > 0 ? int(x.budget / x.block_bytes) : 0;
  const std::vector<int> resident(moe_list.begin(),
                                  moe_list.begin() + std::min<std::size_t>(moe_list.size(), resident_count));
  const int streamed = moe_layers - int(resident.size());
  x.slots = spec.slots;
  x.slot_bytes = x.block_bytes;
  if (group_size > 0) {
    // Streamed in groups (offload/engine.h): two slots of a group (one computes, the next
    // copies), one without prefetch; none when every block is budget-resident. Every group of a
    // streamed block's stagings is copied (forward, recompute), and its backward copies all but
    // the two groups its recompute left in the slots.
    x.slots = resident_count >= moe_layers ? 0 : spec.prefetch ? 2 : 1;
    x.slot_bytes = double(offload::expert_group_bytes(c, spec.blocksize, spec.double_quant, format, group_size));
    const std::int64_t groups = (c.experts + group_size - 1) / group_size;
    std::int64_t stagings = 0;
    for (int l : order) stagings += std::find(resident.begin(), resident.end(), l) == resident.end() ? 1 : 0;
    if (!moe_list.empty())
      x.copies_per_step =
          stagings * groups + (spec.checkpointing ? stagings / 2 * std::max<std::int64_t>(0, groups - 2) : 0);
  } else if (!moe_list.empty()) {
    x.copies_per_step =
        offload::steady_copies_per_step(order, int(c.layers), std::min(x.slots, streamed), spec.prefetch, resident);
  }
  if (spec.homes == offload::HomesKind::Disk)
    x.disk = offload::estimate_disk_homes(c, spec.blocksize, spec.double_quant, x.slots, format);
  return x;
}

// The numbers of a plan, before they are written into its parts.
struct PlanTerms {
  model::BlockRun run;
  double micro_batches_kept = 1;  // block inputs kept until backward: all g layer-major, one micro-batch-major
  ExpertsLaidOut experts;
  model::BlockParams params;
  double resident_experts = 0;  // every expert resident: their bytes (separate tensors, no arena alignment)
  model::BlockContextBytes context;
  model::BlockPeak block;
  double rope_columns = 0;
  double head = 0, head_chunk = 0;  // the loss head's working set, and its rows per chunk
  ExpertLoraBytes expert_lora;
};

// The plan's parts from its terms, in the table's order. On a GPU the untied input embedding table
// stays in host memory (model::LoadOptions::embeddings_on_host). LoRA: fp32 parameter, gradient
// and two AdamW moments; with expert_lora_offload the experts' state in host RAM
// (runtime/expert_lora_offload.h) and, on the device, the working copies of a few blocks with their
// gradients and moments. Checkpoints: the block inputs (embedding output .. last block) and RoPE tables of every
// micro-batch of the step (the layer-major step keeps all g until backward; micro-batch-major, one),
// the hidden state or incoming gradient of each, and the outgoing gradient of the block under
// backward; with activation_offloading the inputs wait in pinned host RAM and about two blocks'
// worth are on the device (the one in backward and the one being copied back).
void write_parts(const RunSpec& spec, const PlanTerms& t, MemoryPlan& p) {
  const model::ModelConfig& c = spec.model;
  const double d = t.run.dtype_bytes, H = double(c.hidden), V = double(c.vocab), E = double(c.experts);
  const double N = t.run.micro_batch_size * t.run.sequence_len;
  auto count = [](double n) { return std::to_string(static_cast<long long>(n)); };
  const std::optional<QuantFormat> fmt = spec.expert_format;
  const std::string held = !fmt                         ? std::string()
                           : std::string(" (") + quant_format_name(*fmt) +
                                 (quant_format_traits(*fmt).checkpoint_own ? ", the checkpoint's own bytes)" : ")");
  const bool host_embeddings = p.on_gpu && !c.tie_word_embeddings;
  const double embeddings = V * H * d * (c.tie_word_embeddings || host_embeddings ? 1 : 2) + H * d;  // + final norm
  p.device.push_back({"weights", embeddings + t.params.frozen,
                      std::string(host_embeddings ? "lm_head (input embeddings in host RAM)" : "embeddings, lm_head") +
                          ", norms, routers, attention" + (spec.load_in_4bit ? " (NF4)" : "")});
  const ExpertsLaidOut& x = t.experts;
  const std::string budget = x.budget > 0 ? " + " + human_bytes(x.budget) + " of resident blocks" : std::string();
  if (!spec.offload)
    p.device.push_back({"experts", t.resident_experts, "every expert resident" + held});
  else if (x.group_size > 0)
    p.device.push_back({"experts", double(x.slots) * x.slot_bytes + x.budget,
                        count(x.slots) + " slot(s) of " + human_bytes(x.slot_bytes) + ", each a group of " +
                            count(x.group_size) + " of a block's " + count(E) +
                            " experts (expert_group_size; blocks of " + human_bytes(x.block_bytes) +
                            " stream group by group)" + budget + held});
  else
    p.device.push_back({"experts", double(x.slots) * x.block_bytes + x.budget,
                        count(x.slots) + " slot(s) of " + human_bytes(x.block_bytes) + budget + held});
  if (spec.expert_lora_offload && t.params.expert_lora > 0) {
    const double copies = std::min<double>(kExpertLoraWorkingCopies, double(spec.moe_layers.size()));
    p.device.push_back({"lora", t.params.lora * 16 + t.expert_lora.device * copies / kExpertLoraWorkingCopies,
                        count(t.params.lora) + " parameters x 16 bytes + the experts' LoRA of " + count(copies) +
                            " block(s) x 16 bytes (working copies, gradients, moments; the rest in host RAM)"});
  } else {
    const double params = t.params.lora + t.params.expert_lora;
    p.device.push_back({"lora", params * 16, count(params) + " parameters x 16 bytes"});
  }
  const double g = t.micro_batches_kept;
  const double kept = spec.activation_offloading ? std::min(2.0, double(c.layers)) : double(c.layers);
  p.device.push_back({"checkpoints", (g * (kept + 1) + 2) * N * H * d + g * 2 * N * t.rope_columns * d,
                      count(kept) + " block inputs of [tokens, hidden] x " + count(g) + " micro-batch(es) + gradients" +
                          (spec.activation_offloading ? " (the rest parked in host RAM)" : "")});
  if (t.context.bytes > 0) p.device.push_back({t.context.name, t.context.bytes, t.context.what});
  const model::BlockPeak& b = t.block;
  std::string what = "one block's recompute + backward, peak at the " + b.phase + " (" + count(b.pairs) +
                     " token-expert pairs";
  if (b.bank > 0)
    what += ", dequantised bank " + human_bytes(b.bank) +
            (x.group_size > 0 ? " (a group of " + count(x.group_size) + " experts)" : std::string());
  if (b.banks_kept) what += ", 2 more kept from the recompute for its backward";
  if (b.attn_repeated_kv > 0)
    what += ", heads over 256 keep their kv heads repeated for the memory-efficient kernel, " + human_bytes(b.attn_repeated_kv);
  p.device.push_back({"block", b.bytes, what + ")"});
  p.device.push_back({"head", t.head, "chunked cross entropy, " + count(t.head_chunk) + " rows per chunk"});
  // CUDA graphs (runtime/block_graphs.h) replay on static buffers that are copies beside the eager
  // tensors they stand for: the block input (shared by forward, recompute and the loss), the
  // incoming gradient and the output (shared by every use), each [tokens, hidden], and the two RoPE
  // tables. Planned wherever graphs may run (cuda_graphs not false, and the uses can replay); where
  // auto turns them off for want of room, the plan is over by these bytes. Their temporaries live
  // in the graphs' own pool, which the fit check adds.
  if (spec.on_gpu && spec.cuda_graphs != Setting::Off && spec.graphs_blocked.empty())
    p.device.push_back({"graphs", 3 * N * H * d + 2 * N * t.rope_columns * d,
                        "CUDA graphs' static buffers: block input, gradient, output, RoPE tables "
                        "(cuda_graphs: false drops them)"});
  // The portable grouped GEMM's problem table (models/expert_gemm_cuda.h): 60 bytes per expert for
  // each GEMM in flight; a few of a block's GEMMs may be queued at once.
  if (spec.on_gpu && spec.expert_gemm != ExpertGemmSetting::Torch)
    p.device.push_back(
        {"expert gemm", 8.0 * 64 * E, "portable grouped GEMM problem tables (expert_gemm: torch has none)"});
}

}  // namespace

MemoryPlan plan_memory(const TrainConfig& cfg, const model::ModelConfig& mc, Compute compute, int ranks_per_node,
                       bool on_gpu) {
  return plan_memory(resolve_run_spec(cfg, mc, compute, on_gpu, ranks_per_node));
}

// The terms come from the code that owns each: the offload engine's layout and staging policy,
// what each block reports, the loss's chunking; the plan adds them up.
MemoryPlan plan_memory(const RunSpec& spec) {
  const model::ModelConfig& c = spec.model;
  MemoryPlan p;
  p.on_gpu = spec.on_gpu;
  p.compute = spec.compute;
  p.ranks_per_node = spec.ranks_per_node;
  p.expert_format = spec.expert_format.value_or(QuantFormat::Nf4);
  PlanTerms t;
  t.run = block_run(spec);
  t.micro_batches_kept = spec.order == StepOrder::LayerMajor ? double(spec.accum) : 1.0;
  p.group_size = t.run.group_size;
  t.experts = lay_out_experts(spec, p.expert_format, p.group_size);
  std::vector<bool> is_moe(static_cast<std::size_t>(c.layers));
  for (int i : spec.moe_layers) is_moe[static_cast<std::size_t>(i)] = true;
  for (int i = 0; i < c.layers; ++i) {  // what each layer reports (models/block_memory.h), summed
    const model::BlockParams b = model::block_params(c, i, is_moe[static_cast<std::size_t>(i)], t.run);
    t.params.frozen += b.frozen;
    t.params.lora += b.lora;
    t.params.expert_lora += b.expert_lora;
  }
  const int moe_layers = static_cast<int>(spec.moe_layers.size());
  if (!spec.offload) t.resident_experts = model::resident_experts_bytes(c, t.run, moe_layers, spec.expert_format);
  t.context = model::block_context_bytes(c, t.run.micro_batch_size, t.run.sequence_len, t.micro_batches_kept);
  t.block = model::block_peak(c, t.run, moe_layers);
  t.rope_columns = model::rope_table_columns(c);
  // The head: the normed hidden and per-row log-sum-exp saved, the targets; one chunk of logits
  // in flight (forward: the GEMM's output, its fp32 copy and logsumexp's fp32 temporary; backward:
  // the GEMM's output, its fp32 softmax gradient and that cast back), the hidden's gradient.
  const double rows = double(spec.micro_batch_size) * double(std::max(1, spec.sequence_len - 1));
  const double chunk = double(model::loss_chunk_rows(std::int64_t(rows), std::int64_t(c.vocab)));
  const double H = double(c.hidden), V = double(c.vocab), d = t.run.dtype_bytes;
  t.head_chunk = chunk;
  t.head = rows * (H * d + 4 + 8) + std::max(chunk * V * (d + 4 + 4), chunk * V * (d + 4 + d) + rows * H * d) +
           rows * H * d;
  if (spec.expert_lora_offload && t.params.expert_lora > 0)
    t.expert_lora = expert_lora_bytes(t.params.expert_lora, t.params.expert_lora / moe_layers);
  write_parts(spec, t, p);

  const ExpertsLaidOut& x = t.experts;
  p.block_bytes = x.block_bytes;
  p.slot_bytes = x.slot_bytes;
  p.expert_bytes = x.block_bytes * moe_layers;
  p.copies_per_step = x.copies_per_step;
  if (spec.offload) {
    p.host_pinned = p.expert_bytes;
    p.shared_homes = spec.homes == offload::HomesKind::PerNumaNode;
  }
  if (x.disk) {
    p.disk_homes = true;
    p.disk_file_bytes = double(x.disk->file_bytes);
    p.disk_ring = x.disk->ring;
    p.disk_ring_bytes = double(x.disk->ring_bytes);
    p.disk_reads_per_step = double(p.copies_per_step) * p.block_bytes;
    p.host_pinned = p.disk_ring_bytes;
  }
  if (spec.activation_offloading)
    p.host_pinned += t.micro_batches_kept * double(c.layers) * t.run.micro_batch_size * t.run.sequence_len * H * d;
  p.host_lora = t.expert_lora.host;
  p.expert_lora_params = spec.expert_lora_offload && t.params.expert_lora > 0 ? t.params.expert_lora : 0;

  p.device_peak = 0;
  for (const auto& part : p.device)
    if (part.name != "block" && part.name != "head") p.device_peak += part.bytes;
  p.device_peak += std::max(t.block.bytes, t.head);  // block and head never coexist
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
