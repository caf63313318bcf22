// Helpers for the fault-injection tests (tests/test_faults.cpp, tests/test_faults_mpi.cpp): run
// eo-ddp (or mpirun eo-ddp) as a child with a bounded wait, an environment and optional resource
// limits, and read what it left behind.
#pragma once

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "tests/temp_dir_test.h"
#include "tests/test_paths.h"

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace eo::faults {

namespace fs = std::filesystem;
using json = nlohmann::json;

struct Outcome {
  bool exited = false;  // normal exit (then `code`), else killed by `signal`
  int code = -1;
  int signal = 0;
  bool timed_out = false;
  double seconds = 0;
  std::string log;
  std::string describe() const {
    std::ostringstream os;
    os << (timed_out ? "timed out; " : "") << (exited ? "exit code " + std::to_string(code) : "signal " + std::to_string(signal))
       << " after " << seconds << " s\n--- output ---\n" << log;
    return os.str();
  }
};

inline std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

struct RunOptions {
  std::vector<std::string> env;  // "KEY=value"
  long fsize_limit_bytes = -1;   // RLIMIT_FSIZE for the child (ulimit -f), -1 = unchanged
  double timeout_s = 240;
};

// A started child: run() = wait_for(spawn(...)); tests that signal a run mid-way hold the Child.
struct Child {
  pid_t pid = -1;
  fs::path log;
  std::chrono::steady_clock::time_point start;
};

// argv[0] is the program (absolute path). Runs in the source folder (the bundled configs' paths
// are relative to it) with one OpenMP thread (2 shared cores; and identical arithmetic per run).
// A run that injects faults (an EO_DDP_FAULT* variable in its environment) runs eo-ddp-faults, eo-ddp's
// main with the test seam's plan read from those variables (tests/eo_ddp_faults.cpp); the eo-ddp
// binary itself reads none of them.
inline std::vector<std::string> with_fault_binary(std::vector<std::string> argv, const RunOptions& o) {
  bool faults = false;
  for (const auto& kv : o.env) faults = faults || kv.rfind("EO_DDP_FAULT", 0) == 0;
  if (!faults) return argv;
  const std::string plain = std::string(EO_BINARY_DIR) + "/eo-ddp";
  for (auto& a : argv)
    if (a == plain) a = plain + "-faults";
  return argv;
}

inline Child spawn(const std::vector<std::string>& argv_given, const fs::path& log, const RunOptions& o = {}) {
  const std::vector<std::string> argv_in = with_fault_binary(argv_given, o);
  std::vector<char*> argv;
  for (const auto& a : argv_in) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const auto t0 = std::chrono::steady_clock::now();
  const pid_t pid = fork();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive the test
    setpgid(0, 0);                     // own process group: a timeout kills mpirun and its ranks
    if (chdir(EO_SOURCE_DIR) != 0) _exit(120);
    FILE* f = std::fopen(log.c_str(), "w");
    if (!f) _exit(121);
    dup2(fileno(f), 1);
    dup2(fileno(f), 2);
    setenv("OMP_NUM_THREADS", "1", 1);
    for (const auto& kv : o.env) putenv(const_cast<char*>(kv.c_str()));
    if (o.fsize_limit_bytes >= 0) {
      struct rlimit rl {static_cast<rlim_t>(o.fsize_limit_bytes), static_cast<rlim_t>(o.fsize_limit_bytes)};
      if (setrlimit(RLIMIT_FSIZE, &rl) != 0) _exit(123);
    }
    execv(argv[0], argv.data());
    _exit(122);
  }
  return {pid, log, t0};
}

// Waits up to timeout_s more for the child; past that kills its process group.
inline Outcome wait_for(const Child& c, double timeout_s) {
  Outcome out;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  int status = 0;
  while (waitpid(c.pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      out.timed_out = true;
      kill(-c.pid, SIGKILL);
      kill(c.pid, SIGKILL);
      waitpid(c.pid, &status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - c.start).count();
  out.exited = WIFEXITED(status);
  out.code = out.exited ? WEXITSTATUS(status) : -1;
  out.signal = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
  out.log = read_text(c.log);
  return out;
}

inline Outcome run(const std::vector<std::string>& argv, const fs::path& log, const RunOptions& o = {}) {
  return wait_for(spawn(argv, log, o), o.timeout_s);
}

inline std::string eo_ddp() { return std::string(EO_BINARY_DIR) + "/eo-ddp"; }

// eo-ddp --config configs/tiny-qwen3-moe.yaml --set output_dir=OUT --set k=v ...
inline std::vector<std::string> train_args(const fs::path& out, const std::vector<std::string>& sets,
                                           const std::string& config = "configs/tiny-qwen3-moe.yaml") {
  std::vector<std::string> a{"--config", config, "--set", "output_dir=" + out.string()};
  for (const auto& s : sets) {
    a.push_back("--set");
    a.push_back(s);
  }
  return a;
}

// eo-ddp ARGS... as an argv.
inline std::vector<std::string> eo_ddp_command(const std::vector<std::string>& args) {
  std::vector<std::string> argv{eo_ddp()};
  argv.insert(argv.end(), args.begin(), args.end());
  return argv;
}

inline Outcome train(const fs::path& out, const std::vector<std::string>& sets, const RunOptions& o = {}) {
  return run(eo_ddp_command(train_args(out, sets)), out.string() + ".log", o);
}

// metrics.jsonl by step (the last line of a step wins).
inline std::map<std::int64_t, json> read_metrics(const fs::path& out) {
  std::map<std::int64_t, json> by_step;
  std::ifstream in(out / "metrics.jsonl");
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) {
      json j = json::parse(line);
      by_step[j.at("step").get<std::int64_t>()] = j;
    }
  return by_step;
}

// Every path under `dir` whose name says it is unfinished (temporary folders and files).
inline std::vector<std::string> leftovers(const fs::path& dir) {
  std::vector<std::string> found;
  if (!fs::exists(dir)) return found;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    if (n.rfind(".tmp", 0) == 0 || n.find(".tmp.") != std::string::npos) found.push_back(e.path().string());
  }
  return found;
}

// The bytes of every file of a folder, by relative path.
inline std::map<std::string, std::string> folder_bytes(const fs::path& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file()) out[fs::relative(e.path(), dir).string()] = read_text(e.path());
  return out;
}

// Per-test temporary folder, kept when the test failed.
class FaultTest : public eo::testing::TempDirTest {
 protected:
  FaultTest() : TempDirTest("eo_faults_") {}
};

}  // namespace eo::faults
