#include "runtime/checkpointer.h"

#include <map>
#include <optional>

#include "common/log.h"
#include "models/moe_model.h"
#include "runtime/adapter_files.h"
#include "runtime/data/batcher.h"
#include "runtime/expert_lora_offload.h"
#include "runtime/ddp/world.h"
#include "runtime/loss_scale.h"
#include "runtime/nonfinite_guard.h"
#include "runtime/optimizer.h"
#include "runtime/setup.h"
#include "runtime/step_interval.h"
#include "runtime/train_state.h"

namespace eo {

Checkpointer::Checkpointer(const TrainConfig& cfg, Run& run, NonfiniteGuard& guard, const LossScaler& scaler, ddp::World& world)
    : cfg_(cfg), run_(run), guard_(guard), scaler_(scaler), rank_(world.info().rank), world_size_(world.info().world_size) {
  const double steps_per_epoch = double(run.batcher->num_batches_per_epoch()) / double(run.spec.accum);
  const auto save_steps = cfg.save_steps.value_or(0) > 0 ? cfg.save_steps : std::nullopt;
  every_ = step_interval(save_steps, cfg.saves_per_epoch, steps_per_epoch, run.total_steps);
}

bool Checkpointer::due(std::int64_t step) const { return every_ > 0 && step % every_ == 0 && step < run_.total_steps; }

const char* Checkpointer::schedule_key() const { return cfg_.saves_per_epoch ? "saves_per_epoch" : "save_steps"; }

void Checkpointer::save(const std::string& why) {
  TrainingState s;
  s.step = run_.step;
  s.data_cursor = run_.batcher->state();
  s.world_size = world_size_;
  if (run_.expert_lora) run_.expert_lora->apply_update();  // its masters, updated as blocks are staged
  s.lora = run_.model->lora_parameters();
  s.optimizer = run_.optimizer->state();
  if (run_.expert_lora)  // the same names as a resident run's: one file either way
    for (auto& entry : run_.expert_lora->optimizer_state()) s.optimizer.push_back(std::move(entry));
  s.rng = rng_state(run_.device);
  s.extra = guard_.checkpoint_state(run_.step);
  // A checkpoint from before nvfp4_merge_aware_start_step is an unprepared adapter: not stamped.
  if (cfg_.nvfp4_merge_aware) s.extra[kMergeAwareOnKey] = run_.model->merge_aware_active();
  if (scaler_.enabled()) s.extra.update(scaler_.state());
  if (rank_ == 0) {
    const std::string dir = save_checkpoint(cfg_.output_dir, s, cfg_, cfg_.save_total_limit, guard_.first_nonfinite());
    log::info("saved " + dir + " (" + why + ")");
  }
  guard_.saved(run_.step);
}

}  // namespace eo
