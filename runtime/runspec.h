// A run's settings resolved once, from the training config, the model's config.json and the
// device: enums instead of the config's strings, every `auto` that can be decided before a weight
// is read decided here (with the reason the log gives), and the counts the rest of start-up needs.
// The memory plan, setup, the step's options and the trainer read this; none of them re-derives a
// rule, and the spec holds no pointer back to the config: what they read from it is a field here. What the plan decides later (bank reuse or 64 MiB slices when only they fit) is a changed
// copy of the spec (PlanFit in runtime/setup.h), never a changed config; whether CUDA graphs run is
// decided last, once the loaded model's facts are known (decide_cuda_graphs), into the spec too,
// as the experts' GEMM kernel is once the device is known (decide_expert_gemm, runtime/setup.h).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "models/grouped_mm.h"
#include "models/hf_config.h"
#include "models/linear4bit.h"
#include "models/lora.h"
#include "models/quant_format.h"
#include "offload/host_memory.h"
#include "runtime/config.h"
#include "runtime/schedule.h"

namespace eo {

enum class Setting { Auto, On, Off };  // auto | true | false keys
enum class ExpertGemmSetting { Auto, Torch, Portable };

struct RunSpec {
  model::ModelConfig model;          // config.json, parsed once for the run
  bool on_gpu = true;
  int ranks_per_node = 1;
  Compute compute = Compute::Bf16;
  std::optional<QuantFormat> expert_format;  // how the routed experts are held; nullopt: unquantised
  std::vector<int> moe_layers;               // decoder layers with routed experts

  // 4-bit weights: load_in_4bit, bnb_4bit_blocksize, bnb_4bit_use_double_quant
  bool load_in_4bit = false;
  int blocksize = 64;
  bool double_quant = false;

  // a step's shape and what it trains
  int sequence_len = 0;
  int micro_batch_size = 1;
  int accum = 1;                     // gradient_accumulation_steps: micro-batches per optimizer step
  model::LoraSpec lora;              // the adapter (lora_spec)
  bool lora_all_linear = false;      // lora_target_linear: every linear, whatever lora.targets names
  bool packed = false;               // sample_packing: rows of several documents (models/attention_path.h)

  // expert offload
  bool offload = false;
  offload::HomesKind homes = offload::HomesKind::PerRank;
  bool prefetch = true;
  int slots = 1;                     // device slots the engine makes (never more than blocks)
  bool budget_auto = false;          // expert_offload_vram_budget: auto (sized after step 1)
  // The experts' LoRA state in host RAM (runtime/expert_lora_offload.h): expert_offload with LoRA
  // on the experts, expert_lora_offload not false (and checkpointing, which expert_offload needs).
  bool expert_lora_offload = false;
  std::int64_t budget_bytes = 0;     // else its bytes (0: every block streamed)

  // expert banks and the step
  std::int64_t bank_bytes = 0;       // expert_dequant_chunk: 0 = the whole bank at once
  bool bank_auto = false;            // ... auto: whole unless only slices fit (the plan decides)
  // expert_group_size: offloaded blocks stream in groups of this many experts (0: whole blocks;
  // never the block's expert count or more); auto: whole unless only groups fit (the plan decides).
  int group_size = 0;
  bool group_auto = false;
  model::BankReuse bank_reuse = model::BankReuse::None;  // in effect (see resolve_run_spec)
  bool bank_reuse_auto = false;      // expert_bank_reuse: auto (all, or down when only that fits)
  bool checkpointing = true;
  bool random_blocks = false;        // blocks draw random numbers (lora_dropout > 0)
  StepOrder order = StepOrder::LayerMajor;  // in effect: micro-batch-major without checkpointing
  bool activation_offloading = false;  // checkpointed block inputs parked in pinned host RAM
  bool merge_aware = false;          // nvfp4_merge_aware: LoRA trains through NVFP4-snapped weights
  bool aux_loss = false;             // the router's load-balancing loss (output_router_logits)
  double aux_coef = 0;               // its weight: router_aux_loss_coef, else config.json's
  ExpertGemmSetting expert_gemm = ExpertGemmSetting::Auto;  // asked
  // ... decided for the device (decide_expert_gemm in runtime/setup.h): the kernel, whether MoE
  // blocks run their expert GEMMs grouped (routing counts read on the device; else expert by
  // expert, counts read on the host), and what and why, for the log.
  model::ExpertGemm expert_gemm_kernel = model::ExpertGemm::kTorch;
  bool expert_gemm_grouped = false;
  std::string expert_gemm_why;

  // CUDA graphs (runtime/block_graphs.h): asked, what rules them out whatever the memory (the plan
  // budgets their buffers wherever they may run), and the decision (decide_cuda_graphs).
  Setting cuda_graphs = Setting::Auto;
  std::string graphs_blocked;        // why the step's uses cannot replay as graphs; empty: they may
  bool graphs = false;               // the step replays its uses as CUDA graphs
  std::string graphs_why;            // ... and why, for the log
};

// `on_gpu`: the run (or the plan) is for a GPU; `ranks_per_node`: ranks sharing a host.
RunSpec resolve_run_spec(const TrainConfig& cfg, model::ModelConfig model, Compute compute, bool on_gpu,
                         int ranks_per_node);

// What decides CUDA graphs besides the spec: the memory plan's room for the graphs' pool, and the
// loaded model's expert GEMMs.
struct GraphFacts {
  std::string pool;            // what the graphs' own pool keeps besides (one more working set), in words
  bool pool_fits = false;      // ... and whether the plan has room for it
  std::string available;       // what the plan was checked against, in words
  std::string counts_on_host;  // why the expert GEMMs read the routing counts on the host (no graph
                               // can capture that), or empty where they read them on the device
};

// cuda_graphs: auto | true | false decided into spec.graphs and spec.graphs_why, once, with the
// model loaded. auto: on a GPU where the plan has room for the graphs' pool, experts resident or
// offloaded.
void decide_cuda_graphs(RunSpec& spec, const GraphFacts& facts);

// The banks a recompute keeps for its backward, as the step can keep them: whole banks on a GPU
// with checkpointing (a slice is cut differently in forward and backward; the CPU runs the
// per-expert loop, with no bank), else none.
model::BankReuse bank_reuse_in_effect(bool on_gpu, std::int64_t bank_bytes, bool checkpointing, model::BankReuse asked);

// Whether the run's LoRA reaches the routed experts (by module name or as fused parameters).
bool experts_carry_lora(const RunSpec& spec);

// The LoRA `cfg` trains: what setup adds to the model and what the adapter's config records.
model::LoraSpec lora_spec(const TrainConfig& cfg);

}  // namespace eo
