// `eo-ddp [train]`: config → validation → plan → (unless --check) the trainer.
#include <ATen/Context.h>

#include <cmath>
#include <cstdio>
#include <sstream>

#include "common/error.h"
#include "common/log.h"
#include "common/text.h"
#include "models/hf_config.h"
#include "launch/commands.h"
#include "runtime/config.h"
#include "runtime/rank_agreement.h"
#include "runtime/signals.h"
#include "runtime/data/prepare.h"
#include "runtime/device.h"
#include "runtime/ddp/world.h"
#include "runtime/plan.h"
#include "runtime/plan_fixes.h"
#include "runtime/train_state.h"
#include "runtime/trainer.h"

namespace eo::launch {
namespace {

// The run as --check sees it; `fits` is false when the plan does not fit device_memory_limit or,
// on a GPU without one, the free memory of the first device (as the start-up check sees them).
std::string describe_run(const TrainConfig& cfg, const model::ModelConfig& mc, const ddp::WorldInfo& w, bool& fits) {
  std::ostringstream os;
  os << "plan:\n";
  os << "  ranks: " << w.world_size << " (launcher: " << w.launcher << "; " << w.local_size << " on " << w.hostname << ")\n";
  const bool cuda = at::hasCUDA();
  if (cuda)
    os << "  devices: one GPU per local rank (cuda:0 .. cuda:" << w.local_size - 1 << "); "
       << at::getNumGPUs() << " visible on this host\n";
  else
    os << "  devices: cpu (this build or host has no CUDA)\n";
  const ComputeChoice compute = resolve_compute(cfg, cuda, cuda && device_has_bf16(at::Device(at::kCUDA, 0)));
  os << "  compute: " << compute_name(compute.dtype) << " (" << compute.why << ")"
     << (compute.dtype == Compute::Fp16 ? ", dynamic loss scaling" : "") << ", LoRA master weights and AdamW state fp32\n";
  // The model's shape comes from config.json alone: no weights are read.
  const RunSpec spec = resolve_run_spec(cfg, mc, compute.dtype, cuda, w.local_size);
  const bool mxfp4 = spec.expert_format == QuantFormat::Mxfp4;
  os << "  base model: " << cfg.base_model
     << (cfg.load_in_4bit ? " (decoder linears quantised to NF4, blocksize " + std::to_string(cfg.bnb_4bit_blocksize) +
                                (mxfp4 ? "; experts kept in the checkpoint's MXFP4, lossless)" : ")")
                          : " (weights as stored)")
     << "\n";
  os << "  adapter: " << cfg.adapter << " r=" << cfg.lora_r << " alpha=" << cfg.lora_alpha << " on [";
  for (std::size_t i = 0; i < cfg.lora_target_modules.size(); ++i) os << (i ? ", " : "") << cfg.lora_target_modules[i];
  os << "]\n";
  const MemoryPlan plan = plan_memory(spec);
  os << "  model: " << mc.model_type << ", " << mc.layers << " layers (" << spec.moe_layers.size() << " MoE), " << mc.experts
     << " experts of width " << mc.expert_width << ", top-" << mc.top_k << "; "
     << quant_format_name(plan.expert_format) << " experts "
     << human_bytes(plan.block_bytes) << " per block, " << human_bytes(plan.expert_bytes) << " in all\n";
  if (spec.offload)
    os << "  expert offload: every MoE block's " << quant_format_name(plan.expert_format) << " experts in " << (cfg.expert_offload_pin_memory ? "pinned, NUMA-local" : "pageable")
       << " host RAM per rank (host RAM = ranks per node x expert bytes); "
       << (plan.group_size > 0 ? "blocks streamed in groups of " + std::to_string(plan.group_size) + " experts (expert_group_size), "
                               : std::to_string(spec.slots) + " device slot(s)")
       << (spec.prefetch ? " with prefetch" : ", synchronous")
       << "; VRAM budget for resident blocks: " << cfg.expert_offload_vram_budget << "\n";
  else
    os << "  expert offload: off (all weights on the device)\n";
  os << "  batch: " << w.world_size << " rank(s) x " << cfg.micro_batch_size << " sequence(s) x "
     << cfg.gradient_accumulation_steps << " accumulation step(s) of " << cfg.sequence_len << " tokens\n";
  const at::Device device = cuda ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
  const double available = cfg.device_memory_limit > 0 ? double(cfg.device_memory_limit) : double(free_device_memory(device));
  const std::string limit = cfg.device_memory_limit > 0 ? "device_memory_limit " + human_bytes(available)
                                                        : human_bytes(available) + " free on " + describe_device(device);
  if (available <= 0) {  // the CPU without device_memory_limit: nothing to fit
    os << describe_plan(plan, 0);
    return os.str();
  }
  // The plan the start-up check takes (auto's alternatives where only they fit).
  const MemoryPlan fitted = fit_plan(spec, available).plan;
  fits = fitted.device_peak + fitted.margin <= available;
  os << describe_plan(fitted, double(cfg.device_memory_limit));
  if (!fits && cfg.device_memory_limit <= 0) os << "  does NOT fit " << limit << " (margin included)\n";
  if (!fits) os << describe_fixes(plan_fixes(cfg, spec, available), limit);
  return os.str();
}

// A stop requested on any rank before training stops every rank here, together (Stopped: exit 3).
void stop_point(ddp::World& w, const std::string& during) {
  double stop[1] = {stop_requested() ? double(stop_signal()) : 0.0};
  if (w.size() > 1) w.allreduce_max(stop, 1);
  if (stop[0] > 0 && !stop_requested())
    throw Stopped("stopped before training began (signal " + std::to_string(int(stop[0])) + " on another rank, " + during +
                  "): nothing was trained, so nothing is lost and nothing was saved (exit 3)");
  throw_if_stopped(during);
}

}  // namespace

int run_train(const Args& args) {
  ArgReader reader(args);
  const bool check = reader.flag("--check");
  const std::string config_path = reader.value("--config");
  const auto overrides = reader.values("--set");
  reader.finish("train");
  if (config_path.empty()) throw UsageError("--config FILE is required (see eo-ddp --help)");

  model::ModelConfig mc;  // base_model's config.json, parsed once for the run
  ConfigLoadOptions lo;
  lo.model_out = &mc;
  TrainConfig cfg = load_config_file(config_path, overrides, lo);
  for (const auto& w : cfg.warnings) log::warn(w);
  ddp::World& w = ddp::World::get();
  const auto& world = w.info();
  w.set_timeout(cfg.ddp_timeout);  // every host collective from here on is bounded
  check_ranks_agree(cfg, w);  // before anything is loaded or written
  stop_point(w, "while reading the config");
  if (world.rank == 0) check_output_dir_writable(cfg.output_dir);  // rank 0 writes output_dir
  if (check) {
    if (world.rank == 0) {
      bool fits = true;
      std::printf("# resolved config (%s)\n%s\n\n%s", config_path.c_str(), config_to_yaml(cfg).c_str(),
                  describe_run(cfg, mc, world, fits).c_str());
      if (!fits) {
        std::fflush(stdout);
        throw UsageError("the config is valid but the run does not fit (training would stop at start): make one of the "
                         "changes listed above");
      }
      // The axolotl-format datasets: cached already, or to be tokenised by rank 0 at start.
      const data::PreparePlan prep = data::plan_preparation(cfg);
      if (prep.missing() > 0) check_output_dir_writable(cfg.dataset_prepared_path, "dataset_prepared_path");
      for (const auto& p : prep.datasets)
        std::printf("  dataset %s (%s): %s %s\n", (p.test ? cfg.test_datasets : cfg.datasets)[p.index].path.c_str(),
                    (p.test ? cfg.test_datasets : cfg.datasets)[p.index].type.c_str(),
                    p.ready ? "tokenised in" : "to tokenise at start (or eo-ddp preprocess) into", p.dir.c_str());
      std::printf("config ok\n");
    }
    return kExitOk;
  }
  // Before any weight: rank 0 takes output_dir (lock, ownership, `auto` resolved against this
  // run's lineage, resume compatibility); every rank then resumes the same checkpoint. An error
  // on rank 0 ends every rank (main), so the others never wait for the broadcast.
  RunClaim claim;
  if (world.rank == 0) {
    claim = claim_output_dir(cfg, world.world_size);
    for (const auto& n : claim.notes) log::info(n);
    for (const auto& warning : claim.warnings) log::warn(warning);
  }
  cfg.resume_from_checkpoint = w.broadcast_string(claim.resume, 0);
  stop_point(w, "while taking output_dir");
  prepare_datasets(cfg, w);  // before any weight: a data problem costs no loading time
  stop_point(w, "after tokenising the datasets");
  return train(cfg, mc, w).exit_code;
}

}  // namespace eo::launch
