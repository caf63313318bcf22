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
  skipped_overflow_ = resumed.value(kSkippedOverflow, std::int64_t(0));
  first_nonfinite_ = resumed.value(kFirst, std::int64_t(-1));
  last_clean_checkpoint_ = first_nonfinite_ >= 0 ? resumed.value(kLastClean, std::int64_t(-1)) : resumed_step;
}

std::string NonfiniteGuard::earlier_checkpoint() const {
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
  if (overflow) {
    ++skipped_overflow_;
    if (rank_ == 0)
      log::info("step " + std::to_string(step) + ": the gradients overflowed fp16 at loss scale " + format_scale(v.loss_scale) +
                "; skipped without an optimizer update, the scale halved (fp16 loss scaling)");
  } else if (skip) {
    if (first_nonfinite_ < 0) first_nonfinite_ = step;
    ++skipped_;
    ++streak_;
    if (rank_ == 0)
      log::warn("step " + std::to_string(step) + ": loss " + std::to_string(loss) + ", gradient norm " +
                std::to_string(v.grad_norm) + " (non-finite loss on " + std::to_string(int(v.bad_ranks)) + " of " +
                std::to_string(world_size_) + " rank(s)); skipped without an optimizer update (" + std::to_string(streak_) +
                " in a row, " + std::to_string(max_streak_) + " stop the run)");
  } else {
    streak_ = 0;
  }
  return skip;
}

void NonfiniteGuard::check_streak(std::int64_t step) const {
  if (streak_ >= max_streak_)
    EO_FAIL("the loss or gradients were NaN/Inf for ", streak_, " consecutive steps (", step - streak_ + 1, " to ", step,
            ", max_nonfinite_steps: ", max_streak_,
            "); stopping. Those steps did not change the adapter. Lower learning_rate, check the data, or ",
            earlier_checkpoint());
}

void NonfiniteGuard::add_metrics(nlohmann::json& extra, const StepValues& v) const {
  extra[kSkipped] = skipped_;
  if (fp16_) {
    extra["loss_scale"] = v.loss_scale;  // the scale this step's backward used
    extra[kSkippedOverflow] = skipped_overflow_;
  }
}

nlohmann::json NonfiniteGuard::checkpoint_state(std::int64_t step) const {
  nlohmann::json s = {{kSkipped, skipped_}, {kStreak, streak_}, {kFirst, first_nonfinite_}, {kLastClean, clean_checkpoint(step)}};
  if (fp16_) s[kSkippedOverflow] = skipped_overflow_;
  return s;
}

void NonfiniteGuard::saved(std::int64_t step) { last_clean_checkpoint_ = clean_checkpoint(step); }

}  // namespace eo
