// What a person reads while a run goes and when it ends: the estimate of the time left, from the
// mean of the last steps (one slow or fast step does not swing it), and the block of lines that
// ends a run.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>

namespace eo {

struct StepReport;

// Seconds left = the mean time of the last `size` steps x the steps left.
class EtaWindow {
 public:
  static constexpr std::size_t kDefaultSize = 16;
  explicit EtaWindow(std::size_t size = kDefaultSize) : size_(size) {}
  void add(double step_time_s);
  // 0 before any step.
  double seconds_left(std::int64_t steps_left) const;

 private:
  std::size_t size_;
  std::deque<double> times_;
  double sum_ = 0;
};

// A run's figures, gathered as its steps are read.
struct RunTally {
  std::int64_t steps_read = 0;  // steps this process trained (a resumed run's before are not)
  std::int64_t last_step = 0;   // the last step read (counting resumed ones)
  double first_loss = NAN, last_loss = NAN;
  double eval_loss = NAN;       // the last evaluation's
  double tokens = 0;            // target tokens of the steps read, all ranks
  double step_seconds = 0;      // their step times summed (the device's clock)
  std::int64_t peak_mem_bytes = 0;
  void add(const StepReport& r);
  double mean_tokens_per_sec() const { return step_seconds > 0 ? tokens / step_seconds : 0; }
};

// "h:mm:ss" (or "m:ss" under an hour).
std::string clock_time(double seconds);

// The lines that end a run: steps, wall time, mean tokens per second, first and last loss, eval
// loss, peak device memory (`peak_what`: "VRAM" or "RSS"), where the adapter is.
std::string run_summary(const RunTally& t, std::int64_t total_steps, double wall_s, const std::string& peak_what,
                        const std::string& adapter_dir);

}  // namespace eo
