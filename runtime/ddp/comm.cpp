#include "runtime/ddp/comm.h"

#include <mpi.h>

#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <thread>

#include "common/error.h"
#include "common/mpi_check.h"
#include "runtime/ddp/world.h"

#ifdef EO_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include "common/cuda_check.h"
#include "common/nccl_check.h"

#include <condition_variable>
#include <future>
#endif

namespace eo::ddp {
namespace {
using Clock = std::chrono::steady_clock;

// Ends every rank: a collective that cannot finish would otherwise hang the job forever.
[[noreturn]] void abort_run(int rank, const std::string& msg) {
  std::fprintf(stderr, "eo-ddp: rank %d: %s; aborting all ranks\n", rank, msg.c_str());
  std::fflush(stderr);
  int inited = 0, fin = 0;
  MPI_Initialized(&inited);
  MPI_Finalized(&fin);
  if (inited && !fin) MPI_Abort(MPI_COMM_WORLD, kExitRuntime);
  std::_Exit(kExitRuntime);
}

std::int64_t nbytes(const at::Tensor& t) { return t.numel() * static_cast<std::int64_t>(t.element_size()); }
}  // namespace

// One in-flight collective started by allreduce_async.
struct Communicator::Pending {
  std::uint64_t handle = 0;
  std::string what;
  at::Tensor tensor;  // kept alive until the collective is done
  ReduceOp op = ReduceOp::kSum;
  MPI_Request request = MPI_REQUEST_NULL;  // CPU
  std::shared_ptr<void> done_event;       // CUDA (a cudaEvent_t shared with the watchdog)
  Clock::time_point start;
  std::uint64_t seq = 0;  // World's collective count: names this collective in a timeout message
};

#ifdef EO_WITH_CUDA
namespace {
std::shared_ptr<void> make_event() {
  cudaEvent_t e = nullptr;
  EO_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
  return std::shared_ptr<void>(e, [](void* p) { cudaEventDestroy(static_cast<cudaEvent_t>(p)); });
}
}  // namespace

// NCCL communicator, its stream, and the watchdog that turns a stuck or failed collective into
// ncclCommAbort + MPI_Abort (never ncclCommDestroy after a failure: it can block forever).
struct Communicator::Nccl {
  struct InFlight {
    std::string what;
    std::shared_ptr<void> done;  // cudaEvent_t
    Clock::time_point start;
  };
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  int rank = 0;
  int device = 0;
  double timeout_s = 600;
  std::mutex mu;
  std::condition_variable cv;
  bool stop = false;
  std::vector<InFlight> in_flight;
  std::thread watchdog;

  [[noreturn]] void fail(const std::string& msg) {
    ncclCommAbort(comm);
    abort_run(rank, msg);
  }

  void watch() {
    cudaSetDevice(device);
    std::unique_lock<std::mutex> lk(mu);
    while (!stop) {
      cv.wait_for(lk, std::chrono::milliseconds(100));
      for (std::size_t i = 0; i < in_flight.size();) {
        const cudaError_t q = cudaEventQuery(static_cast<cudaEvent_t>(in_flight[i].done.get()));
        if (q == cudaSuccess) {
          in_flight.erase(in_flight.begin() + static_cast<std::ptrdiff_t>(i));
          continue;
        }
        if (q != cudaErrorNotReady) fail("NCCL " + in_flight[i].what + ": CUDA error " + cudaGetErrorString(q));
        const double waited = std::chrono::duration<double>(Clock::now() - in_flight[i].start).count();
        if (waited > timeout_s)
          fail("NCCL " + in_flight[i].what + " did not complete within " + std::to_string(int(timeout_s)) +
               " s (ddp_timeout); a peer rank is stuck or dead");
        ++i;
      }
      ncclResult_t async = ncclSuccess;
      if (ncclCommGetAsyncError(comm, &async) == ncclSuccess && async != ncclSuccess
#if defined(NCCL_VERSION_CODE) && NCCL_VERSION_CODE >= 21400
          && async != ncclInProgress
#endif
      )
        fail(std::string("NCCL reported an asynchronous error: ") + ncclGetErrorString(async));
    }
  }

  // Records "compute is done up to here" and makes the comm stream wait for it.
  void order_after_compute(const at::Tensor& t) {
    cudaStream_t compute = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
    auto ready = make_event();
    EO_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(ready.get()), compute), "cudaEventRecord");
    EO_CUDA_CHECK(cudaStreamWaitEvent(stream, static_cast<cudaEvent_t>(ready.get()), 0), "cudaStreamWaitEvent");
    // The caching allocator must not hand this memory out again before the comm stream is done.
    c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), c10::cuda::getStreamFromExternal(stream, static_cast<c10::DeviceIndex>(device)));
  }

  std::shared_ptr<void> track(const std::string& what) {
    auto done = make_event();
    EO_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(done.get()), stream), "cudaEventRecord");
    std::lock_guard<std::mutex> lk(mu);
    in_flight.push_back({what, done, Clock::now()});
    return done;
  }
};
#else
struct Communicator::Nccl {};
#endif

