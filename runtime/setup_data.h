// A run's data, read and checked before any weight, so a bad file costs no loading time: the
// datasets as documents (token ids checked against the vocabulary), the held-out rows
// (val_set_size / test_datasets), the batcher, and the run's length in optimizer steps.
#pragma once

namespace eo {

struct TrainConfig;
struct Run;
namespace ddp {
struct WorldInfo;
}

// Fills run.batcher, run.eval_rows, run.total_steps and run.warmup (run.spec is set).
void load_run_data(const TrainConfig& cfg, Run& run, const ddp::WorldInfo& wi);

}  // namespace eo
