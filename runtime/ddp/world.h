// The process group: who we are (rank, world size, local rank on this node) and host-side
// collectives. Under mpirun/srun it is MPI (MPI_Init_thread, ranks of MPI_COMM_WORLD, the
// node-local rank from an MPI_COMM_TYPE_SHARED split). Started without a launcher it is a
// world of one that never touches MPI, so a single process needs no mpirun.
//
// No collective waits forever: each is non-blocking and polled, and past timeout() (ddp_timeout)
// every rank is aborted with a message naming the ranks that did not arrive. While it waits a rank
// answers its peers' "which collective are you at?" probes (on a private duplicate of
// MPI_COMM_WORLD), so the rank that times out can tell a peer that is stuck elsewhere or stopped
// (no answer) from one that arrived (every rank issues the same collectives in the same order, so
// the count of collectives entered identifies the collective).
#pragma once

#include <mpi.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

namespace eo::ddp {

struct WorldInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_size = 1;
  std::string launcher;  // "mpirun", "srun", "pmi" or "none"
  std::string hostname;
};

class World {
 public:
  // Initialises MPI when a launcher started us (or EO_DDP_FORCE_MPI=1), once per process.
  static World& init(int* argc, char*** argv);
  static World& get();  // after init
  static bool initialized();

  const WorldInfo& info() const { return info_; }
  int rank() const { return info_.rank; }
  int size() const { return info_.world_size; }
  bool uses_mpi() const { return mpi_; }

  // Seconds any collective may wait (ddp_timeout; 600 until set).
  // `key`: the config key that sets the bound, named in the timeout message.
  void set_timeout(double seconds, const std::string& key = "ddp_timeout");
  double timeout() const { return timeout_s_; }

  void barrier() const;
  void allreduce_sum(double* values, std::size_t n) const;
  void allreduce_sum(std::int64_t* values, std::size_t n) const;
  void allreduce_max(double* values, std::size_t n) const;
  void broadcast_bytes(void* data, std::size_t bytes, int root) const;
  std::string broadcast_string(const std::string& s, int root) const;
  // Everyone's string, in rank order.
  std::vector<std::string> allgather(const std::string& mine) const;
  // Ends every rank now: MPI_Abort under MPI, exit otherwise.
  [[noreturn]] void abort(int code) const;

  // For other communicators' polling loops (runtime/ddp/comm.cpp): count a collective entered
  // (returns its number), answer peers' probes, and end the job on a timeout naming the ranks
  // that did not arrive at collective `seq`.
  std::uint64_t enter_collective() const { return ++collectives_; }
  void serve_peers() const;
  [[noreturn]] void abort_on_timeout(const std::string& what, std::uint64_t seq, double waited_s) const;

  void finalize();
  ~World();

 private:
  World() = default;
  // Polls an MPI request until done; the timeout ends every rank.
  void wait(MPI_Request* request, const std::string& what, std::uint64_t seq) const;
  WorldInfo info_;
  bool mpi_ = false;
  bool finalized_ = false;
  double timeout_s_ = 600;
  std::string timeout_key_ = "ddp_timeout";
  mutable std::atomic<std::uint64_t> collectives_{0};
  MPI_Comm probe_comm_ = MPI_COMM_NULL;  // a duplicate of MPI_COMM_WORLD for the probes only
};

// Which launcher, if any, started this process (from its environment).
std::string detect_launcher();

}  // namespace eo::ddp
