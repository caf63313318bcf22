#include "common/progress_meter.h"

#include <cstdio>

#include "common/log.h"

namespace eo {

ProgressMeter::ProgressMeter(double plain_every_s)
    : every_s_(log::progress_rewrites() ? kTerminalEvery : plain_every_s) {}

bool ProgressMeter::due() const { return std::chrono::duration<double>(Clock::now() - last_).count() >= every_s_; }

void ProgressMeter::show(const std::string& line) {
  if (!due()) return;
  last_ = Clock::now();
  log::progress(line, /*final_line=*/false);
}

void ProgressMeter::finish(const std::string& line) { log::progress(line, /*final_line=*/true); }

double ProgressMeter::elapsed_s() const { return std::chrono::duration<double>(Clock::now() - start_).count(); }

std::string rate_text(double bytes, double seconds) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f GB/s", seconds > 0 ? bytes / seconds / 1e9 : 0.0);
  return buf;
}

}  // namespace eo
