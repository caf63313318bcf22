#include "runtime/trainer.h"

#include <csignal>

#include "common/log.h"
#include "models/attention_path.h"
#include "models/moe_model.h"
#include "runtime/checkpointer.h"
#include "runtime/ddp/comm.h"
#include "runtime/ddp/world.h"
#include "runtime/evaluator.h"
#include "runtime/fault_hooks.h"
#include "runtime/loss_scale.h"
#include "runtime/model_overrides.h"
#include "runtime/nonfinite_guard.h"
#include "runtime/one_step_behind.h"
#include "runtime/run_end.h"
#include "runtime/setup.h"
#include "runtime/signals.h"
#include "runtime/step.h"
#include "runtime/step_reader.h"
#include "runtime/train_step.h"

namespace eo {
namespace {

StepOptions step_options(const RunSpec& spec, int ranks) {
  StepOptions o;
  o.checkpointing = spec.checkpointing;
  o.order = spec.order;
  o.activation_offloading = spec.activation_offloading;
  o.aux_loss = spec.aux_loss;
  o.aux_coef = spec.aux_coef / double(spec.accum * std::max(1, ranks));
  o.random_blocks = spec.random_blocks;
  o.cuda_graphs = spec.graphs;
  return o;
}

// A stop requested on any rank (a signal) stops every rank at the same point.
bool stop_requested_anywhere(ddp::World& world) {
  double stop[1] = {stop_requested() ? 1.0 : 0.0};
  world.allreduce_max(stop, 1);
  return stop[0] > 0;
}

// What the step does on a GPU, said once.
void log_step_choices(const TrainConfig& cfg, const Run& run) {
  const RunSpec& spec = run.spec;
  if (!run.device.is_cuda()) return;
  log::info("CUDA graphs: " + spec.graphs_why +
            (spec.graphs ? ": each block's forward, recompute + backward and the loss replay as graphs from their second use"
                         : std::string()));
  log::info("expert GEMMs: " + spec.expert_gemm_why);
  if (spec.packed)
    log::info("packed rows: " + model::packed_attention_summary(
                                    spec.model, spec.sequence_len,
                                    model::flash_attention_runs(run.device, run.model->options().dtype)));
  if (spec.load_in_4bit && spec.bank_reuse != model::BankReuse::None)
    log::info(std::string("expert banks: each block's recompute keeps ") +
              (spec.bank_reuse == model::BankReuse::All ? "gate's, up's and down's" : "the down projection's") +
              " dequantised experts for its backward (expert_bank_reuse: " + cfg.expert_bank_reuse + ")");
}

}  // namespace

TrainResult train(const TrainConfig& cfg, ddp::World& world, const TrainHooks& hooks) {
  return train(cfg, load_model_config(cfg), world, hooks);
}

TrainResult train(const TrainConfig& cfg, const model::ModelConfig& model, ddp::World& world, const TrainHooks& given_hooks) {
  install_stop_signals();
  // A write past RLIMIT_FSIZE (ulimit -f) must fail with EFBIG and a message, like a full disk,
  // instead of killing the process with SIGXFSZ in the middle of a checkpoint.
  std::signal(SIGXFSZ, SIG_IGN);
  const TrainHooks hooks = with_fault_plan(given_hooks);
  const auto& wi = world.info();
  Run run = setup_run(cfg, model, world);
  if (hooks.before_training) hooks.before_training();
  if (stop_requested_anywhere(world)) {  // while loading: nothing trained yet, so nothing to save
    log::info("stopped before the first step (the request came while loading): nothing was trained, so nothing is "
              "lost and nothing was saved");
    TrainResult stopped;
    stopped.exit_code = kExitPreempted;
    return stopped;
  }
  if (wi.rank == 0) log_step_choices(cfg, run);
  StepRunner runner(*run.model, step_options(run.spec, run.comm->size()), run.spec.accum,
                    run.reducer.get());
  Evaluator evaluator(cfg, run, runner, world);
  // fp16: the loss scale, restored from the checkpoint, so a resumed run scales exactly as an
  // uninterrupted one.
  LossScaler scaler(run.spec.compute == Compute::Fp16, run.device, cfg.loss_scale_growth_interval);
  scaler.load_state(run.resumed_extra);
  NonfiniteGuard guard(run.resumed_extra, run.resumed_from.empty() ? -1 : run.step, cfg.max_nonfinite_steps, cfg.output_dir,
                       scaler.enabled(), wi.rank, wi.world_size);
  Checkpointer checkpoints(cfg, run, guard, scaler, world);
  TrainStep train_step(cfg, run, runner, scaler, world, hooks);
  StepClock clock(run.device);
  StepReader reader(cfg, run, guard, evaluator, clock, hooks, world);
  bool auto_budget_pending = run.offloader && run.spec.budget_auto;

  // ---- loop
  // The host reads each step one step late (runtime/one_step_behind.h). A step with a non-finite
  // loss or gradient is skipped on the device; the host learns of it, counts and warns one step
  // later (runtime/nonfinite_guard.h). A step whose outcome the host needs before going on (the
  // last, a save, an evaluation, a stop, the first with an automatic budget, an after_step hook)
  // is read before the next is queued.
  OneStepBehind<QueuedStep> behind([&](QueuedStep q, bool eval_now) { reader.read(std::move(q), eval_now); });
  while (run.step < run.total_steps) try {
    QueuedStep q = train_step.queue();
    clock.queued(q);
    const std::int64_t step = q.step, start_allocated = q.start_allocated;
    const bool stop = stop_requested_anywhere(world);
    const bool eval_now = evaluator.due(step), save_now = checkpoints.due(step);
    if (hooks.after_queue) hooks.after_queue(step);
    const bool read_now = step == run.total_steps || eval_now || save_now || stop || auto_budget_pending || hooks.after_step;
    behind.queued(std::move(q), read_now, eval_now);
    if (stop) {
      checkpoints.save(stop_signal() ? "stop requested by signal " + std::to_string(stop_signal())
                                     : std::string("stop requested: another rank was signalled"));
      log::info("stopped at step " + std::to_string(step) + "; resume with resume_from_checkpoint: auto");
      TrainResult stopped = result_so_far(reader.tally());
      stopped.exit_code = kExitPreempted;
      return stopped;
    }
    if (save_now) {
      checkpoints.save(checkpoints.schedule_key());
      clock.other_work();
    }
    if (auto_budget_pending) {
      size_auto_budget(*run.offloader, run.device, start_allocated);
      auto_budget_pending = false;
      clock.other_work();
    }
  } catch (...) {
    behind.flush_after_failure();
    throw;
  }
  guard.check_trained(run.step);  // a run that learned nothing does not succeed
  return end_run(cfg, run, checkpoints, reader.tally(), clock, world);
}

}  // namespace eo
