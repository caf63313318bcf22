// The test binaries' fault-injection plan (common/fault_seam.h) as the trainer's hooks: the one
// place the training loop's fault seams are read. A production run installs no plan, and gets the
// hooks it passed unchanged.
#pragma once

#include "runtime/trainer.h"

namespace eo {

// `hooks` with the installed plan's step faults added (each hook set in both runs both).
TrainHooks with_fault_plan(TrainHooks hooks);

}  // namespace eo
