#include "runtime/train_step.h"

#include <ATen/ATen.h>

#include <chrono>
#include <cmath>

#include "common/log.h"
#include "models/moe_model.h"
#include "offload/engine.h"
#include "runtime/adapter_files.h"
#include "runtime/data/batcher.h"
#include "runtime/ddp/comm.h"
#include "runtime/ddp/reducer.h"
#include "runtime/ddp/world.h"
#include "runtime/expert_lora_offload.h"
#include "runtime/loss_scale.h"
#include "runtime/optimizer.h"
#include "runtime/setup.h"
#include "runtime/step.h"
#include "runtime/train_state.h"
#include "runtime/trainer.h"

namespace eo {

StepValues QueuedStep::read() {
  const double* v = values.get().data_ptr<double>();
  const double bad_state = host_state_check ? std::max(v[4], host_state_check()) : v[4];
  return {v[0], v[1], v[2], v[3], bad_state, v[5]};
}

TrainStep::TrainStep(const TrainConfig& cfg, Run& run, StepRunner& runner, LossScaler& scaler, ddp::World& world,
                     const TrainHooks& hooks)
    : cfg_(cfg), run_(run), runner_(runner), scaler_(scaler), world_(world), hooks_(hooks) {
  for (const auto& [n, p] : run.lora)
    if (!run.expert_lora || !run.expert_lora->holds(p)) params_.push_back(p);  // the host's are its own
  // nvfp4_merge_aware from its first step on (axolotl's MergeAwareScheduleCallback, on_step_begin
  // with global_step = the steps completed; a resumed run turns it on at once when past it). Once
  // on it stays on, so the saved adapter's last forward is the snapped one.
  if (cfg.nvfp4_merge_aware) merge_aware_from_ = merge_aware_first_step(cfg, run.total_steps);
}

QueuedStep TrainStep::queue() {
  const at::Device device = run_.device;
  const int rank = world_.info().rank;
  std::int64_t& step = run_.step;
  if (merge_aware_from_ >= 0 && step >= merge_aware_from_ && !run_.model->merge_aware_active()) {
    run_.model->set_merge_aware_active(true);
    if (rank == 0) log::info("nvfp4_merge_aware: the NVFP4-snapped forward is on from step " + std::to_string(step + 1));
  }
  if (hooks_.before_step) hooks_.before_step(step + 1);
  const bool poison = hooks_.poison_loss && hooks_.poison_loss(step + 1, rank);
  const bool overflow = hooks_.overflow && hooks_.overflow(step + 1, rank);
  QueuedStep q;
  q.start_allocated = allocated_memory_bytes(device);
  q.begin = DeviceMark::record(device);
  if (hooks_.step_work) hooks_.step_work(step + 1, true);
  std::vector<data::MicroBatch> micro;
  std::int64_t tokens[1] = {0};
  for (std::int64_t m = 0; m < run_.spec.accum; ++m) {
    micro.push_back(run_.batcher->next());
    tokens[0] += micro.back().num_target_tokens;
  }
  world_.allreduce_sum(tokens, 1);
  const double global_tokens = double(std::max<std::int64_t>(1, tokens[0]));
  // fp16: this step's loss scale (an overflow injected by a test: infinite on this rank).
  at::Tensor loss_scale = scaler_.scale();
  if (overflow) loss_scale = at::full({}, INFINITY, at::TensorOptions().dtype(at::kFloat).device(device));
  const StepLosses sl = runner_.run(micro, global_tokens, [&](int) { return poison; }, loss_scale);
  if (hooks_.in_step_work) hooks_.in_step_work(step + 1);
  if (run_.expert_lora) run_.expert_lora->flush();  // the host-held gradients start home
  if (run_.reducer) run_.reducer->finalize();
  const double lr = cfg_.learning_rate * lr_multiplier(cfg_.lr_scheduler, step, run_.warmup, run_.total_steps);
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
  run_.comm->allreduce(sums, ddp::ReduceOp::kSum, "the step's losses");
  // With the experts' LoRA on the host the step's norm covers its gradients too: on one rank their
  // norms were taken on the device as they went home; across ranks the host all-reduces them and
  // the update is decided there from the same values, read once (the step's one synchronisation).
  ExpertLoraOffload* const held = run_.expert_lora.get();
  const HostUpdate host = held && !held->norms_on_device() ? update_host_lora(sums, lr) : HostUpdate{};
  const at::Tensor scaled_norm = host.scaled_norm.defined() ? host.scaled_norm
                                 : held                     ? held->grad_norm(run_.lora, params_)
                                                            : grad_norm_on_device(params_);
  const UpdateDecision d = decide_update(scaled_norm, sums[2], scaler_.enabled() ? scaler_.scale() : at::Tensor());
  const at::Tensor grad_norm = d.norm.to(sums.device(), at::kDouble);
  const at::Tensor& skip = d.skip;
  run_.optimizer->step(lr, skip, d.grad_divisor);
  const at::Tensor scale_used =
      scaler_.enabled() ? scaler_.scale().to(sums.device(), at::kDouble).reshape({1}) : at::ones({1}, sums.options());
  scaler_.update(skip);  // GradScaler.update: back off on the skip, else count towards growth
  // Graphs accumulate into the gradients at fixed addresses: zero them in place.
  run_.optimizer->zero_grad(/*set_to_none=*/!runner_.graphs_enabled());
  if (hooks_.after_update) hooks_.after_update(step + 1, params_);
  const at::Tensor bad_state = run_.optimizer->state_nonfinite().to(sums.device());
  // The host-held update, applied as the next step stages its blocks.
  q.host_state_check = host.state_check ? host.state_check : held ? held->step(lr, d.skip, d.grad_divisor) : nullptr;
  if (run_.offloader) run_.offloader->end_step();
  ++step;
  q.step = step;
  q.tokens = tokens[0];
  q.lr = lr;
  q.epoch = run_.batcher->epochs_after(micro.back());
  q.end = DeviceMark::record(device);
  if (hooks_.step_work) hooks_.step_work(step, false);
  q.values = HostCopy(at::cat({sums, grad_norm.reshape({1}), bad_state.reshape({1}), scale_used}));
  return q;
}

TrainStep::UpdateDecision TrainStep::decide_update(const at::Tensor& scaled_norm, const at::Tensor& nonfinite_flags,
                                                   const at::Tensor& scale) const {
  // Clipping rides in AdamW: it divides each gradient by the divisor as it reads it (1 when the
  // norm is within max_grad_norm or not finite). With fp16 the gradients are the scaled loss's:
  // the norm (reported, and clipped against) is theirs divided by the scale, and AdamW divides
  // each by scale × the clip divisor (powers of two times the divisor: the same as unscaling
  // first, as GradScaler.unscale_ does).
  UpdateDecision d;
  d.norm = scale.defined() ? scaled_norm / scale.to(scaled_norm.device(), at::kDouble) : scaled_norm;
  d.skip = ((nonfinite_flags.to(d.norm.device()) > 0) | at::logical_not(at::isfinite(d.norm))).to(at::kFloat);
  const at::Tensor divisor = clip_divisor(d.norm, cfg_.max_grad_norm);
  d.grad_divisor = scale.defined() ? divisor * scale.to(divisor.device()) : divisor;
  return d;
}

TrainStep::HostUpdate TrainStep::update_host_lora(const at::Tensor& sums, double lr) {
  // One read of the device: the flags, the device's per-parameter norms and the loss scale. The
  // host-held gradients were queued home before these (flush), so they are home too.
  const at::Tensor dev_norms = grad_norms(params_);
  const at::Tensor scale = scaler_.enabled() ? scaler_.scale().reshape({1}).to(at::kDouble) : at::ones({1}, sums.options());
  const auto t0 = std::chrono::steady_clock::now();
  const at::Tensor read = at::cat({sums.reshape({-1}), scale.to(sums.device()), dev_norms.to(sums.device(), at::kDouble)}).to(at::kCPU);
  run_.expert_lora->add_read_time(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  const at::Tensor norms = read.narrow(0, 4, read.numel() - 4).to(at::kFloat);
  HostUpdate h;
  const at::Tensor host_norm = run_.expert_lora->reduce_and_norm(run_.lora, norms, run_.comm.get());
  const at::Tensor host_scale = read[3].to(at::kFloat);
  const UpdateDecision d = decide_update(host_norm, read[2], scaler_.enabled() ? host_scale : at::Tensor());
  h.state_check = run_.expert_lora->step(lr, d.skip, d.grad_divisor);
  h.scaled_norm = host_norm.to(sums.device());
  return h;
}

StepClock::StepClock(const at::Device& device)
    : t_start_(Clock::now()), t_last_(t_start_), run_start_(DeviceMark::record(device)) {
  reset_peak_memory(device);
}

void StepClock::queued(QueuedStep& q) {
  q.since = last_end_.defined() ? last_end_ : q.begin;
  last_end_ = q.end;
}

void StepClock::other_work() {
  t_last_ = Clock::now();
  last_end_ = DeviceMark();
}

double StepClock::host_interval() {
  const auto now = Clock::now();
  const double s = std::chrono::duration<double>(now - t_last_).count();
  t_last_ = now;
  return s;
}

}  // namespace eo
