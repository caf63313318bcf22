// Checkpoints during a run: every save_steps (or saves_per_epoch), on a stop request and at the
// end. A checkpoint holds what an uninterrupted run would go on with: the LoRA, AdamW's state, the
// RNG, the data cursor, the non-finite guard's counters and fp16's loss scale.
#pragma once

#include <cstdint>
#include <string>

namespace eo {

struct TrainConfig;
struct Run;
class NonfiniteGuard;
class LossScaler;
namespace ddp {
class World;
}

class Checkpointer {
 public:
  Checkpointer(const TrainConfig& cfg, Run& run, NonfiniteGuard& guard, const LossScaler& scaler, ddp::World& world);
  // Whether step `step` (1-based) is saved on the schedule (the last is saved by the end of the run).
  bool due(std::int64_t step) const;
  // The key that schedules the saves, for the log.
  const char* schedule_key() const;
  // Saves run.step (rank 0 writes it); `why` is logged.
  void save(const std::string& why);

 private:
  const TrainConfig& cfg_;
  Run& run_;
  NonfiniteGuard& guard_;
  const LossScaler& scaler_;
  int rank_, world_size_;
  std::int64_t every_ = 0;  // 0: never on a schedule
};

}  // namespace eo
