#include "runtime/trainer.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cmath>
#include <cstdio>
#include <limits>
#include <optional>

#include "common/error.h"
#include "common/fault_seam.h"
#include "common/log.h"
#include "common/text.h"
#include "models/moe_model.h"
#include "offload/engine.h"
#include "runtime/data/batcher.h"
#include "runtime/device.h"
#include "runtime/dist/comm.h"
#include "runtime/dist/reducer.h"
#include "runtime/dist/world.h"
#include "runtime/evaluate.h"
#include "runtime/loss_scale.h"
#include "runtime/metrics.h"
#include "runtime/one_step_behind.h"
#include "runtime/optimizer.h"
#include "runtime/setup.h"
#include "runtime/signals.h"
#include "runtime/step.h"
#include "runtime/train_state.h"

namespace eo {
namespace {

using Clock = std::chrono::steady_clock;

std::string format_scale(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.9g", s);
  return buf;
}

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

StepOptions step_options(const TrainConfig& cfg, const Run& run) {
  StepOptions o;
  o.checkpointing = run.spec.checkpointing;
  o.order = run.spec.order;
  o.activation_offloading = cfg.activation_offloading;
  o.aux_loss = cfg.output_router_logits;
  o.aux_coef = run.aux_coef / double(run.accum * std::max(1, run.comm->size()));
  o.random_blocks = run.spec.random_blocks;
  o.cuda_graphs = run.cuda_graphs;
  o.bank_reuse = run.spec.bank_reuse;
  return o;
}

// eval_steps / evals_per_epoch / saves_per_epoch as a step interval: N steps, a fraction of the
// run (rounded up, as transformers does), or k times per epoch of steps_per_epoch steps. 0 = never.
std::int64_t interval(std::optional<double> steps, std::optional<int> per_epoch, double steps_per_epoch, std::int64_t total) {
  if (steps) return *steps >= 1 ? static_cast<std::int64_t>(*steps) : static_cast<std::int64_t>(std::ceil(*steps * double(total)));
  if (per_epoch) return std::max<std::int64_t>(1, static_cast<std::int64_t>(std::ceil(steps_per_epoch / *per_epoch)));
  return 0;
}

}  // namespace

TrainResult train(const TrainConfig& cfg, dist::World& world, const TrainHooks& hooks) {
  return train(cfg, model::load_config(cfg.base_model), world, hooks);
}

TrainResult train(const TrainConfig& cfg, const model::ModelConfig& model, dist::World& world, const TrainHooks& hooks) {
  install_stop_signals();
  // A write past RLIMIT_FSIZE (ulimit -f) must fail with EFBIG and a message, like a full disk,
  // instead of killing the process with SIGXFSZ in the middle of a checkpoint.
  std::signal(SIGXFSZ, SIG_IGN);
  const auto& wi = world.info();
  Run run = setup_run(cfg, model, world);
  if (faults::plan().before_training) faults::plan().before_training();  // test seam
  {  // A stop requested while loading: nothing trained yet, so nothing to save.
    double stop[1] = {stop_requested() ? 1.0 : 0.0};
    world.allreduce_max(stop, 1);
    if (stop[0] > 0) {
      log::info("stopped before the first step (the request came while loading): nothing was trained, so nothing is "
                "lost and nothing was saved");
      TrainResult stopped;
      stopped.exit_code = kExitPreempted;
      return stopped;
    }
  }
  const at::Device device = run.device;
  data::Batcher& batcher = *run.batcher;
  Optimizer& optimizer = *run.optimizer;
  const auto& offloader = run.offloader;
  dist::GradReducer* reducer = run.reducer.get();
  const std::int64_t accum = run.accum, total_steps = run.total_steps, warmup = run.warmup;
  std::int64_t& step = run.step;
  std::vector<at::Tensor> params;
  for (const auto& [n, p] : run.lora) params.push_back(p);
  StepRunner runner(*run.model, step_options(cfg, run), static_cast<int>(accum), reducer);
  if (device.is_cuda() && wi.rank == 0)
    log::info("CUDA graphs: " + run.cuda_graphs_why +
              (run.cuda_graphs ? ": each block's forward, recompute + backward and the loss replay as graphs from their second use"
                               : std::string()));
  if (device.is_cuda() && wi.rank == 0) log::info("expert GEMMs: " + run.expert_gemm_why);
  if (device.is_cuda() && wi.rank == 0 && cfg.load_in_4bit && run.spec.bank_reuse != model::BankReuse::None)
    log::info(std::string("expert banks: each block's recompute keeps ") +
              (run.spec.bank_reuse == model::BankReuse::All ? "gate's, up's and down's" : "the down projection's") +
              " dequantised experts for its backward (expert_bank_reuse: " + cfg.expert_bank_reuse + ")");
  const double steps_per_epoch = double(batcher.num_batches_per_epoch()) / double(accum);
  const std::int64_t save_every =
      cfg.saves_per_epoch ? interval(std::nullopt, cfg.saves_per_epoch, steps_per_epoch, total_steps) : cfg.save_steps;
  const std::int64_t eval_every = run.eval_rows ? interval(cfg.eval_steps, cfg.evals_per_epoch, steps_per_epoch, total_steps) : 0;
  if (run.eval_rows && wi.rank == 0) {
    write_eval_rows(*run.eval_rows, cfg.output_dir + "/eval.jsonl");
    log::info("evaluation " + (eval_every > 0 ? "every " + std::to_string(eval_every) + " steps and " : std::string()) +
              "at the end; its rows are in " + cfg.output_dir + "/eval.jsonl (eo-ddp score --data gives the same loss)");
  }
  // Eval loss over all ranks, token-weighted: outside the step, so the offloader's step schedule
  // is set aside and put back (the eval stages blocks in layer order; its copies are not the step's).
  std::vector<bool> moe_blocks(run.model->num_layers());
  for (int i = 0; i < run.model->num_layers(); ++i) moe_blocks[i] = run.model->block(i).is_moe();
  auto evaluate = [&] {
    run.model->weight_provider().set_schedule({});
    const EvalSums e = evaluate_rows(*run.model, *run.eval_rows, wi.rank, wi.world_size,
                                     cfg.eval_batch_size.value_or(cfg.micro_batch_size));
    run.model->weight_provider().set_schedule(runner.schedule().staging_order(moe_blocks));
    if (offloader) offloader->take_step_stats();
    double sums[2] = {e.loss_sum, double(e.tokens)};
    world.allreduce_sum(sums, 2);
    return std::make_pair(sums[0] / std::max(1.0, sums[1]), static_cast<std::int64_t>(sums[1]));
  };

  std::unique_ptr<MetricsLog> metrics;
  if (wi.rank == 0) metrics = std::make_unique<MetricsLog>(cfg.output_dir, run.resumed_from.empty() ? 0 : step);
  // Non-finite steps skipped in all (metrics' skipped_nonfinite) and in a row; kept in checkpoints.
  std::int64_t skipped_nonfinite = run.resumed_extra.value("skipped_nonfinite", std::int64_t(0));
  std::int64_t nonfinite_streak = run.resumed_extra.value("nonfinite_streak", std::int64_t(0));
  // fp16: the loss scale (restored from the checkpoint, so a resumed run scales exactly as an
  // uninterrupted one), and the steps it skipped on a gradient overflow.
  LossScaler scaler(run.spec.compute == Compute::Fp16, device, cfg.loss_scale_growth_interval);
  scaler.load_state(run.resumed_extra);
  std::int64_t skipped_overflow = run.resumed_extra.value("skipped_overflow", std::int64_t(0));
  // The run's first step skipped for NaN/Inf (-1: none): the newest checkpoint before it is never
  // pruned, and is what the messages below point to.
  std::int64_t first_nonfinite = run.resumed_extra.value("first_nonfinite_step", std::int64_t(-1));
  // The newest checkpoint of a step before first_nonfinite (-1: none), kept in checkpoints.
  std::int64_t last_clean_save = first_nonfinite >= 0 ? run.resumed_extra.value("last_clean_checkpoint", std::int64_t(-1))
                                 : run.resumed_from.empty() ? -1 : step;
  auto earlier_checkpoint = [&] {
    return last_clean_save >= 0 ? "resume_from_checkpoint: " + cfg.output_dir + "/checkpoint-" + std::to_string(last_clean_save) +
                                      " (the newest checkpoint before that; kept)"
                                : std::string("start again (there is no checkpoint from before that)");
  };
  auto save = [&](const std::string& why) {
    TrainingState s;
    s.step = step;
    s.data_cursor = batcher.state();
    s.world_size = wi.world_size;
    s.lora = run.model->lora_parameters();
    s.optimizer = optimizer.state();
    s.rng = rng_state(device);
    const std::int64_t clean = first_nonfinite < 0 ? step : last_clean_save;
    s.extra = {{"skipped_nonfinite", skipped_nonfinite}, {"nonfinite_streak", nonfinite_streak},
               {"first_nonfinite_step", first_nonfinite}, {"last_clean_checkpoint", clean}};
    // A checkpoint from before nvfp4_merge_aware_start_step is an unprepared adapter: not stamped.
    if (cfg.nvfp4_merge_aware) s.extra[kMergeAwareOnKey] = run.model->merge_aware_active();
    if (scaler.enabled()) {
      s.extra.update(scaler.state());
      s.extra["skipped_overflow"] = skipped_overflow;
    }
    if (wi.rank == 0) {
      const std::string dir = save_checkpoint(cfg.output_dir, s, cfg, cfg.save_total_limit, first_nonfinite);
      log::info("saved " + dir + " (" + why + ")");
    }
    last_clean_save = clean;
  };

  // ---- loop
  // The host reads each step one step late (runtime/one_step_behind.h). A step with a non-finite
  // loss or gradient is skipped on the device (Optimizer::step's skip); the host learns of it,
  // counts and warns one step later. A step whose outcome the host needs before going on (the
  // last, a save, an evaluation, a stop, the first with an automatic budget, an after_step hook)
  // is read before the next is queued.
  //
  // Step times come from the device: a mark where the step's device work begins and one where it
  // ends (DeviceMark: CUDA events on the compute stream, the wall clock on the CPU). A step's time
  // is its end minus the previous step's end, so the device's idle time while it waited for the
  // host counts, as it does in the run's length. The first step, and a step after an evaluation,
  // a save or the automatic budget (work that is not a step's), run from their own begin mark.
  // host_s is the host's interval between reading two steps, kept to show a host-bound loop.
  struct Queued {
    std::int64_t step = 0, tokens = 0;  // tokens: target tokens, all ranks
    double lr = 0, epoch = 0;
    DeviceMark since, end;  // the step's time is end - since
    HostCopy values;  // fp64 [ce sum, aux sum (all ranks), ranks with a non-finite loss, gradient norm,
                      //       1 if the LoRA or optimizer state holds NaN/Inf after the step,
                      //       the loss scale the step used (1 without fp16)]
  };
  TrainResult result;
  const auto t_start = Clock::now();
  auto t_last = t_start;  // when the previous step was read (or the host's own work after it ended)
  const DeviceMark run_start = DeviceMark::record(device);  // device_clock_s counts from here
  DeviceMark last_end;  // the previous step's end, unset after work between steps
  reset_peak_memory(device);
  bool auto_budget_pending = offloader && run.spec.budget_auto;
  auto finish = [&](Queued q, bool eval_now) {
    const double* v = q.values.get().data_ptr<double>();  // waits for this step only
    const double ce_sum = v[0], aux_sum = v[1], bad_ranks = v[2], grad_norm = v[3], bad_state = v[4], loss_scale = v[5];
    const double global_tokens = double(std::max<std::int64_t>(1, q.tokens));
    const auto t_read = Clock::now();
    // The device's decision, taken from these same values (see the queueing below).
    const bool skip = bad_ranks > 0 || !std::isfinite(grad_norm);
    // fp16: finite losses and non-finite gradients at a scale above 1 are an overflow of the
    // scaled gradients, which the scale's backoff answers, not a NaN step; at 1 (16 halvings from
    // 2^16) nothing is scaled any more and they count as non-finite.
    const bool overflow = skip && scaler.enabled() && bad_ranks == 0 && loss_scale > 1;
    if (bad_state > 0)
      EO_FAIL("after step ", q.step, " the LoRA parameters or the optimizer state hold NaN/Inf values; skipping steps cannot "
              "undo that, so the run stops here and saves nothing more. ", earlier_checkpoint());
    if (overflow) {
      ++skipped_overflow;
      if (wi.rank == 0)
        log::info("step " + std::to_string(q.step) + ": the gradients overflowed fp16 at loss scale " + format_scale(loss_scale) +
                  "; skipped without an optimizer update, the scale halved (fp16 loss scaling)");
    } else if (skip) {
      if (first_nonfinite < 0) first_nonfinite = q.step;
      ++skipped_nonfinite;
      ++nonfinite_streak;
      if (wi.rank == 0)
        log::warn("step " + std::to_string(q.step) + ": loss " + std::to_string(ce_sum / global_tokens) + ", gradient norm " +
                  std::to_string(grad_norm) + " (non-finite loss on " + std::to_string(int(bad_ranks)) + " of " +
                  std::to_string(wi.world_size) + " rank(s)); skipped without an optimizer update (" + std::to_string(nonfinite_streak) + " in a row, " +
                  std::to_string(cfg.max_nonfinite_steps) + " stop the run)");
    } else {
      nonfinite_streak = 0;
    }
    StepReport r;
    r.step = q.step;
    r.total_steps = total_steps;
    r.epoch = q.epoch;
    r.loss = ce_sum / global_tokens;
    r.lr = q.lr;
    r.grad_norm = grad_norm;
    r.tokens = q.tokens;
    r.step_time_s = q.end.seconds_since(q.since);
    r.device_clock_s = q.end.seconds_since(run_start);
    r.host_s = std::chrono::duration<double>(t_read - t_last).count();
    t_last = t_read;
    r.tokens_per_sec = double(q.tokens) / std::max(1e-9, r.step_time_s);
    r.peak_mem_bytes = peak_memory_bytes(device);
    r.elapsed_s = seconds_since(t_start);
    if (cfg.output_router_logits) r.extra["aux_loss"] = aux_sum / double(accum * wi.world_size);
    if (offloader) r.extra.update(offloader->take_step_stats().to_metrics());
    if (result.steps == 0) result.first_loss = r.loss;
    result.last_loss = r.loss;
    result.steps = q.step;
    r.extra["skipped_nonfinite"] = skipped_nonfinite;
    if (scaler.enabled()) {
      r.extra["loss_scale"] = loss_scale;  // the scale this step's backward used
      r.extra["skipped_overflow"] = skipped_overflow;
    }
    if (eval_now) {
      const auto [eval_loss, eval_tokens] = evaluate();
      r.extra["eval_loss"] = eval_loss;
      r.extra["eval_perplexity"] = std::exp(eval_loss);
      r.extra["eval_tokens"] = eval_tokens;
      result.eval_loss = eval_loss;
      t_last = Clock::now();  // the evaluation is not the next step's time
      last_end = DeviceMark();
    }
    if (wi.rank == 0 && (skip || eval_now || q.step % cfg.logging_steps == 0 || q.step == total_steps)) {
      log::progress(progress_line(r), q.step == total_steps);
      metrics->write(r);
    }
    if (hooks.after_step) hooks.after_step(q.step);
    if (nonfinite_streak >= cfg.max_nonfinite_steps)
      EO_FAIL("the loss or gradients were NaN/Inf for ", nonfinite_streak, " consecutive steps (", q.step - nonfinite_streak + 1,
              " to ", q.step, ", max_nonfinite_steps: ", cfg.max_nonfinite_steps,
              "); stopping. Those steps did not change the adapter. Lower learning_rate, check the data, or ",
              earlier_checkpoint());
  };
  OneStepBehind<Queued> reader(finish);
  // nvfp4_merge_aware from its first step on (axolotl's MergeAwareScheduleCallback, on_step_begin
  // with global_step = the steps completed; a resumed run turns it on at once when past it). Once
  // on it stays on, so the saved adapter's last forward is the snapped one.
  const std::int64_t merge_aware_from = cfg.nvfp4_merge_aware ? merge_aware_first_step(cfg, total_steps) : -1;
  while (step < total_steps) try {
    if (merge_aware_from >= 0 && step >= merge_aware_from && !run.model->merge_aware_active()) {
      run.model->set_merge_aware_active(true);
      if (wi.rank == 0) log::info("nvfp4_merge_aware: the NVFP4-snapped forward is on from step " + std::to_string(step + 1));
    }
    if (hooks.before_step) hooks.before_step(step + 1);
    const bool inject_nan = faults::plan().at_step && faults::plan().at_step(step + 1, wi.rank);  // test seam
    const bool inject_overflow = faults::plan().overflow_at && faults::plan().overflow_at(step + 1, wi.rank);  // test seam
    const std::int64_t step_start_allocated = allocated_memory_bytes(device);
    const DeviceMark begin = DeviceMark::record(device);
    if (hooks.step_work) hooks.step_work(step + 1, true);
    std::vector<data::MicroBatch> micro;
    std::int64_t tokens[1] = {0};
    for (std::int64_t m = 0; m < accum; ++m) {
      micro.push_back(batcher.next());
      tokens[0] += micro.back().num_target_tokens;
    }
    world.allreduce_sum(tokens, 1);
    const double global_tokens = double(std::max<std::int64_t>(1, tokens[0]));
    // fp16: this step's loss scale (the fault seam's overflow: infinite on this rank).
    at::Tensor loss_scale = scaler.scale();
    if (inject_overflow) loss_scale = at::full({}, INFINITY, at::TensorOptions().dtype(at::kFloat).device(device));
    const StepLosses sl = runner.run(micro, global_tokens, [&](int) { return inject_nan; }, loss_scale);
    if (faults::plan().in_step_work) faults::plan().in_step_work(step + 1);  // test seam
    if (reducer) reducer->finalize();
    // Clipping rides in AdamW: it divides each gradient by the divisor as it reads it (1 when the
    // norm is within max_grad_norm or not finite).
    // With fp16 the gradients are the scaled loss's: the norm (reported, and clipped against) is
    // theirs divided by the scale, and AdamW divides each by scale × the clip divisor (powers of
    // two times the divisor: the same as unscaling first, as GradScaler.unscale_ does).
    const at::Tensor scaled_norm = grad_norm_on_device(params);
    const at::Tensor norm = scaler.enabled() ? scaled_norm / scaler.scale().to(at::kDouble) : scaled_norm;
    const double lr = cfg.learning_rate * lr_multiplier(cfg.lr_scheduler, step, warmup, total_steps);
    // Non-finite guard, decided on the device (fp16's overflow check is this guard: the norm is of
    // the all-reduced gradients, so every rank finds the same overflow). The gradients are all-reduced but the loss is not,
    // so each rank adds a flag and every rank takes the same decision from the summed flags (the
    // norm, of all-reduced gradients, is the same everywhere). A skipped step leaves the LoRA and
    // the optimizer state (AdamW's step count included) untouched; it still counts as a step (its
    // batch is consumed and the LR schedule, a function of the step, moves on), as transformers'
    // Trainer does when the AMP grad scaler skips an update.
    const at::Tensor ce = sl.ce_sum.to(at::kDouble);
    const at::Tensor aux = sl.aux_sum.defined() ? sl.aux_sum.to(ce.device(), at::kDouble) : at::zeros_like(ce);
    const at::Tensor sums = at::stack({ce, aux, at::logical_not(at::isfinite(ce) & at::isfinite(aux)).to(at::kDouble)});
    run.comm->allreduce(sums, dist::ReduceOp::kSum, "the step's losses");
    const at::Tensor grad_norm = norm.to(sums.device(), at::kDouble);
    const at::Tensor skip = ((sums[2] > 0) | at::logical_not(at::isfinite(grad_norm))).to(at::kFloat);
    const at::Tensor divisor = clip_divisor(norm, cfg.max_grad_norm);
    optimizer.step(lr, skip, scaler.enabled() ? divisor * scaler.scale() : divisor);
    const at::Tensor scale_used =
        scaler.enabled() ? scaler.scale().to(sums.device(), at::kDouble).reshape({1}) : at::ones({1}, sums.options());
    scaler.update(skip);  // GradScaler.update: back off on the skip, else count towards growth
    // Graphs accumulate into the gradients at fixed addresses: zero them in place.
    optimizer.zero_grad(/*set_to_none=*/!runner.graphs_enabled());
    if (faults::plan().nan_state_at == step + 1) {  // test seam: a NaN in the LoRA as a bad update would leave
      at::NoGradGuard ng;
      params.front().view(-1).narrow(0, 0, 1).fill_(std::numeric_limits<float>::quiet_NaN());
    }
    const at::Tensor bad_state = optimizer.state_nonfinite().to(sums.device());
    if (offloader) offloader->end_step();
    ++step;
    Queued q;
    q.step = step;
    q.tokens = tokens[0];
    q.lr = lr;
    q.epoch = batcher.epochs_after(micro.back());
    q.end = DeviceMark::record(device);
    if (hooks.step_work) hooks.step_work(step, false);
    q.since = last_end.defined() ? last_end : begin;
    last_end = q.end;
    q.values = HostCopy(at::cat({sums, grad_norm.reshape({1}), bad_state.reshape({1}), scale_used}));
    // A stop request on any rank stops every rank at this same step.
    double stop[1] = {stop_requested() ? 1.0 : 0.0};
    world.allreduce_max(stop, 1);
    const bool eval_now = run.eval_rows && ((eval_every > 0 && step % eval_every == 0) || step == total_steps);
    const bool save_now = save_every > 0 && step % save_every == 0 && step < total_steps;
    if (faults::plan().after_queue) faults::plan().after_queue(step);  // test seam
    reader.queued(std::move(q), step == total_steps || eval_now || save_now || stop[0] > 0 || auto_budget_pending || hooks.after_step,
                  eval_now);
    if (stop[0] > 0) {
      save("stop requested by signal " + std::to_string(stop_signal()));
      log::info("stopped at step " + std::to_string(step) + "; resume with resume_from_checkpoint: auto");
      result.exit_code = kExitPreempted;
      return result;
    }
    if (save_now) {
      save(cfg.saves_per_epoch ? "saves_per_epoch" : "save_steps");
      t_last = Clock::now();
      last_end = DeviceMark();
    }
    if (auto_budget_pending) {
      size_auto_budget(*offloader, device, step_start_allocated);
      auto_budget_pending = false;
      t_last = Clock::now();
      last_end = DeviceMark();
    }
  } catch (...) {
    reader.flush_after_failure();
    throw;
  }
  save("end of training");
  if (wi.world_size > 1) {
    // Every rank must end with the same adapter; a difference is a bug worth failing loudly on.
    std::vector<at::Tensor> host;
    std::vector<dist::HostBytes> ranges;
    for (const auto& [n, p] : run.lora) host.push_back(p.detach().to(at::kCPU).contiguous());
    for (const auto& t : host) ranges.push_back({t.data_ptr(), static_cast<std::size_t>(t.numel() * t.element_size())});
    const dist::CommStats cs = run.comm->stats();
    dist::check_same_bytes(ranges, *run.comm, "LoRA parameters after training");
    log::info("LoRA identical on all " + std::to_string(wi.world_size) + " ranks; collectives: allreduce " +
              std::to_string(cs.allreduce_bytes) + " bytes, broadcast " + std::to_string(cs.broadcast_bytes) + " bytes");
  }
  if (wi.rank == 0) {
    write_adapter(cfg.output_dir, run.model->lora_parameters(), cfg, cfg.nvfp4_merge_aware && run.model->merge_aware_active());
    const auto tokenizer = copy_tokenizer_files(cfg.base_model, cfg.output_dir);
    if (!tokenizer.empty()) log::info("tokenizer files copied beside the adapter: " + join(tokenizer, ", "));
    log::info("adapter written to " + cfg.output_dir + " (adapter_model.safetensors, adapter_config.json)");
  }
  result.adapter_dir = cfg.output_dir;
  return result;
}

}  // namespace eo
