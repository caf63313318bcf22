#include "runtime/run_end.h"

#include <ATen/ATen.h>

#include "common/log.h"
#include "common/text.h"
#include "models/moe_model.h"
#include "runtime/adapter_files.h"
#include "runtime/checkpointer.h"
#include "runtime/ddp/comm.h"
#include "runtime/ddp/reducer.h"
#include "runtime/ddp/world.h"
#include "runtime/expert_lora_offload.h"
#include "runtime/output_dir.h"
#include "runtime/progress.h"
#include "runtime/setup.h"
#include "runtime/train_state.h"
#include "runtime/train_step.h"

namespace eo {
namespace {

// Every rank must end with the same adapter; a difference is a bug worth failing loudly on.
void check_ranks_hold_one_adapter(const Run& run, int world_size) {
  std::vector<at::Tensor> host;
  std::vector<ddp::HostBytes> ranges;
  for (const auto& [n, p] : run.lora) host.push_back(p.detach().to(at::kCPU).contiguous());
  for (const auto& t : host) ranges.push_back({t.data_ptr(), static_cast<std::size_t>(t.numel() * t.element_size())});
  const ddp::CommStats cs = run.comm->stats();
  ddp::check_same_bytes(ranges, *run.comm, "LoRA parameters after training");
  log::info("LoRA identical on all " + std::to_string(world_size) + " ranks; collectives: allreduce " +
            std::to_string(cs.allreduce_bytes) + " bytes, broadcast " + std::to_string(cs.broadcast_bytes) + " bytes");
}

}  // namespace

TrainResult result_so_far(const RunTally& tally) {
  TrainResult r;
  r.steps = tally.last_step;
  if (tally.steps_read > 0) r.first_loss = tally.first_loss, r.last_loss = tally.last_loss;
  r.eval_loss = tally.eval_loss;
  return r;
}

TrainResult end_run(const TrainConfig& cfg, Run& run, Checkpointer& checkpoints, const RunTally& tally, const StepClock& clock,
                    ddp::World& world) {
  const auto& wi = world.info();
  if (run.expert_lora) run.expert_lora->apply_update();  // the last update of its masters
  checkpoints.save("end of training");
  if (wi.world_size > 1) check_ranks_hold_one_adapter(run, wi.world_size);
  if (wi.rank == 0) {
    const std::string into = held_output_dir(cfg.output_dir);  // the locked folder, even if renamed meanwhile
    write_adapter(into, run.model->lora_parameters(), run.adapter, run.spec.merge_aware && run.model->merge_aware_active());
    const auto tokenizer = copy_tokenizer_files(cfg.base_model, into);
    if (!tokenizer.empty()) log::info("tokenizer files copied beside the adapter: " + join(tokenizer, ", "));
    log::info("adapter written to " + cfg.output_dir + " (adapter_model.safetensors, adapter_config.json)");
    log::info(run_summary(tally, run.total_steps, clock.elapsed_s(), run.device.is_cuda() ? "VRAM" : "RSS", cfg.output_dir));
  }
  TrainResult result = result_so_far(tally);
  result.adapter_dir = cfg.output_dir;
  return result;
}

}  // namespace eo
