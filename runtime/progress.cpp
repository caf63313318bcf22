#include "runtime/progress.h"

#include <algorithm>
#include <cstdio>

#include "common/text.h"
#include "runtime/metrics.h"

namespace eo {

void EtaWindow::add(double step_time_s) {
  times_.push_back(step_time_s);
  sum_ += step_time_s;
  if (times_.size() > size_) {
    sum_ -= times_.front();
    times_.pop_front();
  }
}

double EtaWindow::seconds_left(std::int64_t steps_left) const {
  if (times_.empty() || steps_left <= 0) return 0;
  return sum_ / double(times_.size()) * double(steps_left);
}

void RunTally::add(const StepReport& r) {
  if (steps_read++ == 0) first_loss = r.loss;
  last_loss = r.loss;
  last_step = r.step;
  tokens += double(r.tokens);
  step_seconds += r.step_time_s;
  peak_mem_bytes = std::max(peak_mem_bytes, r.peak_mem_bytes);
  if (r.extra.contains("eval_loss")) eval_loss = r.extra["eval_loss"].get<double>();
}

std::string clock_time(double seconds) {
  const long s = std::lround(std::max(0.0, seconds));
  char buf[32];
  if (s >= 3600)
    std::snprintf(buf, sizeof buf, "%ld:%02ld:%02ld", s / 3600, s / 60 % 60, s % 60);
  else
    std::snprintf(buf, sizeof buf, "%ld:%02ld", s / 60, s % 60);
  return buf;
}

std::string run_summary(const RunTally& t, std::int64_t total_steps, double wall_s, const std::string& peak_what,
                        const std::string& adapter_dir) {
  auto number = [](double v, const char* format) {
    if (std::isnan(v)) return std::string("-");
    char buf[64];
    std::snprintf(buf, sizeof buf, format, v);
    return std::string(buf);
  };
  auto row = [](const std::string& label, const std::string& value) {
    return "\n  " + label + std::string(label.size() < 13 ? 13 - label.size() : 1, ' ') + value;
  };
  const std::int64_t resumed = t.last_step - t.steps_read;
  std::string out = "run summary:";
  out += row("steps", std::to_string(t.last_step) + " of " + std::to_string(total_steps) +
                          (resumed > 0 ? " (" + std::to_string(t.steps_read) + " in this run, resumed after step " +
                                             std::to_string(resumed) + ")"
                                       : ""));
  out += row("wall time", clock_time(wall_s));
  out += row("throughput", number(t.mean_tokens_per_sec(), "%.0f") + " tok/s (mean over the run's steps)");
  out += row("loss", number(t.first_loss, "%.4f") + " first, " + number(t.last_loss, "%.4f") + " last");
  out += row("eval loss", std::isnan(t.eval_loss) ? std::string("- (no evaluation rows)") : number(t.eval_loss, "%.4f"));
  out += row("peak " + peak_what, human_bytes(double(t.peak_mem_bytes)));
  out += row("adapter", adapter_dir);
  return out;
}

}  // namespace eo
