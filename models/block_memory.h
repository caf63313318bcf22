// What a decoder block holds, as its code (models/moe_model.cpp, the block structs of
// models/hf_config.h) allocates and saves it: each layer reports its frozen weights and LoRA
// parameters, and the block under backward its peak. The memory plan (runtime/plan.cpp) sums what
// the blocks report and names no family itself.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "models/hf_config.h"
#include "models/linear4bit.h"
#include "models/lora.h"
#include "models/lora_targets.h"
#include "models/quant_format.h"

namespace eo::model {

// The step's shape and settings as the blocks' bytes depend on them (the plan fills it from its
// RunSpec).
struct BlockRun {
  double micro_batch_size = 1, sequence_len = 0;
  double dtype_bytes = 2;          // the compute dtype's
  bool on_gpu = true;
  bool load_in_4bit = false;       // frozen linears in NF4 (blocks of `blocksize`), else the compute dtype
  int blocksize = 64;
  const LoraSpec* lora = nullptr;  // the adapter (never null when asked)
  bool lora_all_linear = false;
  // The routed experts: held 4-bit (a bank dequantised per GEMM), streamed in groups of
  // group_size (0: whole blocks), the bank's slice cap (0: whole), the banks a recompute keeps.
  bool experts_quantised = false;
  int group_size = 0;
  std::int64_t bank_bytes = 0;
  BankReuse bank_reuse = BankReuse::None;
};

// Which expert matrices get LoRA: by module name (every linear with `all_linear`), or as peft's fused
// parameters (gate and up share gate_up_proj's).
struct ExpertLoraReach {
  bool gate = false, up = false, down = false;
};
ExpertLoraReach expert_lora_reach(const ModelConfig& c, const LoraSpec& lora, bool all_linear);

// One decoder layer's frozen weights (bytes on the device; the routed experts apart: the offload
// layout's) and LoRA parameters (the routed experts' apart, by module name or as peft's fused
// parameters).
struct BlockParams {
  double frozen = 0;
  double lora = 0, expert_lora = 0;
};
BlockParams block_params(const ModelConfig& c, int layer, bool moe, const BlockRun& run);

// One block's recompute + backward at its peak: the saved tensors of its recompute plus, op by op,
// what the backward holds at once, the larger over the phases (named), and the two residual
// gradients in flight. The terms are the widest layer's (attention, delta rule, MoE or dense MLP).
struct BlockPeak {
  double bytes = 0;
  std::string phase;
  double pairs = 0;            // token-expert pairs of a micro-batch
  double bank = 0;             // one dequantised expert bank (or its largest slice), 0 without
  bool banks_kept = false;     // gate's and up's banks kept from the recompute for the backward
  double attn_repeated_kv = 0;  // heads over 256: their kv heads repeated for the memory-efficient kernel
};
BlockPeak block_peak(const ModelConfig& c, const BlockRun& run, int moe_layers);

// Every routed expert resident (separate tensors, no arena alignment) in `format` (NF4 blocks of
// run.blocksize, or the checkpoint's MXFP4 / NVFP4), or unquantised in the compute dtype.
double resident_experts_bytes(const ModelConfig& c, const BlockRun& run, int moe_layers,
                              std::optional<QuantFormat> format);

// Columns of the RoPE tables (cos, sin) each micro-batch keeps: one table of head_dim, Gemma 4
// one per layer type.
double rope_table_columns(const ModelConfig& c);
// Layers with a dense MLP: the dense layers, and every layer of Gemma 4 (beside its experts).
int dense_mlp_layers(const ModelConfig& c, int moe_layers);

// Tensors a family's blocks share across a micro-batch (BlockContext), all micro-batches of the
// step kept: Llama 4's chunked-attention masks and NoPE query scales. bytes 0: none.
struct BlockContextBytes {
  double bytes = 0;
  std::string name, what;
};
BlockContextBytes block_context_bytes(const ModelConfig& c, double micro_batch_size, double sequence_len,
                                      double micro_batches);

}  // namespace eo::model
