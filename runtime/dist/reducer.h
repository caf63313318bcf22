// Data-parallel gradient reduction, DDP-style (after c10d's Reducer): trainable parameters are
// packed into fixed fp32 buckets in *reverse* order of use (the last-used parameters' gradients
// are ready first in backward); a post-accumulate hook per parameter copies its gradient into its
// bucket, and a bucket whose parameters are all ready is all-reduced right away, from the hook, so
// communication overlaps the rest of backward. Buckets launch strictly in index order (a ready
// bucket waits for its predecessors) so every rank issues the same collectives in the same order.
//
// Unused parameters (an expert's LoRA that got no token on this rank) never fire a hook: finalize()
// fills them with zeros and launches whatever is left, again in bucket order, so no rank hangs.
// Only what the caller passes is ever reduced: frozen / offloaded weights never enter a bucket.
//
// Launch site: the hook (autograd thread) launches the collective itself, under the reducer's and
// the communicator's mutexes. For MPI that is a non-blocking MPI_Iallreduce — MPI is still entered
// by one thread at a time (MPI_THREAD_SERIALIZED) because the owning thread sits in backward() and
// every communicator call is serialised by its mutex; for NCCL it is an async launch on the comm
// stream. Queueing to finalize() instead would forfeit all overlap.
//
// Use per optimizer step: for each micro-batch begin_micro_step(sync = is_last), forward,
// [prepare_for_backward(loss) on the last one], backward; then finalize() once.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "runtime/dist/comm.h"

namespace eo::dist {

using NamedTensor = std::pair<std::string, at::Tensor>;

struct ReducerOptions {
  std::int64_t bucket_cap_bytes = std::int64_t(25) << 20;  // config ddp_bucket_cap_mb
  ReduceOp op = ReduceOp::kSum;  // the trainer sums: it already divides by the global token count
};

class GradReducer {
 public:
  // `params_in_use_order`: trainable fp32 leaf tensors (requires_grad) on the communicator's
  // device, in the order forward first uses them.
  GradReducer(std::vector<NamedTensor> params_in_use_order, Communicator& comm, ReducerOptions options = {});
  ~GradReducer();
  GradReducer(const GradReducer&) = delete;
  GradReducer& operator=(const GradReducer&) = delete;

  // sync = false: gradients only accumulate locally (no communication this micro-step).
  void begin_micro_step(bool sync);
  // Optional, on the synchronised micro-step, before loss.backward(): walks the autograd graph from
  // `loss` and marks the parameters it cannot reach as ready now (their gradient so far, or zeros),
  // as c10d's find_unused_parameters does, so an unused expert LoRA does not hold back the buckets
  // behind it until finalize(). Results are identical with or without it; only overlap differs.
  void prepare_for_backward(const at::Tensor& loss);
  // After the last micro-step's backward: launch what is left, wait, write the reduced gradients
  // into every p.grad() (creating zero gradients where a parameter had none).
  void finalize();

  // Introspection for tests and logs.
  std::size_t num_buckets() const { return buckets_.size(); }
  std::vector<std::string> bucket_param_names(std::size_t bucket) const;
  std::int64_t bucket_bytes(std::size_t bucket) const;
  std::int64_t hook_firings() const;            // post-accumulate hooks that ran, since construction
  std::int64_t launched_from_hooks() const;     // buckets launched during backward, since construction

 private:
  struct Bucket {
    std::vector<std::size_t> params;  // indices into params_, in bucket order
    std::vector<std::int64_t> offsets;
    at::Tensor flat;                  // one fp32 buffer
    std::size_t pending = 0;          // parameters not ready yet this step
    std::uint64_t handle = 0;
    bool launched = false;
  };
  void on_grad_ready(std::size_t param);
  void copy_in(std::size_t param, bool zeros_if_missing);
  void launch_ready_in_order();
  void reset_step();

  std::vector<NamedTensor> params_;
  std::vector<std::size_t> bucket_of_;  // param index -> bucket index
  std::vector<std::size_t> slot_of_;    // param index -> position inside its bucket
  std::vector<Bucket> buckets_;
  Communicator& comm_;
  ReducerOptions options_;
  mutable std::mutex mu_;
  bool sync_ = true;
  std::vector<bool> ready_;
  std::size_t next_bucket_ = 0;  // buckets below this one have been launched this step
  std::int64_t hook_firings_ = 0;
  std::int64_t launched_from_hooks_ = 0;
  // The accumulators must outlive the graphs, or the hooks registered on them are lost.
  std::vector<std::shared_ptr<void>> accumulators_;
  std::vector<std::uintptr_t> hook_keys_;
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

}  // namespace eo::dist
