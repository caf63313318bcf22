#include "runtime/step_reader.h"

#include <algorithm>
#include <cmath>

#include "common/log.h"
#include "offload/engine.h"
#include "runtime/device.h"
#include "runtime/ddp/world.h"
#include "runtime/evaluator.h"
#include "runtime/expert_lora_offload.h"
#include "runtime/metrics.h"
#include "runtime/nonfinite_guard.h"
#include "runtime/setup.h"
#include "runtime/train_step.h"
#include "runtime/trackers.h"
#include "runtime/trainer.h"

namespace eo {

StepReader::StepReader(const TrainConfig& cfg, Run& run, NonfiniteGuard& guard, Evaluator& eval, StepClock& clock,
                       const TrainHooks& hooks, ddp::World& world)
    : cfg_(cfg), run_(run), guard_(guard), eval_(eval), clock_(clock), hooks_(hooks), rank_(world.info().rank),
      world_size_(world.info().world_size) {
  if (rank_ == 0) {
    metrics_ = std::make_unique<MetricsLog>(cfg.output_dir, run.resumed_from.empty() ? 0 : run.step);
    trackers_ = std::make_unique<Trackers>(cfg, metrics_->path());
  }
}

StepReader::~StepReader() = default;

void StepReader::read(QueuedStep q, bool eval_now) {
  const StepValues v = q.read();
  StepReport r;
  r.host_s = clock_.host_interval();
  r.step = q.step;
  r.total_steps = run_.total_steps;
  r.epoch = q.epoch;
  r.loss = v.ce_sum / double(std::max<std::int64_t>(1, q.tokens));
  const bool skipped = guard_.read(q.step, v, r.loss);
  r.lr = q.lr;
  r.grad_norm = v.grad_norm;
  r.tokens = q.tokens;
  r.step_time_s = q.end.seconds_since(q.since);
  r.device_clock_s = clock_.device_clock_s(q);
  r.tokens_per_sec = double(q.tokens) / std::max(1e-9, r.step_time_s);
  r.peak_mem_bytes = peak_memory_bytes(run_.device);
  r.elapsed_s = clock_.elapsed_s();
  if (run_.spec.aux_loss) r.extra["aux_loss"] = v.aux_sum / double(run_.spec.accum * world_size_);
  if (run_.offloader) r.extra.update(run_.offloader->take_step_stats().to_metrics());
  if (run_.expert_lora)  // its copies and (across ranks) host side since the previous row (expert_lora_offload.h)
    r.extra.update(run_.expert_lora->take_step_stats().to_metrics(!run_.expert_lora->norms_on_device()));
  guard_.add_metrics(r.extra, v);
  eta_.add(r.step_time_s);
  if (eval_now) {
    const auto [eval_loss, eval_tokens] = eval_.run();
    r.extra["eval_loss"] = eval_loss;
    r.extra["eval_perplexity"] = std::exp(eval_loss);
    r.extra["eval_tokens"] = eval_tokens;
    clock_.other_work();  // the evaluation is not the next step's time
  }
  tally_.add(r);
  const bool last = q.step == run_.total_steps;
  if (rank_ == 0 && (skipped || eval_now || q.step % cfg_.logging_steps == 0 || last)) {
    log::progress(progress_line(r, eta_.seconds_left(run_.total_steps - q.step)), last);
    metrics_->write(r);
    trackers_->log(to_json(r));
  }
  if (hooks_.after_step) hooks_.after_step(q.step);
  guard_.check_streak(q.step);
}

}  // namespace eo
