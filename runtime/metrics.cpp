#include "runtime/metrics.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <sstream>

#include "common/error.h"
#include "common/files.h"
#include "common/text.h"
#include "runtime/progress.h"

namespace eo {

MetricsLog::MetricsLog(const std::string& output_dir, std::int64_t resumed_step) {
  std::filesystem::create_directories(output_dir);
  path_ = (std::filesystem::path(output_dir) / "metrics.jsonl").string();
  // Never through a link (it would overwrite whatever the link points at): read and written with
  // O_NOFOLLOW, and the kept lines replace the file atomically (rename replaces a link itself).
  std::string kept, old;
  if (resumed_step > 0 && read_file_nofollow(path_, old)) {
    std::istringstream in(old);
    for (std::string line; std::getline(in, line);) {
      const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (j.is_object() && j.contains("step") && j["step"].is_number() && j["step"].get<std::int64_t>() <= resumed_step)
        kept += line + "\n";
    }
  }
  struct stat st {};
  if (::lstat(path_.c_str(), &st) == 0 && S_ISLNK(st.st_mode))
    EO_FAIL(path_, " is a symbolic link; eo-ddp does not write through links under output_dir "
                   "(remove the link or choose another output_dir)");
  write_file_atomic(path_, kept);
  fd_ = open_nofollow(path_, O_WRONLY | O_APPEND);
}

MetricsLog::~MetricsLog() {
  if (fd_ >= 0) ::close(fd_);
}

nlohmann::json to_json(const StepReport& r) {
  nlohmann::json j = {{"step", r.step},
                      {"epoch", r.epoch},
                      {"loss", r.loss},
                      {"lr", r.lr},
                      {"grad_norm", r.grad_norm},
                      {"tokens", r.tokens},
                      {"tokens_per_sec", r.tokens_per_sec},
                      {"step_time_s", r.step_time_s},
                      {"host_s", r.host_s},
                      {"device_clock_s", r.device_clock_s},
                      {"peak_mem_bytes", r.peak_mem_bytes},
                      {"elapsed_s", r.elapsed_s}};
  for (auto it = r.extra.begin(); it != r.extra.end(); ++it) j[it.key()] = it.value();
  return j;
}

void MetricsLog::write(const StepReport& r) {
  // One write(2) per line: a full disk stops the run with a message, not a file that silently ends.
  try {
    const std::string line = to_json(r).dump() + "\n";
    write_all(fd_, line.data(), line.size(), path_);
  } catch (const std::exception& e) {
    EO_FAIL("cannot append step ", r.step, " to ", path_, " (disk full or I/O error): ", e.what());
  }
}

std::string progress_line(const StepReport& r, double eta_s) {
  const std::string eta = clock_time(eta_s);
  char buf[512];
  std::snprintf(buf, sizeof buf, "step %lld/%lld  loss %.4f  lr %.3g  |g| %.3g  %.0f tok/s  %.3f s/step  eta %s  peak %s",
                static_cast<long long>(r.step), static_cast<long long>(r.total_steps), r.loss, r.lr, r.grad_norm,
                r.tokens_per_sec, r.step_time_s, eta.c_str(), human_bytes(double(r.peak_mem_bytes)).c_str());
  std::string line = buf;
  if (r.extra.contains("eval_loss")) {
    char ev[96];
    std::snprintf(ev, sizeof ev, "  eval loss %.4f ppl %.4g", r.extra["eval_loss"].get<double>(),
                  r.extra["eval_perplexity"].get<double>());
    line += ev;
  }
  if (r.extra.contains("h2d_gbps")) {
    char off[160];
    // On a CPU run the "device" slots are host memory: the rate is a memcpy's, not a host link's.
    std::snprintf(off, sizeof off, "  %s %.1f GB/s  staged %s", r.extra.value("staging_link", std::string("H2D")).c_str(),
                  r.extra["h2d_gbps"].get<double>(),
                  human_bytes(r.extra.value("staged_bytes", 0.0)).c_str());
    line += off;
  }
  if (r.extra.contains("disk_gbps")) {
    char disk[96];
    std::snprintf(disk, sizeof disk, "  disk %.1f GB/s  read %s", r.extra["disk_gbps"].get<double>(),
                  human_bytes(r.extra.value("disk_read_bytes", 0.0)).c_str());
    line += disk;
  }
  return line;
}

std::int64_t peak_rss_bytes() {
  struct rusage u {};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<std::int64_t>(u.ru_maxrss) * 1024;
}

}  // namespace eo
