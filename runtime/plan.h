// The memory plan: per-rank device and host bytes predicted from config.json and the training
// config alone, before anything is loaded.
//
// Device bytes are what the caching allocator will hand out at the step's peak (the figure
// `peak VRAM` reports), broken into named parts so a user sees what to change:
//   weights     resident frozen weights: embeddings, lm_head, norms, routers, NF4 attention
//   experts     NF4 (or MXFP4) experts on the device: all of them, or the offload slots (+ budget blocks)
//   lora        LoRA parameters, gradients and AdamW moments (fp32); with expert_lora_offload the
//               experts' share only as working copies of a few blocks (the rest: host_lora)
//   checkpoints block inputs kept by activation checkpointing (one [tokens, hidden] per block)
//   block       one block's recompute + backward: its saved tensors plus the largest set that
//               one backward op holds at once (the phase is named: down projection, gate/up,
//               dispatch, attention), one dequantised expert bank or its largest slice
//   head        the final norm and the chunked cross-entropy working set
// The peak is everything but block and head, plus the larger of the two (they never coexist).
// Each term comes from the code that owns it, and the plan adds them up: the offload engine's
// layout and staging policy (offload/layout.h, offload/staging.h), what each decoder layer holds and
// its block's backward peak, counted tensor by tensor (models/block_memory.h), the loss's chunk. No
// factor is fitted; the plan is checked against measured peaks in bench/ and docs/benchmarks.md.
// The start-up check adds `margin` for what the allocator reserves beyond what it hands out
// (rounding, fragmentation, cuBLAS workspaces).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "models/hf_config.h"
#include "models/quant_format.h"
#include "runtime/config.h"
#include "runtime/runspec.h"

namespace eo {

struct MemoryPart {
  std::string name;
  double bytes = 0;
  std::string what;
};

struct MemoryPlan {
  std::vector<MemoryPart> device;  // per rank
  double device_peak = 0;          // the predicted allocator peak (what `peak VRAM` measures)
  double margin = 0;               // headroom the start-up check adds for reserved-but-unused memory
  double expert_bytes = 0;         // 4-bit experts of the whole model
  QuantFormat expert_format = QuantFormat::Nf4;  // how load_in_4bit holds them (expert_quant)
  double block_bytes = 0;          // one MoE block's experts
  int group_size = 0;              // offloaded blocks stream in groups of this many experts (0: whole)
  double slot_bytes = 0;           // one device slot: a block, or a group of group_size experts
  double host_pinned = 0;          // per rank: the homes when offloading (disk: the read ring), else 0
  // expert_lora_offload: the experts' LoRA parameters and their state in host RAM per rank
  // (runtime/expert_lora_offload.h: fp32 master, gradient, two moments); 0 without.
  double expert_lora_params = 0;
  double host_lora = 0;
  int ranks_per_node = 1;
  bool shared_homes = false;       // expert_offload_homes: per_numa_node (one copy per NUMA node)
  // expert_offload_homes: disk: the homes file (one per host), its read ring per rank, and the
  // bytes read from the drive per rank and optimizer step — every block the step copies into a
  // slot (the staging policy's own count, offload/staging.h), less any still in the ring.
  bool disk_homes = false;
  double disk_file_bytes = 0;
  int disk_ring = 0;
  double disk_ring_bytes = 0;
  double disk_reads_per_step = 0;
  std::int64_t copies_per_step = 0;  // blocks copied into a slot per warm optimizer step (with offload)
  Compute compute = Compute::Bf16;
  bool on_gpu = true;
};

// The plan of a resolved run (spec.on_gpu: planning for a GPU, where the input embedding table is
// host-held, rather than a CPU run; bf16 and fp16 compute take the same bytes).
MemoryPlan plan_memory(const RunSpec& spec);
// The same, resolving the spec from `cfg` and `mc` (compute: resolve_compute's dtype).
MemoryPlan plan_memory(const TrainConfig& cfg, const model::ModelConfig& mc, Compute compute, int ranks_per_node,
                       bool on_gpu = true);

// The plan fitted to `available` device bytes: where it does not fit, auto's alternatives are
// tried as changed copies of the spec, in order: expert_bank_reuse down (gate's and up's banks
// dequantised again in backward), then expert_group_size (offloaded blocks streamed in groups: the
// largest that fits), then expert_dequant_chunk in 64 MiB slices (on a GPU; each is kept only if
// it lowers the peak). `*_from`: the peak an alternative replaced, 0 if not taken.
struct FittedPlan {
  RunSpec spec;
  MemoryPlan plan;
  double down_from = 0, sliced_from = 0, grouped_from = 0;
};
FittedPlan fit_plan(const RunSpec& spec, double available);

// A table of the plan, and (when vram > 0) whether it fits a card of that many bytes.
std::string describe_plan(const MemoryPlan& plan, double vram_bytes);

// Host RAM a node gives the plan's ranks: the homes (a copy per rank, or one per NUMA node with
// per_numa_node, counted as one; disk: each rank's ring) and every rank's host LoRA.
double host_ram_per_node(const MemoryPlan& plan);

// Whether the pinned host RAM per node of the spec's plan fits `host_ram` bytes per node; when not,
// what the other expert_offload_homes would take (per_numa_node, disk), planned as copies of it.
struct HostRamFit {
  bool fits = true;
  std::string text;
};
HostRamFit describe_host_ram(const RunSpec& spec, const MemoryPlan& plan, double host_ram, const std::string& source);

}  // namespace eo
