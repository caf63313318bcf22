// The end of a run: the last checkpoint, the check that every rank ends with the same adapter,
// the adapter written beside the tokenizer's files (rank 0), and the summary a person reads.
#pragma once

#include "runtime/trainer.h"

namespace eo {

struct Run;
struct RunTally;
class Checkpointer;
class StepClock;

// What the steps read so far tell of the run (a run stopped early reports this).
TrainResult result_so_far(const RunTally& tally);

// `tally`: the steps read; `clock`: the run's (its wall time).
TrainResult end_run(const TrainConfig& cfg, Run& run, Checkpointer& checkpoints, const RunTally& tally, const StepClock& clock,
                    ddp::World& world);

}  // namespace eo
