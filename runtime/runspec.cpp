#include "runtime/runspec.h"

#include "common/text.h"
#include "offload/staging.h"

namespace eo {

model::BankReuse bank_reuse_in_effect(bool on_gpu, std::int64_t bank_bytes, bool checkpointing, model::BankReuse asked) {
  return on_gpu && bank_bytes == 0 && checkpointing ? asked : model::BankReuse::None;
}

// The config's strings were checked against their values when it was read (runtime/config.cpp);
// here each becomes its enum, once. The byte sizes are read last.
RunSpec resolve_run_spec(const TrainConfig& cfg, model::ModelConfig model, Compute compute, bool on_gpu, int ranks_per_node) {
  RunSpec s;
  s.cfg = &cfg;
  s.on_gpu = on_gpu;
  s.ranks_per_node = ranks_per_node;
  s.compute = compute;
  s.expert_format = expert_format(cfg, model);
  s.moe_layers = model.moe_layer_ids();
  s.model = std::move(model);

  s.checkpointing = cfg.gradient_checkpointing;
  s.order = step_order_in_effect(s.checkpointing, cfg.step_order == "micro_batch_major" ? StepOrder::MicroBatchMajor
                                                                                      : StepOrder::LayerMajor);
  s.cuda_graphs = cfg.cuda_graphs == "true" ? Setting::On : cfg.cuda_graphs == "false" ? Setting::Off : Setting::Auto;
  s.random_blocks = cfg.lora_dropout > 0;
  s.graphs_blocked = why_uses_cannot_replay(s.checkpointing, s.random_blocks);
  s.expert_gemm = cfg.expert_gemm == "torch"      ? ExpertGemmSetting::Torch
                  : cfg.expert_gemm == "portable" ? ExpertGemmSetting::Portable
                                                  : ExpertGemmSetting::Auto;

  s.offload = cfg.expert_offload;
  s.homes = cfg.expert_offload_homes == "per_numa_node" ? offload::HomesKind::PerNumaNode
            : cfg.expert_offload_homes == "disk"        ? offload::HomesKind::Disk
                                                        : offload::HomesKind::PerRank;
  s.prefetch = cfg.expert_offload_prefetch;
  s.slots = offload::device_slots(s.prefetch, cfg.expert_offload_prefetch_depth, static_cast<int>(s.moe_layers.size()));
  s.budget_auto = cfg.expert_offload_vram_budget == "auto";
  if (!s.budget_auto) s.budget_bytes = static_cast<std::int64_t>(parse_bytes(cfg.expert_offload_vram_budget).value_or(0));

  // expert_dequant_chunk: whole and auto are the whole bank (auto may become kAutoBankSliceBytes
  // when the plan needs it), else the slice's bytes.
  s.bank_auto = cfg.expert_dequant_chunk == "auto";
  if (!s.bank_auto && cfg.expert_dequant_chunk != "whole")
    s.bank_bytes = static_cast<std::int64_t>(parse_bytes(cfg.expert_dequant_chunk).value_or(0));
  s.bank_reuse_auto = cfg.expert_bank_reuse == "auto";
  const model::BankReuse asked = cfg.expert_bank_reuse == "none"   ? model::BankReuse::None
                                 : cfg.expert_bank_reuse == "down" ? model::BankReuse::Down
                                                                   : model::BankReuse::All;
  s.bank_reuse = bank_reuse_in_effect(on_gpu, s.bank_bytes, s.checkpointing, asked);
  return s;
}

}  // namespace eo
