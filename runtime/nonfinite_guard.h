// The non-finite guard's host side. A step with a NaN/Inf loss or gradient is skipped on the
// device (Optimizer::step's skip: no update, the step still counts); the host learns of it when it
// reads the step, and here counts it, warns, and stops the run after max_nonfinite_steps in a row.
// With fp16, non-finite gradients at a loss scale above 1 are an overflow of the scaled gradients
// (the scale's backoff answers them), counted apart (skipped_overflow) but in the same streak: a
// scale that keeps halving is collapsing, and the stop says so. A run none of whose steps updated
// the adapter fails (check_trained), and a stop offers only a checkpoint that trained. The counters are kept in checkpoints, so a
// resumed run counts on as an uninterrupted one; with them the newest checkpoint from before the
// first skipped step, which pruning keeps and the messages point to.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>

namespace eo {

// What the host reads of a step (fp64 on the device, copied once; see runtime/train_step.h).
struct StepValues {
  double ce_sum = 0;     // cross-entropy sum, all ranks
  double aux_sum = 0;    // raw aux losses, all ranks
  double bad_ranks = 0;  // ranks with a non-finite loss
  double grad_norm = 0;  // of the all-reduced gradients (unscaled)
  double bad_state = 0;  // 1 if the LoRA or optimizer state holds NaN/Inf after the step
  double loss_scale = 1; // the scale the step's backward used (1 without fp16)
};

class NonfiniteGuard {
 public:
  // `resumed`: the checkpoint's counters (TrainingState::extra) and its step, or {} and -1 for a
  // fresh run. `fp16`: loss scaling is on.
  NonfiniteGuard(const nlohmann::json& resumed, std::int64_t resumed_step, int max_streak, std::string output_dir, bool fp16,
                 int rank, int world_size);

  // Step `step` as read: fails when the LoRA or optimizer state went bad (skipping cannot undo
  // that); counts and reports an overflow or a skipped step. True: the step was skipped.
  bool read(std::int64_t step, const StepValues& v, double loss);
  // After step `step` is reported: fails after max_nonfinite_steps skipped in a row, naming the
  // cause (a collapsing fp16 loss scale, or a non-finite loss).
  void check_streak(std::int64_t step) const;
  // At the end of a run of `steps` steps: fails when not one of them updated the adapter.
  void check_trained(std::int64_t steps) const;
  // The counters metrics.jsonl carries.
  void add_metrics(nlohmann::json& extra, const StepValues& v) const;

  // A checkpoint of `step`: the counters it keeps; saved() once it is written.
  nlohmann::json checkpoint_state(std::int64_t step) const;
  void saved(std::int64_t step);
  // The run's first step skipped for NaN/Inf, -1: none (the newest checkpoint before it is never pruned).
  std::int64_t first_nonfinite() const { return first_nonfinite_; }

 private:
  std::string earlier_checkpoint() const;
  std::int64_t clean_checkpoint(std::int64_t step) const { return first_nonfinite_ < 0 ? step : last_clean_checkpoint_; }

  int max_streak_;
  std::string output_dir_;
  bool fp16_;
  int rank_, world_size_;
  std::int64_t skipped_ = 0;          // steps skipped for NaN/Inf in all
  std::int64_t streak_ = 0;           // ... and in a row
  std::int64_t skipped_overflow_ = 0; // fp16: steps skipped on a gradient overflow
  std::int64_t first_nonfinite_ = -1;
  std::int64_t first_applied_ = -1;   // the run's first step that updated the adapter (-1: none yet)
  std::int64_t streak_overflows_ = 0; // of streak_, fp16 overflows
  double last_scale_ = 0;             // the loss scale of the last overflow
  std::int64_t last_clean_checkpoint_ = -1;  // the newest checkpoint of a step before first_nonfinite (-1: none)
};

}  // namespace eo
