// What a run tells its user: a live progress line on stderr and output_dir/metrics.jsonl,
// one JSON object per logged step (tools/plot_metrics.py draws it).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>

namespace eo {

struct StepReport {
  std::int64_t step = 0, total_steps = 0;
  double epoch = 0;
  double loss = 0;
  double lr = 0;
  double grad_norm = 0;
  std::int64_t tokens = 0;  // target tokens in this step, all ranks
  double step_time_s = 0;     // on the device's clock: this step's end minus the previous step's end
  double host_s = 0;          // the host's interval between reading the previous step and this one
  double device_clock_s = 0;  // this step's end on the device's clock, from the start of training
  double tokens_per_sec = 0;
  std::int64_t peak_mem_bytes = 0;  // device allocator peak (CUDA) or max RSS (CPU)
  double elapsed_s = 0;
  nlohmann::json extra = nlohmann::json::object();  // e.g. offload statistics
};

class MetricsLog {
 public:
  // resumed_step > 0: keep the lines of steps up to it (a resumed run continues the file; lines
  // of steps after the checkpoint, from the interrupted run, are dropped). 0: start afresh.
  // A metrics.jsonl that is a symbolic link is refused (eo::Error naming it).
  MetricsLog(const std::string& output_dir, std::int64_t resumed_step);
  ~MetricsLog();
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;
  void write(const StepReport& r);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;  // O_APPEND, opened without following links
};

nlohmann::json to_json(const StepReport& r);
// The live line of step r; `eta_s`: the estimated seconds left (runtime/progress.h).
std::string progress_line(const StepReport& r, double eta_s);

// Peak resident memory of this process (CPU runs).
std::int64_t peak_rss_bytes();

}  // namespace eo
