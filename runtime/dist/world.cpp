#include "runtime/dist/world.h"

#include <mpi.h>
#include <unistd.h>

#include <cstdlib>
#include <memory>

#include "common/error.h"

namespace eo::dist {
namespace {
std::unique_ptr<World> g_world;

bool env_set(const char* name) {
  const char* v = std::getenv(name);
  return v && *v;
}

void mpi_check(int rc, const char* what) {
  if (rc != MPI_SUCCESS) {
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, msg, &len);
    EO_FAIL(what, " failed: ", std::string(msg, len));
  }
}
}  // namespace

std::string detect_launcher() {
  if (env_set("EO_DDP_FORCE_MPI")) return "forced";
  if (env_set("OMPI_COMM_WORLD_SIZE")) return "mpirun";
  if (env_set("PMIX_RANK") && env_set("SLURM_STEP_ID")) return "srun";
  if (env_set("PMI_RANK") || env_set("PMI_SIZE") || env_set("PMIX_RANK")) return "pmi";
  return "none";
}

World& World::init(int* argc, char*** argv) {
  if (g_world) return *g_world;
  g_world.reset(new World());
  World& w = *g_world;
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  w.info_.hostname = host;
  w.info_.launcher = detect_launcher();
  if (w.info_.launcher == "none") return w;

  int already = 0;
  MPI_Initialized(&already);
  if (!already) {
    int provided = 0;
    // Gradient-ready hooks run on the autograd thread and hand work to the main thread's
    // communicator, so MPI itself is only ever called from one thread at a time.
    mpi_check(MPI_Init_thread(argc, argv, MPI_THREAD_SERIALIZED, &provided), "MPI_Init_thread");
    EO_CHECK(provided >= MPI_THREAD_SERIALIZED, "MPI does not provide MPI_THREAD_SERIALIZED");
  }
  w.mpi_ = true;
  // Errors come back as codes so we can report them, instead of MPI aborting silently.
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  MPI_Comm_rank(MPI_COMM_WORLD, &w.info_.rank);
  MPI_Comm_size(MPI_COMM_WORLD, &w.info_.world_size);
  MPI_Comm local;
  mpi_check(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, w.info_.rank, MPI_INFO_NULL, &local),
            "MPI_Comm_split_type");
  MPI_Comm_rank(local, &w.info_.local_rank);
  MPI_Comm_size(local, &w.info_.local_size);
  MPI_Comm_free(&local);
  return w;
}

World& World::get() {
  EO_CHECK(g_world, "World::init has not been called");
  return *g_world;
}

bool World::initialized() { return g_world != nullptr; }

void World::barrier() const {
  if (mpi_) mpi_check(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
}

void World::allreduce_sum(double* values, std::size_t n) const {
  if (mpi_) mpi_check(MPI_Allreduce(MPI_IN_PLACE, values, static_cast<int>(n), MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD), "MPI_Allreduce");
}

void World::allreduce_sum(std::int64_t* values, std::size_t n) const {
  if (mpi_) mpi_check(MPI_Allreduce(MPI_IN_PLACE, values, static_cast<int>(n), MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD), "MPI_Allreduce");
}

void World::allreduce_max(double* values, std::size_t n) const {
  if (mpi_) mpi_check(MPI_Allreduce(MPI_IN_PLACE, values, static_cast<int>(n), MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD), "MPI_Allreduce");
}

void World::broadcast_bytes(void* data, std::size_t bytes, int root) const {
  if (!mpi_) return;
  auto* p = static_cast<char*>(data);
  // MPI counts are int: send in chunks of at most 1 GiB.
  const std::size_t chunk = std::size_t(1) << 30;
  for (std::size_t off = 0; off < bytes; off += chunk) {
    const int n = static_cast<int>(std::min(chunk, bytes - off));
    mpi_check(MPI_Bcast(p + off, n, MPI_BYTE, root, MPI_COMM_WORLD), "MPI_Bcast");
  }
}

std::vector<std::string> World::allgather(const std::string& mine) const {
  if (!mpi_) return {mine};
  const int n = info_.world_size;
  int len = static_cast<int>(mine.size());
  std::vector<int> lens(n), offs(n);
  mpi_check(MPI_Allgather(&len, 1, MPI_INT, lens.data(), 1, MPI_INT, MPI_COMM_WORLD), "MPI_Allgather");
  int total = 0;
  for (int i = 0; i < n; ++i) {
    offs[i] = total;
    total += lens[i];
  }
  std::string all(static_cast<std::size_t>(total), '\0');
  mpi_check(MPI_Allgatherv(mine.data(), len, MPI_CHAR, all.data(), lens.data(), offs.data(), MPI_CHAR, MPI_COMM_WORLD),
            "MPI_Allgatherv");
  std::vector<std::string> out(n);
  for (int i = 0; i < n; ++i) out[i] = all.substr(offs[i], lens[i]);
  return out;
}

void World::abort(int code) const {
  if (mpi_) MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

void World::finalize() {
  if (mpi_ && !finalized_) {
    int fin = 0;
    MPI_Finalized(&fin);
    if (!fin) MPI_Finalize();
  }
  finalized_ = true;
}

World::~World() { finalize(); }

}  // namespace eo::dist
