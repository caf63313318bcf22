// A progress line for long work a person waits on (loading a checkpoint, filling the expert
// homes), in the training line's style (log::progress): on a terminal it is rewritten in place a
// few times a second; in a log file or CI (stderr not a terminal) a plain line comes every
// `plain_every_s` seconds and one at the end, so a log shows the work without a line per item.
// Rank 0 only, as every progress line.
#pragma once

#include <chrono>
#include <string>

namespace eo {

class ProgressMeter {
 public:
  static constexpr double kTerminalEvery = 0.25;  // seconds between rewrites on a terminal
  static constexpr double kPlainEvery = 10;       // ... between plain lines elsewhere
  explicit ProgressMeter(double plain_every_s = kPlainEvery);

  // Whether a line shown now would be printed (build the line only then).
  bool due() const;
  // Prints `line` if due.
  void show(const std::string& line);
  // Prints the last line, always (on a terminal it ends the line being rewritten).
  void finish(const std::string& line);
  double elapsed_s() const;

 private:
  using Clock = std::chrono::steady_clock;
  Clock::time_point start_ = Clock::now();
  Clock::time_point last_ = start_;
  double every_s_;
};

// "2.1 GB/s" for `bytes` in `seconds` (decimal gigabytes, as the training line's rates).
std::string rate_text(double bytes, double seconds);

}  // namespace eo