Communicator::Communicator(const World& world, at::Device device, double timeout_seconds)
    : world_(&world), rank_(world.rank()), size_(world.size()), device_(device), timeout_s_(timeout_seconds) {
  EO_CHECK(timeout_seconds > 0, "ddp_timeout must be positive (got ", timeout_seconds, ")");
  EO_CHECK(size_ == 1 || world.uses_mpi(), "a world of ", size_, " ranks needs MPI");
  if (size_ == 1 || !device.is_cuda()) return;
#ifdef EO_WITH_CUDA
  nccl_ = std::make_unique<Nccl>();
  nccl_->rank = rank_;
  nccl_->device = device.index() < 0 ? 0 : device.index();
  nccl_->timeout_s = timeout_seconds;
  // NCCL binds its communicator to the current device: set it before anything NCCL.
  EO_CUDA_CHECK(cudaSetDevice(nccl_->device), "cudaSetDevice");
  ncclUniqueId id;
  if (rank_ == 0) EO_NCCL_CHECK(ncclGetUniqueId(&id), "ncclGetUniqueId");
  world.broadcast_bytes(&id, sizeof id, 0);
  // ncclCommInitRank blocks until every rank has joined and has no timeout of its own: run it on a
  // helper thread and end the job if it outlives ddp_timeout (the thread dies with the process).
  {
    auto done = std::make_shared<std::promise<ncclResult_t>>();
    std::future<ncclResult_t> result = done->get_future();
    std::thread([done, n = nccl_.get(), size = size_, id, rank = rank_] {
      cudaSetDevice(n->device);
      done->set_value(ncclCommInitRank(&n->comm, size, id, rank));
    }).detach();
    if (result.wait_for(std::chrono::duration<double>(timeout_s_)) != std::future_status::ready)
      abort_run(rank_, "ncclCommInitRank did not complete within " + std::to_string(int(timeout_s_)) +
                           " s (ddp_timeout); a peer rank never created its NCCL communicator (stuck, dead, or failed earlier)");
    EO_NCCL_CHECK(result.get(), "ncclCommInitRank");
  }
  nccl_->stream = c10::cuda::getStreamFromPool(/*isHighPriority=*/true, static_cast<c10::DeviceIndex>(nccl_->device)).stream();
  nccl_->watchdog = std::thread([n = nccl_.get()] { n->watch(); });
#else
  EO_FAIL("device ", device.str(), " needs NCCL, but this eo-ddp was built without CUDA");
#endif
}

Communicator::~Communicator() {
#ifdef EO_WITH_CUDA
  if (nccl_) {
    bool busy = false;
    {
      std::lock_guard<std::mutex> lk(nccl_->mu);
      nccl_->stop = true;
      for (const auto& f : nccl_->in_flight)
        busy = busy || cudaEventQuery(static_cast<cudaEvent_t>(f.done.get())) != cudaSuccess;
    }
    nccl_->cv.notify_all();
    if (nccl_->watchdog.joinable()) nccl_->watchdog.join();
    // Destroy waits for peers; after an error (or with work still queued) only abort is safe.
    if (busy || std::uncaught_exceptions() > 0)
      ncclCommAbort(nccl_->comm);
    else
      ncclCommDestroy(nccl_->comm);
  }
#endif
}

std::uint64_t Communicator::allreduce_async(const at::Tensor& t, ReduceOp op, const std::string& what) {
  if (size_ == 1) return 0;
  EO_CHECK(t.is_contiguous(), "all-reduce of ", what, ": the tensor must be contiguous");
  EO_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble, "all-reduce of ", what,
           ": only fp32/fp64 tensors are reduced (got ", t.scalar_type(), ")");
  std::lock_guard<std::mutex> lk(mu_);
  auto p = std::make_unique<Pending>();
  p->handle = next_handle_++;
  p->what = "all-reduce of " + what;
  p->tensor = t;
  p->op = op;
  p->start = Clock::now();
  if (t.is_cuda()) {
#ifdef EO_WITH_CUDA
    EO_CHECK(nccl_ && t.device() == device_, p->what, ": tensor on ", t.device().str(), " but the communicator serves ",
             device_.str());
    nccl_->order_after_compute(t);
    const ncclDataType_t type = t.scalar_type() == at::kFloat ? ncclFloat32 : ncclFloat64;
    EO_NCCL_CHECK(ncclAllReduce(t.data_ptr(), t.data_ptr(), static_cast<std::size_t>(t.numel()), type,
                                op == ReduceOp::kAvg ? ncclAvg : ncclSum, nccl_->comm, nccl_->stream),
                  p->what);
    p->done_event = nccl_->track(p->what);
#else
    EO_FAIL(p->what, ": CUDA tensor but eo-ddp was built without CUDA");
#endif
  } else {
    EO_CHECK(t.numel() <= INT_MAX, p->what, ": ", t.numel(), " elements exceed one MPI call; lower ddp_bucket_cap_mb");
    p->seq = world_->enter_collective();
    EO_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, t.data_ptr(), static_cast<int>(t.numel()),
                             t.scalar_type() == at::kFloat ? MPI_FLOAT : MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD, &p->request),
              "MPI_Iallreduce (" + p->what + ")");
  }
  stats_.allreduce_calls += 1;
  stats_.allreduce_bytes += nbytes(t);
  pending_.push_back(std::move(p));
  return pending_.back()->handle;
}

