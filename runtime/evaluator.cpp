#include "runtime/evaluator.h"

#include <algorithm>
#include <optional>

#include "common/log.h"
#include "models/moe_model.h"
#include "offload/engine.h"
#include "runtime/data/batcher.h"
#include "runtime/ddp/world.h"
#include "runtime/evaluate.h"
#include "runtime/setup.h"
#include "runtime/step.h"
#include "runtime/step_interval.h"

namespace eo {

Evaluator::Evaluator(const TrainConfig& cfg, Run& run, const StepRunner& runner, ddp::World& world)
    : cfg_(cfg), run_(run), runner_(runner), world_(world) {
  if (!run.eval_rows) return;
  const double steps_per_epoch = double(run.batcher->num_batches_per_epoch()) / double(run.spec.accum);
  every_ = step_interval(cfg.eval_steps, cfg.evals_per_epoch, steps_per_epoch, run.total_steps);
  for (int i = 0; i < run.model->num_layers(); ++i) moe_blocks_.push_back(run.model->block(i).is_moe());
  if (world.info().rank == 0) {
    write_eval_rows(*run.eval_rows, cfg.output_dir + "/eval.jsonl");
    log::info("evaluation " + (every_ > 0 ? "every " + std::to_string(every_) + " steps and " : std::string()) +
              "at the end; its rows are in " + cfg.output_dir + "/eval.jsonl (eo-ddp score --data gives the same loss)");
  }
}

bool Evaluator::due(std::int64_t step) const {
  return run_.eval_rows && ((every_ > 0 && step % every_ == 0) || step == run_.total_steps);
}

// Outside the step, so the offloader's step schedule is set aside and put back (the evaluation
// stages blocks in layer order; its copies are not the step's).
std::pair<double, std::int64_t> Evaluator::run() {
  const auto& wi = world_.info();
  model::MoeModel& model = *run_.model;
  model.weight_provider().set_schedule({});
  const EvalSums e = evaluate_rows(model, *run_.eval_rows, wi.rank, wi.world_size, cfg_.eval_batch_size.value_or(cfg_.micro_batch_size));
  model.weight_provider().set_schedule(runner_.schedule().staging_order(moe_blocks_));
  if (run_.offloader) run_.offloader->take_step_stats();
  double sums[2] = {e.loss_sum, double(e.tokens)};
  world_.allreduce_sum(sums, 2);
  return {sums[0] / std::max(1.0, sums[1]), static_cast<std::int64_t>(sums[1])};
}

}  // namespace eo
