// Fault injection for the failure tests, as a seam in the code instead of the environment.
//
// Production code asks these questions at the points a test wants to break (a step, the middle
// of a checkpoint save, the host-RAM measurement, the disk homes' file); nothing answers unless a
// test binary installed a plan first. The eo-ddp binary never does; tests/eo_ddp_faults.cpp (eo-ddp-faults, built for
// the tests only) reads its plan from EO_DDP_FAULT* variables and then runs eo-ddp's own main.
#pragma once

#include <cstdint>
#include <functional>

namespace eo::faults {

struct Plan {
  // At the start of optimizer step `step` (1-based) on `rank`: true turns the rank's loss of that
  // step into NaN; it may also throw or end the process (a failing rank).
  std::function<bool(std::int64_t step, int rank)> at_step;
  // At optimizer step `step` on `rank`: true makes the rank's loss scale infinite for that step,
  // so its gradients overflow while its loss stays finite (fp16's loss scaling: a skipped step).
  std::function<bool(std::int64_t step, int rank)> overflow_at;
  std::int64_t kill_in_save = -1;         // SIGKILL in the middle of writing checkpoint-<step>
  std::int64_t kill_in_replace = -1;      // SIGKILL between the two renames replacing checkpoint-<step>
  std::int64_t nan_state_at = -1;         // after optimizer step <step>, one LoRA parameter element becomes NaN
  std::int64_t host_mem_available = -1;   // bytes of host RAM to report as available (-1: measure)
  std::int64_t disk_homes_full_after = -1;  // writes of the disk homes file fail with ENOSPC past this many bytes
  bool refuse_o_direct = false;
  // Step timing: called while optimizer step `step`'s device work is being queued (after its
  // micro-batches, before the optimizer), where a test adds device work of a known length; and
  // after step `step` is queued, before the step before it is read, where a test makes the host late.
  std::function<void(std::int64_t step)> in_step_work;
  // After setup, just before the check that ends a run stopped while loading: a test holds the
  // process there until its stop signal has arrived, so the check is what answers it.
  std::function<void()> before_training;
  std::function<void(std::int64_t step)> after_queue;           // opening the disk homes file with O_DIRECT fails as on tmpfs (EINVAL)
};

void install(Plan plan);  // test binaries only, before anything runs
const Plan& plan();       // the installed plan, or one that injects nothing

}  // namespace eo::faults
