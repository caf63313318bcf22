#include "runtime/nonfinite_guard.h"

#include <cmath>
#include <cstdio>
#include <utility>

#include "common/error.h"
#include "common/log.h"

namespace eo {
namespace {

// The names the counters have in a checkpoint's state (TrainingState::extra).
constexpr const char* kSkipped = "skipped_nonfinite";
constexpr const char* kStreak = "nonfinite_streak";
constexpr const char* kFirst = "first_nonfinite_step";
constexpr const char* kLastClean = "last_clean_checkpoint";
constexpr const char* kSkippedOverflow = "skipped_overflow";
constexpr const char* kFirstApplied = "first_applied_step";
constexpr const char* kStreakOverflows = "overflow_streak";

std::string format_scale(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.9g", s);
  return buf;
}

}  // namespace

NonfiniteGuard::NonfiniteGuard(const nlohmann::json& resumed, std::int64_t resumed_step, int max_streak, std::string output_dir,
                               bool fp16, int rank, int world_size)
    : max_streak_(max_streak), output_dir_(std::move(output_dir)), fp16_(fp16), rank_(rank), world_size_(world_size) {
  skipped_ = resumed.value(kSkipped, std::int64_t(0));
  streak_ = resumed.value(kStreak, std::int64_t(0));
  streak_overflows_ = resumed.value(kStreakOverflows, std::int64_t(0));
  skipped_overflow_ = resumed.value(kSkippedOverflow, std::int64_t(0));
  first_nonfinite_ = resumed.value(kFirst, std::int64_t(-1));
  last_clean_checkpoint_ = first_nonfinite_ >= 0 ? resumed.value(kLastClean, std::int64_t(-1)) : resumed_step;
  // A checkpoint of an eo-ddp that did not record it: taken as trained.
  first_applied_ = resumed.value(kFirstApplied, resumed_step >= 0 ? std::int64_t(0) : std::int64_t(-1));
}

std::string NonfiniteGuard::earlier_checkpoint() const {
  // Only a checkpoint with at least one update in it: an untrained adapter is no way back.
  const bool trained = last_clean_checkpoint_ >= 0 && first_applied_ >= 0 && last_clean_checkpoint_ >= first_applied_;
  if (last_clean_checkpoint_ >= 0 && !trained)
    return "start again (no checkpoint of this run from before that has trained: every step up to it was skipped)";
  return last_clean_checkpoint_ >= 0 ? "resume_from_checkpoint: " + output_dir_ + "/checkpoint-" +
                                           std::to_string(last_clean_checkpoint_) + " (the newest checkpoint before that; kept)"
                                     : std::string("start again (there is no checkpoint from before that)");
}

bool NonfiniteGuard::read(std::int64_t step, const StepValues& v, double loss) {
  // The device's decision, taken from these same values (runtime/train_step.cpp).
  const bool skip = v.bad_ranks > 0 || !std::isfinite(v.grad_norm);
  // fp16: finite losses and non-finite gradients at a scale above 1 are an overflow of the scaled
  // gradients, which the scale's backoff answers, not a NaN step; at 1 (16 halvings from 2^16)
  // nothing is scaled any more and they count as non-finite.
  const bool overflow = skip && fp16_ && v.bad_ranks == 0 && v.loss_scale > 1;
  if (v.bad_state > 0)
    EO_FAIL("after step ", step, " the LoRA parameters or the optimizer state hold NaN/Inf values; skipping steps cannot "
            "undo that, so the run stops here and saves nothing more. ", earlier_checkpoint());
  if (skip) {
    ++streak_;
    streak_overflows_ += overflow ? 1 : 0;
  } else {
    streak_ = streak_overflows_ = 0;
    if (first_applied_ < 0) first_applied_ = step;
  }
  if (overflow) {
    ++skipped_overflow_;
    last_scale_ = v.loss_scale;
    if (rank_ == 0)
      log::info("step " + std::to_string(step) + ": the gradients overflowed fp16 at loss scale " + format_scale(v.loss_scale) +
                "; skipped without an optimizer update, the scale halved (fp16 loss scaling)");
  } else if (skip) {
    if (first_nonfinite_ < 0) first_nonfinite_ = step;
    ++skipped_;
    if (rank_ == 0)
      log::warn("step " + std::to_string(step) + ": loss " + std::to_string(loss) + ", gradient norm " +
                std::to_string(v.grad_norm) + " (non-finite loss on " + std::to_string(int(v.bad_ranks)) + " of " +
                std::to_string(world_size_) + " rank(s)); skipped without an optimizer update (" + std::to_string(streak_) +
                " in a row, " + std::to_string(max_streak_) + " stop the run)");
  }
  return skip;
}

void NonfiniteGuard::check_streak(std::int64_t step) const {
  if (streak_ >= max_streak_ && streak_overflows_ == streak_)
    EO_FAIL("the fp16 loss scale is collapsing: the scaled gradients overflowed on ", streak_, " consecutive steps (",
            step - streak_ + 1, " to ", step, ", max_nonfinite_steps: ", max_streak_, "; the scale is down to ",
            format_scale(last_scale_ / 2), "); stopping. Those steps did not change the adapter. The gradients do not fit "
            "fp16's range: train in bf16 (bf16: true) on a card that has it, or fp32 (bf16: false), check the data, or ",
            earlier_checkpoint());
  if (streak_ >= max_streak_)
    EO_FAIL("the loss or gradients were NaN/Inf for ", streak_, " consecutive steps (", step - streak_ + 1, " to ", step,
            ", max_nonfinite_steps: ", max_streak_, "); stopping. Those steps did not change the adapter. ",
            first_applied_ < 0 ? "No step has updated it yet: a non-finite loss from the first step points at a "
                                 "non-finite input (a NaN/Inf weight or quantisation scale in base_model) or the data, "
                                 "not the learning rate; "
                               : "Lower learning_rate, check the data, or ",
            earlier_checkpoint());
}

void NonfiniteGuard::check_trained(std::int64_t steps) const {
  if (steps > 0 && first_applied_ < 0)
    EO_FAIL("every one of the run's ", steps, " steps was skipped (", skipped_overflow_, " on an fp16 overflow, ", skipped_,
            " on a NaN/Inf loss or gradient), so the adapter never changed: the run fails and writes no adapter. ",
            skipped_overflow_ > 0 ? "The gradients do not fit fp16's range: train in bf16 or fp32. "
                                  : "Look for a NaN/Inf weight or quantisation scale in base_model, or in the data. ",
            "(max_nonfinite_steps: ", max_streak_, " skipped steps in a row stop a run earlier.)");
}

void NonfiniteGuard::add_metrics(nlohmann::json& extra, const StepValues& v) const {
  extra[kSkipped] = skipped_;
  if (fp16_) {
    extra["loss_scale"] = v.loss_scale;  // the scale this step's backward used
    extra[kSkippedOverflow] = skipped_overflow_;
  }
}

nlohmann::json NonfiniteGuard::checkpoint_state(std::int64_t step) const {
  nlohmann::json s = {{kSkipped, skipped_},
                      {kStreak, streak_},
                      {kFirst, first_nonfinite_},
                      {kLastClean, clean_checkpoint(step)},
                      {kFirstApplied, first_applied_},
                      {kStreakOverflows, streak_overflows_}};
  if (fp16_) s[kSkippedOverflow] = skipped_overflow_;
  return s;
}

void NonfiniteGuard::saved(std::int64_t step) { last_clean_checkpoint_ = clean_checkpoint(step); }

}  // namespace eo
