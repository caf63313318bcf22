// The process group: who we are (rank, world size, local rank on this node) and host-side
// collectives. Under mpirun/srun it is MPI (MPI_Init_thread, ranks of MPI_COMM_WORLD, the
// node-local rank from an MPI_COMM_TYPE_SHARED split). Started without a launcher it is a
// world of one that never touches MPI, so a single process needs no mpirun.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace eo::dist {

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

  void barrier() const;
  void allreduce_sum(double* values, std::size_t n) const;
  void allreduce_sum(std::int64_t* values, std::size_t n) const;
  void allreduce_max(double* values, std::size_t n) const;
  void broadcast_bytes(void* data, std::size_t bytes, int root) const;
  // Everyone's string, in rank order.
  std::vector<std::string> allgather(const std::string& mine) const;
  // Ends every rank now: MPI_Abort under MPI, exit otherwise.
  [[noreturn]] void abort(int code) const;

  void finalize();
  ~World();

 private:
  World() = default;
  WorldInfo info_;
  bool mpi_ = false;
  bool finalized_ = false;
};

// Which launcher, if any, started this process (from its environment).
std::string detect_launcher();

}  // namespace eo::dist
