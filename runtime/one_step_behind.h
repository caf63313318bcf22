// The host reads each step's results one step late: it queues step s on the device, then reads
// step s-1's losses and gradient norm, which the device has finished by then (it is running step
// s). So the device never waits for the host between steps, however busy the host's cores are. A
// step whose outcome the host needs before going on (the last, a save, an evaluation, a stop, ...)
// is read at once instead; the trainer decides which.
#pragma once

#include <exception>
#include <functional>
#include <optional>
#include <string>
#include <utility>

#include "common/log.h"

namespace eo {

// Step: what the host keeps of a queued step (it has a `step` number); read(step, eval_now)
// waits for that step's values on the device and reports it.
template <class Step>
class OneStepBehind {
 public:
  using Read = std::function<void(Step, bool eval_now)>;
  explicit OneStepBehind(Read read) : read_(std::move(read)) {}

  // Step q has been queued: the step before it is read now, and q either now too (read_now) or
  // with the next call.
  void queued(Step q, bool read_now, bool eval_now) {
    if (pending_) {
      Step previous = std::move(*pending_);
      pending_.reset();
      read_(std::move(previous), /*eval_now=*/false);
    }
    if (read_now)
      read_(std::move(q), eval_now);
    else
      pending_ = std::move(q);
  }

  // After a failure while the next step was being queued (a fault on this rank, a device error):
  // the step already done is still reported, so its metrics line is not lost with the one that
  // failed. Never throws (the caller is rethrowing the failure).
  void flush_after_failure() noexcept {
    if (!pending_) return;
    Step done = std::move(*pending_);
    pending_.reset();
    const auto number = done.step;
    try {
      read_(std::move(done), /*eval_now=*/false);
    } catch (const std::exception& e) {
      log::warn("could not report step " + std::to_string(number) + " after the failure: " + e.what());
    }
  }

 private:
  Read read_;
  std::optional<Step> pending_;
};

}  // namespace eo