// Polls instead of MPI_Wait so that a peer that never arrives becomes an error after the timeout.
void Communicator::wait_mpi_locked(Pending& p) {
  const auto deadline = p.start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s_));
  for (long spins = 0;; ++spins) {
    int done = 0;
    EO_MPI_CHECK(MPI_Test(&p.request, &done, MPI_STATUS_IGNORE), p.what);
    if (done) return;
    world_->serve_peers();
    if (Clock::now() > deadline) world_->abort_on_timeout(p.what, p.seq, timeout_s_);
    // Yield the core after a short spin: ranks may share cores (oversubscribed runs).
    if (spins > 200) std::this_thread::sleep_for(std::chrono::microseconds(spins > 20000 ? 1000 : 20));
  }
}

void Communicator::wait(std::uint64_t handle) {
  if (handle == 0) return;
  std::lock_guard<std::mutex> lk(mu_);
  std::size_t i = 0;
  while (i < pending_.size() && pending_[i]->handle != handle) ++i;
  EO_CHECK(i < pending_.size(), "wait on unknown or already waited collective handle ", handle);
  Pending& p = *pending_[i];
  if (p.tensor.is_cuda()) {
#ifdef EO_WITH_CUDA
    cudaStream_t compute = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(nccl_->device)).stream();
    EO_CUDA_CHECK(cudaStreamWaitEvent(compute, static_cast<cudaEvent_t>(p.done_event.get()), 0), "cudaStreamWaitEvent");
#endif
  } else {
    wait_mpi_locked(p);
    if (p.op == ReduceOp::kAvg) p.tensor.div_(size_);
  }
  pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(i));
}

void Communicator::broadcast(const at::Tensor& t, int root, const std::string& what) {
  if (size_ == 1) return;
  EO_CHECK(t.is_contiguous(), "broadcast of ", what, ": the tensor must be contiguous");
  EO_CHECK(root >= 0 && root < size_, "broadcast of ", what, ": root ", root, " is not a rank of a world of ", size_);
  std::lock_guard<std::mutex> lk(mu_);
  const std::int64_t bytes = nbytes(t);
  if (t.is_cuda()) {
#ifdef EO_WITH_CUDA
    EO_CHECK(nccl_ && t.device() == device_, "broadcast of ", what, ": tensor on ", t.device().str(),
             " but the communicator serves ", device_.str());
    nccl_->order_after_compute(t);
    EO_NCCL_CHECK(ncclBroadcast(t.data_ptr(), t.data_ptr(), static_cast<std::size_t>(bytes), ncclUint8, root, nccl_->comm,
                                nccl_->stream),
                  "broadcast of " + what);
    auto done = nccl_->track("broadcast of " + what);
    cudaStream_t compute = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(nccl_->device)).stream();
    EO_CUDA_CHECK(cudaStreamWaitEvent(compute, static_cast<cudaEvent_t>(done.get()), 0), "cudaStreamWaitEvent");
#else
    EO_FAIL("broadcast of ", what, ": CUDA tensor but eo-ddp was built without CUDA");
#endif
  } else {
    auto* base = static_cast<char*>(t.data_ptr());
    const std::int64_t chunk = std::int64_t(1) << 30;  // MPI counts are int
    for (std::int64_t off = 0; off < bytes; off += chunk) {
      Pending p;
      p.what = "broadcast of " + what;
      p.start = Clock::now();
      p.seq = world_->enter_collective();
      EO_MPI_CHECK(MPI_Ibcast(base + off, static_cast<int>(std::min(chunk, bytes - off)), MPI_BYTE, root, MPI_COMM_WORLD,
                           &p.request),
                "MPI_Ibcast (" + p.what + ")");
      wait_mpi_locked(p);
    }
  }
  stats_.broadcast_calls += 1;
  stats_.broadcast_bytes += bytes;
}

std::vector<std::uint64_t> Communicator::allgather(std::uint64_t mine, const std::string& what) {
  if (size_ == 1) return {mine};
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<std::uint64_t> all(static_cast<std::size_t>(size_));
  Pending p;
  p.what = "all-gather of " + what;
  p.start = Clock::now();
  p.seq = world_->enter_collective();
  EO_MPI_CHECK(MPI_Iallgather(&mine, 1, MPI_UINT64_T, all.data(), 1, MPI_UINT64_T, MPI_COMM_WORLD, &p.request),
            "MPI_Iallgather (" + p.what + ")");
  wait_mpi_locked(p);
  stats_.allgather_calls += 1;
  stats_.allgather_bytes += sizeof mine;
  return all;
}

CommStats Communicator::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  return stats_;
}

void Communicator::reset_stats() {
  std::lock_guard<std::mutex> lk(mu_);
  stats_ = CommStats{};
}

}  // namespace eo::ddp
