#include "runtime/runspec.h"

#include "common/text.h"
#include "models/lora_targets.h"
#include "offload/staging.h"

namespace eo {
namespace {

// Why the step's uses cannot replay as CUDA graphs whatever the memory, or "" when they may: the
// graphs replay checkpointed uses (without checkpointing a block's autograd graph outlives its
// use); per-use dropout seeds are set on the host, which a replay would not see; merge-aware
// training forms its snapped weights anew in every forward.
std::string why_uses_cannot_replay(const RunSpec& s) {
  if (!s.checkpointing) return "they replay checkpointed block uses; gradient_checkpointing is off";
  if (s.random_blocks) return "lora_dropout > 0: each use's dropout seed is set on the host";
  if (s.merge_aware) return "nvfp4_merge_aware forms its snapped weights anew in every forward";
  return "";
}

}  // namespace

bool experts_carry_lora(const RunSpec& s) {
  if (s.moe_layers.empty()) return false;
  for (const auto& p : s.lora.target_parameters)
    if (p == model::kGateUpParam || p == model::kDownParam) return true;
  if (!s.lora.target_parameters.empty() || !s.model.experts_lora_ok()) return false;  // fused parameters only, then
  for (const auto& name : s.model.expert_linears())
    if (model::adapts_module(s.lora, s.lora_all_linear, name)) return true;
  return false;
}

model::LoraSpec lora_spec(const TrainConfig& cfg) {
  model::LoraSpec spec;
  spec.r = cfg.lora_r;
  spec.alpha = cfg.lora_alpha;
  spec.dropout = cfg.lora_dropout;
  spec.use_rslora = cfg.peft_use_rslora;
  spec.targets = cfg.lora_target_modules;
  spec.target_parameters = cfg.lora_target_parameters;
  spec.layers = cfg.peft_layers_to_transform;
  spec.seed = static_cast<std::uint64_t>(cfg.seed);
  return spec;
}

model::BankReuse bank_reuse_in_effect(bool on_gpu, std::int64_t bank_bytes, bool checkpointing, model::BankReuse asked) {
  return on_gpu && bank_bytes == 0 && checkpointing ? asked : model::BankReuse::None;
}

// The config's strings were checked against their values when it was read (runtime/config_keys.cpp);
// here each becomes its enum, once. The byte sizes are read last.
RunSpec resolve_run_spec(const TrainConfig& cfg, model::ModelConfig model, Compute compute, bool on_gpu, int ranks_per_node) {
  RunSpec s;
  s.on_gpu = on_gpu;
  s.ranks_per_node = ranks_per_node;
  s.compute = compute;
  s.expert_format = expert_format(cfg, model);
  s.moe_layers = model.moe_layer_ids();
  s.model = std::move(model);

  s.load_in_4bit = cfg.load_in_4bit;
  s.blocksize = cfg.bnb_4bit_blocksize;
  s.double_quant = cfg.bnb_4bit_use_double_quant;

  s.sequence_len = cfg.sequence_len;
  s.micro_batch_size = cfg.micro_batch_size;
  s.accum = cfg.gradient_accumulation_steps;
  s.lora = lora_spec(cfg);
  s.lora_all_linear = cfg.lora_target_linear;
  s.packed = cfg.sample_packing;

  s.checkpointing = cfg.gradient_checkpointing;
  s.order = step_order_in_effect(s.checkpointing, cfg.step_order == "micro_batch_major" ? StepOrder::MicroBatchMajor
                                                                                      : StepOrder::LayerMajor);
  s.random_blocks = cfg.lora_dropout > 0;
  s.activation_offloading = cfg.activation_offloading;
  s.merge_aware = cfg.nvfp4_merge_aware;
  s.aux_loss = cfg.output_router_logits;
  s.aux_coef = cfg.router_aux_loss_coef.value_or(s.model.router_aux_loss_coef);
  s.cuda_graphs = cfg.cuda_graphs == "true" ? Setting::On : cfg.cuda_graphs == "false" ? Setting::Off : Setting::Auto;

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
  s.expert_lora_offload = s.offload && cfg.expert_lora_offload && s.checkpointing && experts_carry_lora(s);
  s.graphs_blocked = why_uses_cannot_replay(s);

  // expert_dequant_chunk: whole and auto are the whole bank (auto may become kAutoBankSliceBytes
  // when the plan needs it), else the slice's bytes.
  s.bank_auto = cfg.expert_dequant_chunk == "auto";
  if (!s.bank_auto && cfg.expert_dequant_chunk != "whole")
    s.bank_bytes = static_cast<std::int64_t>(parse_bytes(cfg.expert_dequant_chunk).value_or(0));
  // expert_group_size: with expert_offload only; a group of every expert is the whole block.
  // auto never groups where groups cannot run (disk homes, nvfp4_merge_aware); the config check
  // refuses a number there.
  s.group_auto = s.offload && cfg.expert_group_size == "auto" && s.homes != offload::HomesKind::Disk && !cfg.nvfp4_merge_aware;
  if (s.offload && cfg.expert_group_size != "auto" && cfg.expert_group_size != "whole") {
    const int g = std::stoi(cfg.expert_group_size);
    s.group_size = g < s.model.experts ? g : 0;
  }
  s.bank_reuse_auto = cfg.expert_bank_reuse == "auto";
  const model::BankReuse asked = cfg.expert_bank_reuse == "none"   ? model::BankReuse::None
                                 : cfg.expert_bank_reuse == "down" ? model::BankReuse::Down
                                                                   : model::BankReuse::All;
  s.bank_reuse = bank_reuse_in_effect(on_gpu, s.bank_bytes, s.checkpointing, asked);
  return s;
}

void decide_cuda_graphs(RunSpec& spec, const GraphFacts& facts) {
  auto decide = [&](bool on, std::string why) {
    spec.graphs = on;
    spec.graphs_why = std::move(why);
  };
  if (!spec.on_gpu) return decide(false, "off (a CPU run)");
  if (spec.cuda_graphs == Setting::Off) return decide(false, "off (cuda_graphs: false)");
  if (!spec.graphs_blocked.empty()) return decide(false, "off (" + spec.graphs_blocked + ")");
  if (spec.group_size > 0)
    return decide(false, "off (expert_group_size: a block streamed in groups reads its routing counts on the host)");
  const std::string extra = facts.pool + " more device memory for their pool";
  // Offloaded runs too: their step is transfer-bound, but each copy waits for the slot's last
  // reader, so a late kernel launch delays the copy stream. Measured (Qwen3-30B-A3B, mb 1, H200,
  // every host core kept busy by another process): eager 1.012x / 1.062x its idle step, graphs
  // 0.996x / 0.998x, idle step times equal. Graphs cost device memory only where the plan has it.
  if (spec.cuda_graphs == Setting::Auto && !facts.pool_fits)
    return decide(false, "off (auto: " + extra + " does not fit in " + facts.available + "; cuda_graphs: true forces them)");
  if (!facts.counts_on_host.empty()) return decide(false, "off (" + facts.counts_on_host + ")");
  if (spec.cuda_graphs == Setting::On) return decide(true, "on (cuda_graphs: true; up to " + extra + ")");
  decide(true, "on (auto; " + extra + ")");
}

}  // namespace eo
