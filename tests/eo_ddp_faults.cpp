// eo-ddp-faults: eo-ddp's own main with a fault-injection plan (common/fault_seam.h) read from
// the environment. Built for the tests only; the eo-ddp binary reads none of these variables.
//   EO_DDP_FAULT_STEP=<step>[,<step>...] | all, EO_DDP_FAULT=throw|kill|nan (default throw),
//   EO_DDP_FAULT_RANK=<rank> (default: every rank): at the start of those steps, throw (the rank
//   fails with a message naming it), SIGKILL itself, or turn its loss into NaN;
//   EO_DDP_FAULT_OVERFLOW=<step>[,<step>...] (EO_DDP_FAULT_RANK as above): the rank's loss scale is
//   infinite in those steps, so its gradients overflow and its loss stays finite;
//   EO_DDP_FAULT_KILL_IN_SAVE=<step>: SIGKILL in the middle of writing checkpoint-<step>;
//   EO_DDP_FAULT_KILL_IN_REPLACE=<step>: SIGKILL between the renames replacing checkpoint-<step>;
//   EO_DDP_FAULT_NAN_STATE=<step>: after optimizer step <step>, a LoRA parameter element becomes NaN;
//   EO_DDP_FAULT_HOST_MEM_AVAILABLE=<size>: the host RAM the pre-load check sees;
//   EO_DDP_FAULT_DISK_FULL_AFTER=<size>: writing the disk homes file fails with ENOSPC past <size> bytes;
//   EO_DDP_FAULT_NO_O_DIRECT=1: the disk homes file cannot be opened with O_DIRECT (as on old tmpfs);
//   EO_DDP_FAULT_DEVICE_DELAY=<step>:<seconds>[,...] (step may be `all`): that step's device work
//   takes <seconds> longer (the stream held inside the step: runtime/device.h hold_device_stream);
//   EO_DDP_FAULT_HOLD_BEFORE_TRAINING=<seconds>: after setup the process waits (at most that long)
//   for a stop signal before its check for one, so a stop "while loading" is not raced by step 1;
//   EO_DDP_FAULT_HOST_DELAY=<step>:<seconds>[,...]: the host sleeps after queueing that step,
//   before reading the one before it.
#include <ATen/Context.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <map>
#include <sstream>
#include <string>
#include <thread>

#include "common/error.h"
#include "common/fault_seam.h"
#include "common/text.h"
#include "launch/commands.h"
#include "runtime/device.h"
#include "runtime/signals.h"

namespace {
std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

// "<step>:<seconds>,..." -> seconds by step (0 = every step, for `all`).
std::map<std::int64_t, double> delays(const std::string& spec) {
  std::map<std::int64_t, double> out;
  std::stringstream ss(spec);
  for (std::string item; std::getline(ss, item, ',');) {
    const auto colon = item.find(':');
    EO_CHECK(colon != std::string::npos, "expected <step>:<seconds>, got '", item, "'");
    const std::string step = item.substr(0, colon);
    out[step == "all" ? 0 : std::stoll(step)] = std::stod(item.substr(colon + 1));
  }
  return out;
}

double delay_at(const std::map<std::int64_t, double>& d, std::int64_t step) {
  if (auto it = d.find(step); it != d.end()) return it->second;
  if (auto it = d.find(0); it != d.end()) return it->second;
  return 0;
}
}  // namespace

int main(int argc, char** argv) {
  eo::faults::Plan plan;
  if (const std::string at = env("EO_DDP_FAULT_STEP"); !at.empty()) {
    const std::string who = env("EO_DDP_FAULT_RANK"), kind = env("EO_DDP_FAULT").empty() ? "throw" : env("EO_DDP_FAULT");
    plan.at_step = [steps = "," + at + ",", who, kind](std::int64_t step, int rank) {
      if (steps != ",all," && steps.find("," + std::to_string(step) + ",") == std::string::npos) return false;
      if (!who.empty() && std::to_string(rank) != who) return false;
      if (kind == "nan") return true;
      if (kind == "kill") std::raise(SIGKILL);
      EO_FAIL("fault injected at step ", step, " on rank ", rank, " (EO_DDP_FAULT_STEP)");
    };
  }
  if (const std::string at = env("EO_DDP_FAULT_OVERFLOW"); !at.empty())
    plan.overflow_at = [steps = "," + at + ",", who = env("EO_DDP_FAULT_RANK")](std::int64_t step, int rank) {
      return steps.find("," + std::to_string(step) + ",") != std::string::npos && (who.empty() || std::to_string(rank) == who);
    };
  if (const std::string s = env("EO_DDP_FAULT_KILL_IN_SAVE"); !s.empty()) plan.kill_in_save = std::stoll(s);
  if (const std::string s = env("EO_DDP_FAULT_KILL_IN_REPLACE"); !s.empty()) plan.kill_in_replace = std::stoll(s);
  if (const std::string s = env("EO_DDP_FAULT_NAN_STATE"); !s.empty()) plan.nan_state_at = std::stoll(s);
  if (const std::string s = env("EO_DDP_FAULT_HOST_MEM_AVAILABLE"); !s.empty())
    plan.host_mem_available = static_cast<std::int64_t>(eo::parse_bytes(s).value_or(0));
  if (const std::string s = env("EO_DDP_FAULT_DISK_FULL_AFTER"); !s.empty())
    plan.disk_homes_full_after = static_cast<std::int64_t>(eo::parse_bytes(s).value_or(0));
  plan.refuse_o_direct = env("EO_DDP_FAULT_NO_O_DIRECT") == "1";
  if (const std::string s = env("EO_DDP_FAULT_DEVICE_DELAY"); !s.empty())
    plan.in_step_work = [d = delays(s)](std::int64_t step) {
      const double seconds = delay_at(d, step);
      if (seconds <= 0) return;
      const at::Device dev = at::hasCUDA() ? c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getDevice() : at::Device(at::kCPU);
      eo::hold_device_stream(dev, seconds);
    };
  if (const std::string s = env("EO_DDP_FAULT_HOST_DELAY"); !s.empty())
    plan.after_queue = [d = delays(s)](std::int64_t step) {
      std::this_thread::sleep_for(std::chrono::duration<double>(delay_at(d, step)));
    };
  if (const std::string s = env("EO_DDP_FAULT_HOLD_BEFORE_TRAINING"); !s.empty())
    plan.before_training = [seconds = std::stod(s)] {
      const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
      while (!eo::stop_requested() && std::chrono::steady_clock::now() < end)
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
    };
  eo::faults::install(std::move(plan));
  return eo::launch::run_main(argc, argv);
}
