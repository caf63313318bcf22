// Collectives on tensors for data parallelism. CPU tensors go through MPI (non-blocking
// MPI_Iallreduce / MPI_Ibcast, waited by polling so a stuck peer turns into a timeout instead of a
// hang); CUDA tensors go through NCCL on a dedicated comm stream that first waits on the compute
// stream, with a watchdog thread that aborts the run when a collective fails or outlives
// `timeout_seconds` (NCCL itself has no timeout). A world of one does nothing and counts nothing.
//
// Threading: every call takes the communicator's mutex, so MPI is entered by one thread at a time
// (MPI_THREAD_SERIALIZED) even when gradient hooks launch from the autograd thread. Do not call
// World's own collectives while a backward pass that launches collectives runs on another thread.
// The one exception is the NCCL watchdog's MPI_Abort: a last resort that ends the process anyway.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace eo::ddp {

class World;

enum class ReduceOp { kSum, kAvg };

// Bytes and calls carried by each collective kind on this rank (instrumentation for tests).
struct CommStats {
  std::int64_t allreduce_calls = 0;
  std::int64_t allreduce_bytes = 0;
  std::int64_t broadcast_calls = 0;
  std::int64_t broadcast_bytes = 0;
  std::int64_t allgather_calls = 0;
  std::int64_t allgather_bytes = 0;  // this rank's contribution
};

class Communicator {
 public:
  // `device` is this rank's compute device; CUDA tensors must live on it (NCCL is set up for it
  // after cudaSetDevice(device.index())). Collective on the same communicator must be issued in
  // the same order on every rank.
  Communicator(const World& world, at::Device device, double timeout_seconds = 600);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  at::Device device() const { return device_; }
  double timeout_seconds() const { return timeout_s_; }

  // Starts an in-place all-reduce of a contiguous fp32/fp64 tensor; `what` names it in errors.
  // Returns a handle for wait(); 0 means nothing was launched (world of one).
  std::uint64_t allreduce_async(const at::Tensor& t, ReduceOp op, const std::string& what);
  // CPU: blocks until done (and divides for kAvg). CUDA: makes the current stream wait for it.
  void wait(std::uint64_t handle);
  void allreduce(const at::Tensor& t, ReduceOp op, const std::string& what) { wait(allreduce_async(t, op, what)); }
  // In-place broadcast of a contiguous tensor of any dtype from `root`.
  void broadcast(const at::Tensor& t, int root, const std::string& what);
  // Every rank's value, in rank order (host values, always over MPI).
  std::vector<std::uint64_t> allgather(std::uint64_t mine, const std::string& what);

  CommStats stats() const;
  void reset_stats();

 private:
  struct Pending;
  struct Nccl;
  void wait_mpi_locked(Pending& p);

  const World* world_;  // its probes name the rank that did not arrive when a wait times out
  int rank_ = 0;
  int size_ = 1;
  at::Device device_;
  double timeout_s_;
  mutable std::mutex mu_;
  CommStats stats_;
  std::uint64_t next_handle_ = 1;
  std::vector<std::unique_ptr<Pending>> pending_;
  std::unique_ptr<Nccl> nccl_;  // only for CUDA devices in a world of more than one
};

}  // namespace eo::ddp
