// The trackers people watch a run in, fed the same values as metrics.jsonl (rank 0):
// - TensorBoard (`use_tensorboard`): event files under output_dir/runs/, written here (TFRecord
//   framing, masked CRC-32C, a hand-encoded Event / Summary protobuf: no TensorFlow, no protobuf
//   library); every numeric metrics.jsonl field a scalar under its name (nested: "a/b").
// - Weights & Biases (`wandb_project`): tools/wandb_follow.py, a side process that follows
//   metrics.jsonl and logs each line through the wandb SDK.
// A tracker never stops, slows or changes training: a failing one is logged once and dropped, the
// side process is never waited for during training, and at the end it gets a bounded time to
// finish before it is ended.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <sys/types.h>
#include <utility>
#include <vector>

namespace eo {

struct TrainConfig;

// CRC-32C (Castagnoli), and TFRecord's masked form of it.
std::uint32_t crc32c(const void* data, std::size_t size);
std::uint32_t masked_crc32c(const void* data, std::size_t size);

// One TensorBoard event file: events.out.tfevents.<seconds>.<host>.<pid> in `dir` (created).
class TensorBoardWriter {
 public:
  explicit TensorBoardWriter(const std::string& dir);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;
  // One Event holding a Summary with a simple_value per scalar (float32, as TensorBoard keeps them).
  void scalars(std::int64_t step, double wall_time, const std::vector<std::pair<std::string, double>>& values);
  const std::string& path() const { return path_; }

 private:
  void record(const std::string& event);
  std::string path_;
  int fd_ = -1;
};

// metrics.jsonl's numeric fields of one line as (tag, value): nested objects as "outer/inner",
// booleans 0 / 1; strings and nulls are not scalars.
std::vector<std::pair<std::string, double>> scalar_fields(const nlohmann::json& line);

class Trackers {
 public:
  // Rank 0. Starts what the config asks for; a tracker that cannot start is logged and skipped.
  Trackers(const TrainConfig& cfg, const std::string& metrics_path);
  ~Trackers();  // ends the W&B side process (a bounded wait, then it is killed)
  Trackers(const Trackers&) = delete;
  Trackers& operator=(const Trackers&) = delete;
  // After metrics.jsonl has the line (the W&B side process reads it there).
  void log(const nlohmann::json& line);
  bool any() const { return tensorboard_ || wandb_pid_ > 0; }

 private:
  std::unique_ptr<TensorBoardWriter> tensorboard_;
  pid_t wandb_pid_ = -1;
  int wandb_stdin_ = -1;  // closed at the end: the side process drains metrics.jsonl and finishes
  std::string wandb_log_;
};

}  // namespace eo
