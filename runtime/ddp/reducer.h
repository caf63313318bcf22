// Data-parallel gradient reduction, after c10d's Reducer but driven by the step's schedule:
// bucket assignment is a plain function (assign_buckets), communication sits behind the
// Communicator, and the step runner says when gradients are final instead of autograd hooks.
//
//  - Buckets: trainable parameters only, fp32, grouped by decoder block from the top block down
//    (backward finishes the top block first), in reverse order of use inside a block, at most
//    bucket_cap_bytes each (a larger parameter goes alone). A bucket never spans two blocks.
//  - block_done(b): the runner calls it after block b's last backward use of the step (with the
//    layer-major schedule: after its last micro-batch), when the gradients of every block >= b are
//    final. Their buckets are copied in and all-reduced at once (non-blocking), overlapping the
//    backward of the blocks below.
//  - Unused parameters (an expert's LoRA that got no token on this rank) have no gradient: they
//    are sent as zeros, so every rank launches the same buckets in the same order (invariant).
//  - finalize(): launches what is left, waits, writes the reduced gradients into every p.grad().
// Only what the caller passes is ever reduced: frozen / offloaded weights never enter a bucket.
// All calls come from the thread that runs the step.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "runtime/ddp/comm.h"

namespace eo::ddp {

using NamedTensor = std::pair<std::string, at::Tensor>;

struct ReducerOptions {
  std::int64_t bucket_cap_bytes = std::int64_t(25) << 20;  // config ddp_bucket_cap_mb
  ReduceOp op = ReduceOp::kSum;  // the trainer sums: it already divides by the global token count
};

// One bucket: indices into the parameter list, in bucket order, and the block they belong to.
struct BucketPlan {
  std::vector<std::size_t> params;
  int block = 0;
  std::int64_t numel = 0;
};
// `sizes[k]`, `blocks[k]`: element count and block of parameter k, given in order of use.
std::vector<BucketPlan> assign_buckets(const std::vector<std::int64_t>& sizes, const std::vector<int>& blocks,
                                       std::int64_t cap_bytes);

class GradReducer {
 public:
  // `params_in_use_order`: trainable fp32 leaf tensors (requires_grad) on the communicator's
  // device, in the order forward first uses them; `blocks[k]`: the decoder block of parameter k
  // (empty: all in one block).
  GradReducer(std::vector<NamedTensor> params_in_use_order, Communicator& comm, ReducerOptions options = {},
              std::vector<int> blocks = {});
  GradReducer(const GradReducer&) = delete;
  GradReducer& operator=(const GradReducer&) = delete;

  // The gradients of every block >= `block` are final for this step: launch their buckets.
  void block_done(int block);
  // After the step's backward: launch what is left, wait, write the reduced gradients into every
  // p.grad() (creating zero gradients where a parameter had none). Starts the next step.
  void finalize();

  // Introspection for tests and logs.
  std::size_t num_buckets() const { return buckets_.size(); }
  std::vector<std::string> bucket_param_names(std::size_t bucket) const;
  std::int64_t bucket_bytes(std::size_t bucket) const;
  int bucket_block(std::size_t bucket) const { return buckets_.at(bucket).plan.block; }
  std::int64_t launched_early() const { return launched_early_; }  // buckets launched by block_done, since construction

 private:
  struct Bucket {
    BucketPlan plan;
    std::vector<std::int64_t> offsets;  // of each parameter inside flat
    at::Tensor flat;                    // one fp32 buffer
    std::uint64_t handle = 0;
    bool launched = false;
  };
  void launch(Bucket& b, std::size_t index);

  std::vector<NamedTensor> params_;
  std::vector<Bucket> buckets_;
  Communicator& comm_;
  ReducerOptions options_;
  std::size_t next_bucket_ = 0;  // buckets below this one have been launched this step
  std::int64_t launched_early_ = 0;
};

// Initial sync: every tensor (LoRA params, resident frozen params, buffers — never expert homes)
// takes rank `root`'s values, bitwise. Tensors are coalesced per (device, dtype) into flat buffers
// of at most `chunk_bytes`, so a model costs a few collectives.
void broadcast_parameters(const std::vector<NamedTensor>& tensors, Communicator& comm, int root = 0,
                          std::int64_t chunk_bytes = std::int64_t(256) << 20);

// Checksums of host byte ranges (the expert homes), one per rank, gathered on every rank.
struct HostBytes {
  const void* data = nullptr;
  std::size_t size = 0;
};
struct ChecksumReport {
  bool agree = true;
  std::vector<std::uint64_t> per_rank;
  std::vector<int> differing_ranks;  // ranks whose value differs from rank 0's
  std::string message;               // names the differing ranks; empty when all agree
};
std::uint64_t checksum_bytes(const std::vector<HostBytes>& ranges);
ChecksumReport checksum_allreduce(const std::vector<HostBytes>& ranges, Communicator& comm, const std::string& what);
// Throws eo::Error naming the differing ranks unless every rank holds the same bytes.
void check_same_bytes(const std::vector<HostBytes>& ranges, Communicator& comm, const std::string& what);

}  // namespace eo::ddp
