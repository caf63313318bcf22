// The seam between the decoder and whoever holds the NF4 expert bytes (design.md §2.1-2.3).
//
// Whoever runs the blocks (the step runner, MoeModel::forward) calls stage(layer) before a MoE
// block's forward and before its backward (design.md §1: the step's schedule of block uses); the
// 4-bit linears then ask expert_weight(...) for the packed bytes, in forward and again in backward. ResidentWeights keeps everything in memory; the offload engine implements
// the same interface with host homes and device slots. Stagings are counted here, in the base,
// so every implementation is instrumented the same way.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "models/quantized_weight.h"

namespace eo::model {

enum class ExpertMatrix : int { Gate = 0, Up = 1, Down = 2 };
const char* expert_matrix_name(ExpertMatrix m);  // "gate_proj", "up_proj", "down_proj"

class WeightProvider {
 public:
  virtual ~WeightProvider() = default;
  // Make layer's experts available (and, for an offloader, schedule prefetch). Counted.
  void stage(int layer) {
    {
      std::lock_guard<std::mutex> lock(count_mutex_);
      if (layer >= static_cast<int>(stage_counts_.size())) stage_counts_.resize(layer + 1, 0);
      ++stage_counts_[layer];
    }
    stage_block(layer);
  }
  // Called after stage(layer) and before each backward of the block (the step runner's backward
  // uses): a provider that holds trainable state per block (runtime/expert_lora_offload.h) readies
  // its gradients here. stage() cannot tell it: the top block's last forward and first backward
  // share one stage() in a layer-major step.
  virtual void before_backward(int /*layer*/) {}
  // The packed weight, valid until the next stage() call that may reuse its slot.
  virtual const QuantizedWeight& expert_weight(int layer, int expert, ExpertMatrix m) = 0;
  // The order of stage() calls in one optimizer step, repeating every step (an offloader prefetches
  // and evicts along it). Memory-resident stores ignore it.
  virtual void set_schedule(const std::vector<int>& /*staging_order*/) {}
  // Where layer's staged weights are, as a token: equal tokens = the same device addresses. A
  // CUDA graph captured on one placement replays only on it (an offloader has several slots).
  virtual std::int64_t placement(int /*layer*/) { return 0; }
  // Experts per group when a staged block is streamed in groups (contiguous expert ranges, one
  // group's bytes valid at a time: expert_weight of another group may reuse the slot); 0 when a
  // staged block is readable whole. Whoever reads a bank reads it group by group then.
  virtual int expert_group_size() const { return 0; }

  std::int64_t stage_count(int layer) const {
    std::lock_guard<std::mutex> lock(count_mutex_);
    return layer < static_cast<int>(stage_counts_.size()) ? stage_counts_[layer] : 0;
  }
  std::int64_t total_stage_count() const {
    std::lock_guard<std::mutex> lock(count_mutex_);
    std::int64_t n = 0;
    for (auto c : stage_counts_) n += c;
    return n;
  }
  void reset_stage_counts() {
    std::lock_guard<std::mutex> lock(count_mutex_);
    stage_counts_.clear();
  }

 protected:
  virtual void stage_block(int layer) = 0;

 private:
  mutable std::mutex count_mutex_;
  std::vector<std::int64_t> stage_counts_;
};

// Every expert of every MoE layer held in memory (CPU or one device).
class ResidentWeights : public WeightProvider {
 public:
  // experts[layer][expert][matrix]; layers without experts have an empty entry.
  using Bank = std::vector<std::vector<std::array<QuantizedWeight, 3>>>;
  explicit ResidentWeights(Bank bank) : bank_(std::move(bank)) {}
  const QuantizedWeight& expert_weight(int layer, int expert, ExpertMatrix m) override;
  Bank& bank() { return bank_; }  // the offload engine moves the bytes out of here

 protected:
  void stage_block(int) override {}

 private:
  Bank bank_;
};

}  // namespace eo::model
