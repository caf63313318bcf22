#include "runtime/ddp/world.h"

#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <thread>

#include "common/error.h"
#include "common/mpi_check.h"

namespace eo::ddp {
namespace {
using Clock = std::chrono::steady_clock;
std::unique_ptr<World> g_world;

constexpr int kTagProbe = 7301;  // "which collective are you at?" (payload: the asker's collective)
constexpr int kTagReply = 7302;  // the answer: collectives this rank has entered

bool env_set(const char* name) {
  const char* v = std::getenv(name);
  return v && *v;
}

void pause_briefly(long spins) {
  // Yield the core after a short spin: ranks may share cores (oversubscribed runs).
  if (spins > 200) std::this_thread::sleep_for(std::chrono::microseconds(spins > 20000 ? 1000 : 20));
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
    EO_MPI_CHECK(MPI_Init_thread(argc, argv, MPI_THREAD_SERIALIZED, &provided), "");
    EO_CHECK(provided >= MPI_THREAD_SERIALIZED, "MPI does not provide MPI_THREAD_SERIALIZED");
  }
  w.mpi_ = true;
  // Errors come back as codes so we can report them, instead of MPI aborting silently.
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  MPI_Comm_rank(MPI_COMM_WORLD, &w.info_.rank);
  MPI_Comm_size(MPI_COMM_WORLD, &w.info_.world_size);
  MPI_Comm local;
  EO_MPI_CHECK(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, w.info_.rank, MPI_INFO_NULL, &local), "");
  MPI_Comm_rank(local, &w.info_.local_rank);
  MPI_Comm_size(local, &w.info_.local_size);
  MPI_Comm_free(&local);
  EO_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &w.probe_comm_), "the probe communicator");
  MPI_Comm_set_errhandler(w.probe_comm_, MPI_ERRORS_RETURN);
  return w;
}

World& World::get() {
  EO_CHECK(g_world, "World::init has not been called");
  return *g_world;
}

bool World::initialized() { return g_world != nullptr; }

void World::set_timeout(double seconds, const std::string& key) {
  timeout_key_ = key;
  EO_CHECK(seconds > 0, "ddp_timeout must be positive (got ", seconds, ")");
  timeout_s_ = seconds;
}

void World::serve_peers() const {
  if (!mpi_) return;
  for (;;) {
    int flag = 0;
    MPI_Status st;
    if (MPI_Iprobe(MPI_ANY_SOURCE, kTagProbe, probe_comm_, &flag, &st) != MPI_SUCCESS || !flag) return;
    std::uint64_t asked = 0;
    MPI_Recv(&asked, 1, MPI_UINT64_T, st.MPI_SOURCE, kTagProbe, probe_comm_, MPI_STATUS_IGNORE);
    // The buffer must outlive the send; this only happens on the way to an abort, so it is leaked.
    auto* reply = new std::uint64_t(collectives_.load());
    MPI_Request r;
    if (MPI_Isend(reply, 1, MPI_UINT64_T, st.MPI_SOURCE, kTagReply, probe_comm_, &r) == MPI_SUCCESS) MPI_Request_free(&r);
  }
}

void World::abort_on_timeout(const std::string& what, std::uint64_t seq, double waited_s) const {
  std::string why;
  if (mpi_ && info_.world_size > 1) {
    // Ask every peer which collective it has reached; a peer in any eo-ddp wait answers at once.
    static std::uint64_t asked;
    asked = seq;
    for (int p = 0; p < info_.world_size; ++p) {
      if (p == info_.rank) continue;
      MPI_Request r;
      if (MPI_Isend(&asked, 1, MPI_UINT64_T, p, kTagProbe, probe_comm_, &r) == MPI_SUCCESS) MPI_Request_free(&r);
    }
    std::map<int, std::uint64_t> at;
    const auto deadline = Clock::now() + std::chrono::duration<double>(std::min(3.0, timeout_s_));
    for (long spins = 0; Clock::now() < deadline && int(at.size()) < info_.world_size - 1; ++spins) {
      serve_peers();
      int flag = 0;
      MPI_Status st;
      if (MPI_Iprobe(MPI_ANY_SOURCE, kTagReply, probe_comm_, &flag, &st) == MPI_SUCCESS && flag) {
        std::uint64_t n = 0;
        MPI_Recv(&n, 1, MPI_UINT64_T, st.MPI_SOURCE, kTagReply, probe_comm_, MPI_STATUS_IGNORE);
        at[st.MPI_SOURCE] = n;
      }
      pause_briefly(spins);
    }
    std::vector<std::string> missing, behind;
    for (int p = 0; p < info_.world_size; ++p) {
      if (p == info_.rank) continue;
      auto it = at.find(p);
      if (it == at.end()) missing.push_back(std::to_string(p));
      else if (it->second < seq) behind.push_back(std::to_string(p) + " (at collective #" + std::to_string(it->second) + ")");
    }
    auto list = [](const std::vector<std::string>& v) {
      std::string s;
      for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + v[i];
      return s;
    };
    if (!missing.empty())
      why += "; rank " + list(missing) + " did not arrive (no answer: stopped, dead, or busy outside MPI)";
    if (!behind.empty()) why += "; rank " + list(behind) + " did not arrive (still at an earlier collective)";
    if (missing.empty() && behind.empty()) why += "; every rank arrived, so the collective itself is stuck (network?)";
    why += " [this is collective #" + std::to_string(seq) + "]";
  }
  std::fprintf(stderr, "eo-ddp: rank %d: %s did not complete within %g s (%s)%s; aborting all ranks\n", info_.rank,
               what.c_str(), waited_s, timeout_key_.c_str(), why.c_str());
  std::fflush(stderr);
  abort(kExitRuntime);
}

void World::wait(MPI_Request* request, const std::string& what, std::uint64_t seq) const {
  const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s_);
  for (long spins = 0;; ++spins) {
    int done = 0;
    EO_MPI_CHECK(MPI_Test(request, &done, MPI_STATUS_IGNORE), what);
    if (done) return;
    serve_peers();
    if (Clock::now() > deadline) abort_on_timeout(what, seq, timeout_s_);
    pause_briefly(spins);
  }
}

void World::barrier() const {
  if (!mpi_) return;
  MPI_Request r;
  const std::uint64_t seq = enter_collective();
  EO_MPI_CHECK(MPI_Ibarrier(MPI_COMM_WORLD, &r), "barrier");
  wait(&r, "MPI barrier", seq);
}

namespace {
void allreduce(void* values, std::size_t n, MPI_Datatype type, MPI_Op op, const char* what, MPI_Request* r) {
  EO_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, values, static_cast<int>(n), type, op, MPI_COMM_WORLD, r), what);
}
}  // namespace

void World::allreduce_sum(double* values, std::size_t n) const {
  if (!mpi_) return;
  MPI_Request r;
  const std::uint64_t seq = enter_collective();
  allreduce(values, n, MPI_DOUBLE, MPI_SUM, "host all-reduce (sum)", &r);
  wait(&r, "host all-reduce (sum of " + std::to_string(n) + " doubles)", seq);
}

void World::allreduce_sum(std::int64_t* values, std::size_t n) const {
  if (!mpi_) return;
  MPI_Request r;
  const std::uint64_t seq = enter_collective();
  allreduce(values, n, MPI_INT64_T, MPI_SUM, "host all-reduce (sum)", &r);
  wait(&r, "host all-reduce (sum of " + std::to_string(n) + " int64)", seq);
}

void World::allreduce_max(double* values, std::size_t n) const {
  if (!mpi_) return;
  MPI_Request r;
  const std::uint64_t seq = enter_collective();
  allreduce(values, n, MPI_DOUBLE, MPI_MAX, "host all-reduce (max)", &r);
  wait(&r, "host all-reduce (max of " + std::to_string(n) + " doubles)", seq);
}

void World::broadcast_bytes(void* data, std::size_t bytes, int root) const {
  if (!mpi_) return;
  auto* p = static_cast<char*>(data);
  // MPI counts are int: send in chunks of at most 1 GiB.
  const std::size_t chunk = std::size_t(1) << 30;
  for (std::size_t off = 0; off < bytes; off += chunk) {
    const int n = static_cast<int>(std::min(chunk, bytes - off));
    MPI_Request r;
    const std::uint64_t seq = enter_collective();
    EO_MPI_CHECK(MPI_Ibcast(p + off, n, MPI_BYTE, root, MPI_COMM_WORLD, &r), "broadcast");
    wait(&r, "host broadcast of " + std::to_string(bytes) + " bytes from rank " + std::to_string(root), seq);
  }
}

std::string World::broadcast_string(const std::string& s, int root) const {
  if (!mpi_) return s;
  std::uint64_t len = s.size();
  broadcast_bytes(&len, sizeof len, root);
  std::string out = info_.rank == root ? s : std::string(len, '\0');
  broadcast_bytes(out.data(), len, root);
  return out;
}

std::vector<std::string> World::allgather(const std::string& mine) const {
  if (!mpi_) return {mine};
  const int n = info_.world_size;
  int len = static_cast<int>(mine.size());
  std::vector<int> lens(n), offs(n);
  MPI_Request r;
  std::uint64_t seq = enter_collective();
  EO_MPI_CHECK(MPI_Iallgather(&len, 1, MPI_INT, lens.data(), 1, MPI_INT, MPI_COMM_WORLD, &r), "all-gather of lengths");
  wait(&r, "host all-gather of string lengths", seq);
  int total = 0;
  for (int i = 0; i < n; ++i) {
    offs[i] = total;
    total += lens[i];
  }
  std::string all(static_cast<std::size_t>(total), '\0');
  seq = enter_collective();
  EO_MPI_CHECK(MPI_Iallgatherv(mine.data(), len, MPI_CHAR, all.data(), lens.data(), offs.data(), MPI_CHAR, MPI_COMM_WORLD, &r),
               "all-gather of strings");
  wait(&r, "host all-gather of strings", seq);
  std::vector<std::string> out(n);
  for (int i = 0; i < n; ++i) out[i] = all.substr(offs[i], lens[i]);
  return out;
}

void World::abort(int code) const {
  std::fflush(stdout);
  std::fflush(stderr);
  int inited = 0, fin = 0;
  MPI_Initialized(&inited);
  MPI_Finalized(&fin);
  // mpirun ends every rank and exits with `code` (the first MPI_Abort's code wins).
  if (mpi_ && inited && !fin) MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

void World::finalize() {
  if (mpi_ && !finalized_) {
    int fin = 0;
    MPI_Finalized(&fin);
    if (!fin) {
      if (probe_comm_ != MPI_COMM_NULL) MPI_Comm_free(&probe_comm_);
      MPI_Finalize();
    }
  }
  finalized_ = true;
}

World::~World() { finalize(); }

}  // namespace eo::ddp
