// Fault injection on one rank, through the eo-ddp binary and the bundled tiny Qwen3-MoE (issue #8,
// item 3). Every case asserts a clear message, a non-zero exit within a bounded time, and no
// corrupted output. (A rank killed mid-step, SIGTERM with resume and kill -9 during a checkpoint
// write are in tests/mpi_train.sh and tests/test_train.cpp; 2-rank NaN cases in test_faults_mpi.cpp.)
//
//  - disk full during a checkpoint save: a real tmpfs (private mount namespace, needs root) and a
//    file-size limit (RLIMIT_FSIZE, EFBIG; works anywhere). Each says which it used.
//  - NaN loss: the step is skipped (adapter and optimizer state bitwise unchanged), counted in
//    metrics.jsonl; max_nonfinite_steps consecutive ones stop the run.
//  - host RAM for the expert homes: the pre-load check (test override EO_DDP_FAULT_HOST_MEM_AVAILABLE),
//    the real check passing, and the estimate equal to the bytes the offload engine allocates.
//  - data: empty files, token ids outside the vocabulary, too little data for one step: exit 2
//    before training, naming the file (and line / index) and the fix.
#include <gtest/gtest.h>

#include "common/files.h"
#include "common/fault_seam.h"
#include "runtime/plan.h"
#include <csignal>
#include <sched.h>
#include <sys/mount.h>

#include <cerrno>
#include <cstring>
#include <iostream>
#include <sstream>
#include <chrono>
#include <thread>
#include <fstream>
#include <functional>

#include "fault_support.h"
#include "models/hf_config.h"
#include "models/moe_model.h"
#include "offload/engine.h"
#include "offload/host_memory.h"
#include "runtime/schedule.h"
#include "runtime/train_state.h"
#include "tests/test_paths.h"

using namespace eo::faults;

namespace {

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

std::int64_t bytes_in_pages(const fs::path& dir) {
  std::int64_t total = 0;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file()) total += (static_cast<std::int64_t>(e.file_size()) + 4095) / 4096 * 4096;
  return total;
}

// A tmpfs of `bytes` at `where`, in a mount namespace of this test process only (it disappears
// with the process, whatever happens); unmounted by the destructor so the folder can be removed.
class SmallTmpfs {
 public:
  SmallTmpfs(const fs::path& where, std::int64_t bytes) : where_(where) {
    fs::create_directories(where);
    if (::unshare(CLONE_NEWNS) != 0) {
      why_ = std::string("unshare(CLONE_NEWNS): ") + std::strerror(errno);
      return;
    }
    if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) {
      why_ = std::string("mount --make-rprivate /: ") + std::strerror(errno);
      return;
    }
    const std::string opts = "size=" + std::to_string(bytes);
    if (::mount("tmpfs", where.c_str(), "tmpfs", 0, opts.c_str()) != 0) {
      why_ = std::string("mount -t tmpfs: ") + std::strerror(errno);
      return;
    }
    mounted_ = true;
  }
  ~SmallTmpfs() {
    if (mounted_) ::umount2(where_.c_str(), MNT_DETACH);
  }
  bool mounted() const { return mounted_; }
  const std::string& why_not() const { return why_; }

 private:
  fs::path where_;
  bool mounted_ = false;
  std::string why_;
};

// The checks shared by both disk-full tests, on the output folder of the failed run.
void expect_failed_save_left_no_trace(const Outcome& o, const fs::path& out, const std::string& errno_text) {
  EXPECT_FALSE(o.timed_out) << o.describe();
  EXPECT_TRUE(o.exited && o.code == 1) << "expected exit 1 (runtime failure): " << o.describe();
  EXPECT_TRUE(contains(o.log, "cannot save checkpoint " + (out / "checkpoint-4").string())) << o.log;
  EXPECT_TRUE(contains(o.log, errno_text)) << "expected '" << errno_text << "' in\n" << o.log;
  EXPECT_TRUE(contains(o.log, (out / ".tmp-checkpoint-4").string())) << "the message names the file being written\n" << o.log;
  EXPECT_FALSE(fs::exists(out / "checkpoint-4")) << "a half-written checkpoint-4 is visible under its final name";
  EXPECT_EQ(leftovers(out), std::vector<std::string>{}) << "temporary files of the failed save were left behind";
  ASSERT_TRUE(fs::exists(out / "checkpoint-2" / "trainer_state.json"));
  EXPECT_EQ(eo::latest_checkpoint(out.string()), (out / "checkpoint-2").string()) << "auto must pick the intact checkpoint-2";
  EXPECT_EQ(eo::load_checkpoint((out / "checkpoint-2").string()).step, 2);
}

std::string sets_of(const fs::path& out) { return "output_dir=" + out.string(); }

// A checkpoint's bytes, less what names the run that wrote it (run_id, lineage: unique per run),
// so checkpoints of two identical runs compare equal.
std::map<std::string, std::string> checkpoint_contents(const fs::path& dir) {
  auto files = folder_bytes(dir);
  auto state = json::parse(files.at("trainer_state.json"));
  state.erase("run_id");
  state.erase("lineage");
  files["trainer_state.json"] = state.dump();
  files.erase("checksums.txt");  // covers trainer_state.json as written, run id included
  return files;
}

}  // namespace

// ---- disk full ------------------------------------------------------------------------------------

// A tmpfs big enough for checkpoint-2 and half of another: the save of checkpoint-4 hits ENOSPC.
TEST_F(FaultTest, DiskFullDuringSaveOnTmpfs) {
  const std::vector<std::string> sets{"max_steps=6", "save_steps=2", "save_total_limit=10"};
  // Reference: the same run on a roomy disk (its checkpoint-2 sizes the tmpfs and is what must survive).
  const fs::path ref = dir_ / "ref";
  const Outcome r = train(ref, sets);
  ASSERT_TRUE(r.exited && r.code == 0) << r.describe();
  const std::int64_t ckpt = bytes_in_pages(ref / "checkpoint-2");
  const std::int64_t size = ckpt + ckpt / 2 + 4 * 4096;  // + metrics.jsonl and slack

  const fs::path out = dir_ / "tmpfs";  // the mount point is output_dir; the log is beside it
  SmallTmpfs tmpfs(out, size);
  if (!tmpfs.mounted()) GTEST_SKIP() << "no tmpfs (" << tmpfs.why_not() << "); DiskFullDuringSaveWithFileSizeLimit covers this";
  std::cout << "disk-full test: using a real tmpfs of " << size << " bytes (mount -t tmpfs in a private mount namespace); "
            << "one checkpoint is " << ckpt << " bytes" << std::endl;
  const Outcome o = train(out, sets);
  expect_failed_save_left_no_trace(o, out, "No space left on device");
  EXPECT_FALSE(fs::exists(out / "adapter_model.safetensors")) << "the run never finished, yet a final adapter exists";
  EXPECT_EQ(checkpoint_contents(out / "checkpoint-2"), checkpoint_contents(ref / "checkpoint-2"))
      << "checkpoint-2 is not the reference's";

  // auto resumes from the surviving checkpoint-2 (on a disk with room) and ends as the reference.
  const fs::path moved = dir_ / "moved";
  fs::copy(out, moved, fs::copy_options::recursive);
  const Outcome res = train(moved, {"max_steps=6", "save_steps=2", "save_total_limit=10", "resume_from_checkpoint=auto"});
  ASSERT_TRUE(res.exited && res.code == 0) << res.describe();
  EXPECT_TRUE(contains(res.log, "resumed from " + (moved / "checkpoint-2").string() + " at step 2")) << res.log;
  EXPECT_EQ(read_text(moved / "adapter_model.safetensors"), read_text(ref / "adapter_model.safetensors"))
      << "the resumed run's adapter differs from the uninterrupted one";
}

// Where no tmpfs can be mounted: a file-size limit (ulimit -f) makes the save's writes fail with
// EFBIG. The trainer ignores SIGXFSZ, so the write fails instead of the signal killing the process.
TEST_F(FaultTest, DiskFullDuringSaveWithFileSizeLimit) {
  const fs::path out = dir_ / "run";
  const Outcome first = train(out, {"max_steps=2", "save_steps=2"});
  ASSERT_TRUE(first.exited && first.code == 0) << first.describe();
  const auto before = folder_bytes(out / "checkpoint-2");
  const std::string adapter_before = read_text(out / "adapter_model.safetensors");
  const long limit = static_cast<long>(fs::file_size(out / "checkpoint-2" / "adapter_model.safetensors") / 2);
  ASSERT_GT(limit, static_cast<long>(fs::file_size(out / "metrics.jsonl")) * 4) << "the limit must only hit checkpoint files";
  std::cout << "disk-full test: using RLIMIT_FSIZE = " << limit << " bytes (ulimit -f; writes fail with EFBIG)" << std::endl;
  RunOptions ro;
  ro.fsize_limit_bytes = limit;
  const Outcome o = train(out, {"max_steps=4", "save_steps=2", "resume_from_checkpoint=auto"}, ro);
  EXPECT_NE(o.signal, SIGXFSZ) << "killed by SIGXFSZ: the trainer must ignore it so the write fails with a message";
  expect_failed_save_left_no_trace(o, out, "File too large");
  EXPECT_EQ(folder_bytes(out / "checkpoint-2"), before) << "checkpoint-2 changed";
  EXPECT_EQ(read_text(out / "adapter_model.safetensors"), adapter_before) << "the previous final adapter changed";
}

// write_file_atomic: a failed write leaves neither the target nor its temporary file. The write
// fails for real: RLIMIT_FSIZE makes it EFBIG (SIGXFSZ ignored, as the trainer does). (It used to
// plant a link to /dev/full at the temporary's name; the writer now creates its temporary with
// O_EXCL | O_NOFOLLOW under an unpredictable name, so nothing can be planted there: issue #15 item 8.)
TEST_F(FaultTest, AtomicFileWriteFailsCleanly) {
  const fs::path target = dir_ / "adapter_config.json";
  eo::write_file_atomic(target.string(), "old\n");
  const std::string tmp_prefix = (dir_ / ".adapter_config.json.tmp.").string();
  struct rlimit saved {};
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &saved), 0);
  auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  struct rlimit small = saved;
  small.rlim_cur = 4096;
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
  std::string error;
  try {
    eo::write_file_atomic(target.string(), std::string(1 << 16, 'x'));
  } catch (const std::exception& e) {
    error = e.what();
  }
  setrlimit(RLIMIT_FSIZE, &saved);
  std::signal(SIGXFSZ, old_handler);
  ASSERT_FALSE(error.empty()) << "writing past the file-size limit succeeded";
  EXPECT_TRUE(contains(error, tmp_prefix)) << error;
  EXPECT_TRUE(contains(error, "File too large")) << error;
  EXPECT_EQ(read_text(target), "old\n") << "the previous contents must survive";
  for (const auto& e : fs::directory_iterator(dir_))
    EXPECT_NE(e.path().string().rfind(tmp_prefix, 0), 0u) << "the temporary file was left behind: " << e.path();
}

// ---- NaN / Inf ------------------------------------------------------------------------------------

// A NaN loss at step 3: that step changes nothing (adapter and optimizer state bitwise as after
// step 2), is counted, warned about, and training continues and finishes.
TEST_F(FaultTest, NanStepIsSkippedAndCounted) {
  const fs::path out = dir_ / "run";
  RunOptions ro;
  ro.env = {"EO_DDP_FAULT=nan", "EO_DDP_FAULT_STEP=3"};
  const Outcome o = train(out, {"max_steps=5", "save_steps=1", "save_total_limit=10", "lr_scheduler=constant", "warmup_steps=0"}, ro);
  ASSERT_TRUE(o.exited && o.code == 0) << o.describe();
  EXPECT_TRUE(contains(o.log, "step 3: loss ") && contains(o.log, "nan")) << o.log;
  EXPECT_TRUE(contains(o.log, "skipped without an optimizer update (1 in a row, 5 stop the run)")) << o.log;
  const auto m = read_metrics(out);
  ASSERT_EQ(m.size(), 5u);
  for (std::int64_t s = 1; s <= 5; ++s) {
    EXPECT_EQ(m.at(s).at("skipped_nonfinite").get<int>(), s >= 3 ? 1 : 0) << m.at(s).dump();
    EXPECT_EQ(m.at(s).at("loss").is_null(), s == 3) << "only step 3's loss is not a number: " << m.at(s).dump();
  }
  const auto c2 = folder_bytes(out / "checkpoint-2"), c3 = folder_bytes(out / "checkpoint-3"), c4 = folder_bytes(out / "checkpoint-4");
  EXPECT_EQ(c3.at("adapter_model.safetensors"), c2.at("adapter_model.safetensors")) << "the skipped step changed the LoRA";
  EXPECT_EQ(c3.at("optimizer.safetensors"), c2.at("optimizer.safetensors")) << "the skipped step changed the optimizer state";
  EXPECT_NE(c4.at("adapter_model.safetensors"), c3.at("adapter_model.safetensors")) << "training did not continue after the skip";
  EXPECT_EQ(eo::load_checkpoint((out / "checkpoint-4").string()).extra.value("skipped_nonfinite", -1), 1);
  EXPECT_TRUE(fs::exists(out / "adapter_model.safetensors"));
}

// The same NaN at step 3 without saves: the host then reads each step while the next one runs,
// and the skip is decided on the device before the host has seen the loss. The run must match the
// one above, which reads every step before queuing the next (a save each step): the same losses
// and gradient norms, the same count, the same final adapter bytes.
TEST_F(FaultTest, NanStepSkippedOnTheDeviceWhileTheHostRunsAheadMatchesAReadEveryStepRun) {
  RunOptions ro;
  ro.env = {"EO_DDP_FAULT=nan", "EO_DDP_FAULT_STEP=3"};
  const std::vector<std::string> common{"max_steps=5", "lr_scheduler=constant", "warmup_steps=0"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> v = common;
    v.insert(v.end(), extra.begin(), extra.end());
    return v;
  };
  const fs::path ahead = dir_ / "ahead", each = dir_ / "each";
  const Outcome a = train(ahead, with({"save_steps=0"}), ro);
  const Outcome e = train(each, with({"save_steps=1", "save_total_limit=10"}), ro);
  ASSERT_TRUE(a.exited && a.code == 0) << a.describe();
  ASSERT_TRUE(e.exited && e.code == 0) << e.describe();
  EXPECT_TRUE(contains(a.log, "skipped without an optimizer update (1 in a row, 5 stop the run)")) << a.log;
  const auto ma = read_metrics(ahead), me = read_metrics(each);
  ASSERT_EQ(ma.size(), 5u);
  ASSERT_EQ(me.size(), 5u);
  for (std::int64_t s = 1; s <= 5; ++s) {
    for (const char* k : {"loss", "grad_norm", "skipped_nonfinite"})
      EXPECT_EQ(ma.at(s).at(k), me.at(s).at(k)) << k << " at step " << s;
  }
  EXPECT_EQ(folder_bytes(ahead).at("adapter_model.safetensors"), folder_bytes(each).at("adapter_model.safetensors"))
      << "the device-decided skip while running ahead gave another adapter";
}

// A rank that fails at the start of step 3, without saves: step 2 was still to be read (the
// host runs a step ahead of its reads), and its metrics line is written before the run ends.
TEST_F(FaultTest, AFailureWhileQueuingAStepStillReportsTheStepBefore) {
  const fs::path out = dir_ / "run";
  RunOptions ro;
  ro.env = {"EO_DDP_FAULT=throw", "EO_DDP_FAULT_STEP=3"};
  const Outcome o = train(out, {"max_steps=5", "save_steps=0"}, ro);
  ASSERT_FALSE(o.timed_out) << o.describe();
  EXPECT_TRUE(o.exited && o.code != 0) << o.describe();
  EXPECT_TRUE(contains(o.log, "fault injected at step 3")) << o.log;
  const auto m = read_metrics(out);
  ASSERT_EQ(m.size(), 2u) << "steps 1 and 2 were done and must be reported";
  EXPECT_TRUE(m.at(2).at("loss").is_number()) << m.at(2).dump();
  EXPECT_FALSE(fs::exists(out / "adapter_model.safetensors"));
}

// Every step NaN: the run stops at the limit, exit 1, saying why, and writes no final adapter.
TEST_F(FaultTest, NonFiniteStepsStopAtTheLimit) {
  const fs::path out = dir_ / "run";
  RunOptions ro;
  ro.env = {"EO_DDP_FAULT=nan", "EO_DDP_FAULT_STEP=all"};
  ro.timeout_s = 120;
  const Outcome o = train(out, {"max_steps=50", "save_steps=0", "max_nonfinite_steps=3"}, ro);
  ASSERT_FALSE(o.timed_out) << o.describe();
  EXPECT_TRUE(o.exited && o.code == 1) << o.describe();
  EXPECT_TRUE(contains(o.log, "the loss or gradients were NaN/Inf for 3 consecutive steps (1 to 3, max_nonfinite_steps: 3)")) << o.log;
  const auto m = read_metrics(out);
  ASSERT_EQ(m.size(), 3u) << "it must stop at step 3";
  EXPECT_EQ(m.at(3).at("skipped_nonfinite").get<int>(), 3);
  EXPECT_FALSE(fs::exists(out / "adapter_model.safetensors"));

  // The key is validated like every other.
  std::vector<std::string> argv{eo_ddp()};
  for (auto& a : train_args(dir_ / "bad", {"max_nonfinite_steps=0"})) argv.push_back(a);
  argv.push_back("--check");
  const Outcome bad = run(argv, dir_ / "bad.log", {{}, -1, 60});
  EXPECT_TRUE(bad.exited && bad.code == 2) << bad.describe();
  EXPECT_TRUE(contains(bad.log, "max_nonfinite_steps")) << bad.log;
}

// Issue #32 item 6: checkpoints 6 and 4 damaged (a byte of the optimizer state, a byte of the
// adapter): `auto` warns about each, resumes checkpoint-2, and ends with the adapter an
// undisturbed run wrote, byte for byte.
TEST_F(FaultTest, DamagedCheckpointsFallBackToThePreviousIntactOne) {
  const fs::path out = dir_ / "run";
  const std::vector<std::string> sets{"max_steps=6", "save_steps=2", "save_total_limit=10"};
  const Outcome first = train(out, sets);
  ASSERT_TRUE(first.exited && first.code == 0) << first.describe();
  const std::string adapter = read_text(out / "adapter_model.safetensors");
  auto flip = [](const fs::path& f, std::size_t from_end) {
    std::string b = read_text(f);
    b[b.size() - from_end] ^= 0x40;
    std::ofstream(f, std::ios::binary | std::ios::trunc) << b;
  };
  flip(out / "checkpoint-6" / "optimizer.safetensors", 3);
  flip(out / "checkpoint-4" / "adapter_model.safetensors", 100);
  std::vector<std::string> resume = sets;
  resume.push_back("resume_from_checkpoint=auto");
  const Outcome again = train(out, resume);
  ASSERT_TRUE(again.exited && again.code == 0) << again.describe();
  EXPECT_TRUE(contains(again.log, (out / "checkpoint-6").string() + " is damaged: optimizer.safetensors changed after it was saved"))
      << again.log;
  EXPECT_TRUE(contains(again.log, (out / "checkpoint-4").string() + " is damaged: adapter_model.safetensors changed")) << again.log;
  EXPECT_TRUE(contains(again.log, "resumed from " + (out / "checkpoint-2").string() + " at step 2")) << again.log;
  EXPECT_EQ(read_text(out / "adapter_model.safetensors"), adapter) << "the resume from checkpoint-2 is not exact";
  EXPECT_EQ(eo::checkpoint_damage((out / "checkpoint-6").string()), "") << "checkpoint-6 was not saved again";
}

// Item 6: a NaN in the LoRA after step 3's update (EO_DDP_FAULT_NAN_STATE) stops the run at
// once with exit 1: nothing with NaN is saved, no final adapter is written, and the message
// names checkpoint-2, which save_total_limit 1 has kept.
TEST_F(FaultTest, NonFiniteParametersStopTheRunAndKeepTheLastGoodCheckpoint) {
  const fs::path out = dir_ / "run";
  const Outcome o = train(out, {"max_steps=6", "save_steps=1", "save_total_limit=1"}, RunOptions{{"EO_DDP_FAULT_NAN_STATE=3"}});
  ASSERT_FALSE(o.timed_out) << o.describe();
  EXPECT_TRUE(o.exited && o.code == 1) << o.describe();
  EXPECT_TRUE(contains(o.log, "after step 3 the LoRA parameters or the optimizer state hold NaN/Inf values")) << o.log;
  EXPECT_TRUE(contains(o.log, "resume_from_checkpoint: " + (out / "checkpoint-2").string())) << o.log;
  EXPECT_TRUE(fs::exists(out / "checkpoint-2" / "trainer_state.json"));
  EXPECT_FALSE(fs::exists(out / "checkpoint-3"));
  EXPECT_FALSE(fs::exists(out / "adapter_model.safetensors"));
}

// Item 6: a step skipped for a NaN loss (step 3) with save_total_limit 1: checkpoint-2, the last
// one before it, survives the pruning of every later save.
TEST_F(FaultTest, SkippedNonFiniteStepsNeverPruneTheCheckpointBeforeThem) {
  const fs::path out = dir_ / "run";
  RunOptions ro;
  ro.env = {"EO_DDP_FAULT=nan", "EO_DDP_FAULT_STEP=3"};
  const Outcome o = train(out, {"max_steps=5", "save_steps=1", "save_total_limit=1"}, ro);
  ASSERT_TRUE(o.exited && o.code == 0) << o.describe();
  EXPECT_TRUE(fs::exists(out / "checkpoint-2" / "trainer_state.json")) << "the checkpoint from before the NaN was pruned";
  EXPECT_TRUE(fs::exists(out / "checkpoint-5"));
  EXPECT_FALSE(fs::exists(out / "checkpoint-3") || fs::exists(out / "checkpoint-4"));
}

// ---- signals before training (issue #32 items 7, 8) -------------------------------------------------

namespace {

// A /proc file's text, empty when its process has gone: reading a vanished process's file fails
// with ESRCH, which libstdc++'s streams turn into an exception mid-read.
std::string proc_text(const fs::path& p) {
  try {
    return read_text(p);
  } catch (const std::exception&) {  // std::ios_base::failure, of either library ABI
    return {};
  }
}

// /proc/<pid>/status's SigCgt has `sig`: the process has a handler for it.
bool catches(pid_t pid, int sig) {
  std::istringstream in(proc_text("/proc/" + std::to_string(pid) + "/status"));
  for (std::string line; std::getline(in, line);)
    if (line.rfind("SigCgt:", 0) == 0) return (std::stoull(line.substr(7), nullptr, 16) >> (sig - 1)) & 1;
  return false;
}

// The pid of a process whose command line contains `part`, started by `parent`; -1 if none.
pid_t child_running(pid_t parent, const std::string& part) {
  for (const auto& e : fs::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const std::string stat = proc_text(e.path() / "stat");
    const auto close = stat.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(stat.substr(close + 2));
    char state = 0;
    pid_t ppid = 0;
    rest >> state >> ppid;
    if (ppid != parent) continue;
    const std::string cmd = proc_text(e.path() / "cmdline");
    if (cmd.find(part) != std::string::npos) return std::stoi(name);
  }
  return -1;
}

// No such process any more (or only its zombie, which a container's init may never reap).
bool gone(pid_t pid) {
  const std::string stat = proc_text("/proc/" + std::to_string(pid) + "/stat");
  const auto close = stat.rfind(')');
  return stat.empty() || close == std::string::npos || stat.substr(close + 2, 1) == "Z";
}

bool wait_until(const std::function<bool()>& cond, double seconds) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (!cond()) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

}  // namespace

// A stop as soon as the process can take one (its handler is in place: SigCgt), for each stop
// signal (SIGUSR1 is what launch/eo-mpirun hands the ranks: 138 without its handler): exit 3,
// saying nothing was trained, and nothing written but the claim of output_dir.
TEST_F(FaultTest, StopBeforeTrainingExits3) {
  for (const int sig : {SIGTERM, SIGINT, SIGUSR1, SIGHUP}) {
    const fs::path out = dir_ / ("run" + std::to_string(sig));
    // Held after setup until the signal has come (else a quick load may reach step 1 first).
    RunOptions ro;
    ro.env = {"EO_DDP_FAULT_HOLD_BEFORE_TRAINING=60"};
    const Child c = spawn(eo_ddp_command(train_args(out, {"max_steps=2"})), out.string() + ".log", ro);
    const bool ready = wait_until([&] { return catches(c.pid, sig); }, 30);
    if (ready) ::kill(c.pid, sig);
    const Outcome o = wait_for(c, 120);
    ASSERT_TRUE(ready) << "no handler for signal " << sig << " within 30 s: " << o.describe();
    EXPECT_TRUE(o.exited && o.code == 3) << "signal " << sig << ": " << o.describe();
    EXPECT_TRUE(contains(o.log, "nothing was trained, so nothing is lost")) << o.log;
    EXPECT_FALSE(fs::exists(out / "adapter_model.safetensors"));
    EXPECT_FALSE(eo::latest_checkpoint(out.string()).has_value());
  }
}

// SIGTERM while tools/prepare_data.py tokenises (in `train` and in `eo-ddp preprocess`): the tool
// is ended with eo-ddp, which exits 3 leaving no half-written cache; kill -9 of eo-ddp ends the
// tool too (it runs in its own process group, with a parent-death signal).
TEST_F(FaultTest, StopWhileTokenisingEndsTheTokeniser) {
  const std::string chat = "configs/tiny-qwen3-moe-chat.yaml";
  for (const std::string how : {"train", "preprocess", "kill"}) {
    const fs::path out = dir_ / how, prep = dir_ / (how + "-prepared");
    std::vector<std::string> argv{eo_ddp()};
    if (how == "preprocess") argv.push_back("preprocess");
    for (const auto& a : train_args(out, {"dataset_prepared_path=" + prep.string()}, chat)) argv.push_back(a);
    const Child c = spawn(argv, out.string() + ".log");
    pid_t tool = -1;
    const bool started = wait_until([&] { return (tool = child_running(c.pid, "prepare_data.py")) > 0; }, 60);
    if (started) ::kill(c.pid, how == "kill" ? SIGKILL : SIGTERM);
    const Outcome o = wait_for(c, 60);
    const bool ended = started && wait_until([&] { return gone(tool); }, 15);
    if (started && !ended) ::kill(tool, SIGKILL);  // never left behind, even when the test fails
    ASSERT_TRUE(started) << how << ": the tokeniser never started: " << o.describe();
    EXPECT_TRUE(ended) << how << ": tools/prepare_data.py (pid " << tool << ") outlived eo-ddp";
    if (how == "kill") {
      EXPECT_EQ(o.signal, SIGKILL) << o.describe();
      continue;
    }
    EXPECT_TRUE(o.exited && o.code == 3) << how << ": " << o.describe();
    EXPECT_TRUE(contains(o.log, "while tokenising the datasets")) << o.log;
    std::vector<std::string> partial;
    if (fs::exists(prep))
      for (const auto& e : fs::directory_iterator(prep)) partial.push_back(e.path().filename().string());
    EXPECT_EQ(partial, std::vector<std::string>{}) << how << ": a stopped tokenisation left files in the cache";
  }
}

// Issue #32 item 14: --check probes dataset_prepared_path when a dataset is to be tokenised.
TEST_F(FaultTest, CheckProbesDatasetPreparedPath) {
  std::ofstream(dir_ / "a-file") << "x";
  std::vector<std::string> argv{eo_ddp()};
  for (const auto& a : train_args(dir_ / "out", {"dataset_prepared_path=" + (dir_ / "a-file" / "prep").string()},
                                  "configs/tiny-qwen3-moe-chat.yaml"))
    argv.push_back(a);
  argv.push_back("--check");
  const Outcome o = run(argv, dir_ / "check.log", {{}, -1, 60});
  EXPECT_TRUE(o.exited && o.code == 2) << o.describe();
  EXPECT_TRUE(contains(o.log, "dataset_prepared_path " + (dir_ / "a-file" / "prep").string() + ": " + (dir_ / "a-file").string() +
                                  " exists and is not a folder"))
      << o.log;
}

// ---- host RAM for the expert homes ------------------------------------------------------------------

TEST_F(FaultTest, TooLittleHostMemoryFailsBeforeLoading) {
  const fs::path out = dir_ / "run";
  RunOptions ro;
  ro.env = {"EO_DDP_FAULT_HOST_MEM_AVAILABLE=100000"};
  ro.timeout_s = 60;
  const Outcome o = train(out, {"max_steps=2", "expert_offload=true"}, ro);
  ASSERT_FALSE(o.timed_out) << o.describe();
  EXPECT_TRUE(o.exited && o.code == 1) << o.describe();
  const auto mc = eo::model::load_config(std::string(EO_SOURCE_DIR) + "/fixtures/tiny-qwen3-moe");
  const std::int64_t need = eo::offload::estimate_home_bytes(mc, 64, false);
  ASSERT_GT(need, 100000);
  EXPECT_TRUE(contains(o.log, "not enough host RAM for the expert homes")) << o.log;
  EXPECT_TRUE(contains(o.log, std::to_string(need) + " bytes")) << "bytes needed (" << need << ") missing:\n" << o.log;
  EXPECT_TRUE(contains(o.log, "only 100000 bytes")) << o.log;
  EXPECT_TRUE(contains(o.log, "run fewer ranks per node")) << o.log;
  EXPECT_FALSE(contains(o.log, "loading ")) << "weights were read before the check:\n" << o.log;
}

// The real measurement on this machine passes for the tiny model and is logged.
TEST_F(FaultTest, HostMemoryCheckPassesOnANormalRun) {
  const fs::path out = dir_ / "run";
  const Outcome o = train(out, {"max_steps=1", "expert_offload=true"});
  ASSERT_TRUE(o.exited && o.code == 0) << o.describe();
  EXPECT_TRUE(contains(o.log, "host memory: expert homes need ")) << o.log;
  EXPECT_FALSE(contains(o.log, "EO_DDP_FAULT_HOST_MEM_AVAILABLE")) << o.log;
  const eo::offload::HostMemory m = eo::offload::host_memory_available();
  EXPECT_GT(m.available, 0) << m.source;
}

TEST(HostMemory, MeasurementOverrideAndCheck) {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  std::int64_t total_kib = -1;
  while (meminfo >> key) {
    if (key == "MemTotal:") {
      meminfo >> total_kib;
      break;
    }
  }
  ASSERT_GT(total_kib, 0);
  const auto real = eo::offload::host_memory_available();
  EXPECT_GT(real.available, 0);
  EXPECT_LE(real.available, total_kib * 1024) << real.source;
  // The test seam's override (common/fault_seam.h), and nothing from the environment.
  setenv("EO_DDP_FAULT_HOST_MEM_AVAILABLE", "12345", 1);
  EXPECT_NE(eo::offload::host_memory_available().available, 12345) << "the library must not read EO_DDP_FAULT_HOST_MEM_AVAILABLE";
  unsetenv("EO_DDP_FAULT_HOST_MEM_AVAILABLE");
  eo::faults::Plan plan;
  plan.host_mem_available = 12345;
  eo::faults::install(plan);
  const auto fake = eo::offload::host_memory_available();
  eo::faults::install({});
  EXPECT_EQ(fake.available, 12345);

  using eo::offload::HomesKind;
  eo::offload::check_homes_fit(1000, 4, {4000, "test"});  // exactly fits
  try {
    eo::offload::check_homes_fit(1000, 4, {3999, "test"}, HomesKind::PerRank, 300);
    FAIL() << "4 ranks x 1000 bytes fit in 3999";
  } catch (const std::exception& e) {
    EXPECT_TRUE(contains(e.what(), "4 rank(s) on this node")) << e.what();
    EXPECT_TRUE(contains(e.what(), "4000 bytes")) << e.what();
    EXPECT_TRUE(contains(e.what(), "only 3999 bytes")) << e.what();
    EXPECT_TRUE(contains(e.what(), "expert_offload_homes: per_numa_node")) << "the shared form is suggested: " << e.what();
    EXPECT_TRUE(contains(e.what(), "set expert_offload_homes: disk (the homes in one file per host on a local drive, 300 B of "
                                   "read buffers per rank"))
        << "disk homes are suggested with their RAM: " << e.what();
  }
  try {  // already one copy per NUMA node: nothing to share further, the drive is left
    eo::offload::check_homes_fit(1000, 2, {1999, "test"}, HomesKind::PerNumaNode, 300);
    FAIL() << "2 copies x 1000 bytes fit in 1999";
  } catch (const std::exception& e) {
    EXPECT_TRUE(contains(e.what(), "2 NUMA node copy(ies)")) << e.what();
    EXPECT_FALSE(contains(e.what(), "per_numa_node")) << e.what();
    EXPECT_TRUE(contains(e.what(), "set expert_offload_homes: disk")) << e.what();
  }
  try {  // disk homes: each rank's read ring
    eo::offload::check_homes_fit(1000, 3, {2999, "test"}, HomesKind::Disk);
    FAIL() << "3 rings x 1000 bytes fit in 2999";
  } catch (const std::exception& e) {
    EXPECT_TRUE(contains(e.what(), "3 rank(s) on this node x 1000 B of disk homes read buffers each = 3000 bytes")) << e.what();
    EXPECT_TRUE(contains(e.what(), "lower expert_offload_prefetch_depth")) << e.what();
    EXPECT_FALSE(contains(e.what(), "set expert_offload_homes")) << e.what();
  }
}

// The pre-load estimate is exactly what the offload engine allocates for the tiny model.
TEST(HostMemory, EstimateEqualsTheHomesAllocated) {
  const std::string dir = std::string(EO_SOURCE_DIR) + "/fixtures/tiny-qwen3-moe";
  for (bool dq : {false, true})
    for (int blocksize : {64, 128}) {
      eo::model::LoadOptions lo;
      lo.load_in_4bit = true;
      lo.blocksize = blocksize;
      lo.double_quant = dq;
      lo.experts_on_host = true;
      auto model = eo::model::MoeModel::load(dir, lo);
      auto* resident = dynamic_cast<eo::model::ResidentWeights*>(&model->weight_provider());
      ASSERT_NE(resident, nullptr);
      eo::offload::OffloadOptions oo;
      oo.pin_memory = false;
      eo::offload::ExpertOffloader off(std::move(resident->bank()), oo);
      EXPECT_EQ(eo::offload::estimate_home_bytes(model->config(), blocksize, dq), off.home_bytes())
          << "blocksize " << blocksize << (dq ? " with" : " without") << " double quantisation";
      // The memory plan's slot size is the same arena (offload/layout.h), double quantisation included.
      eo::TrainConfig cfg;
      cfg.base_model = dir;
      cfg.load_in_4bit = true;
      cfg.adapter = "qlora";
      cfg.expert_offload = true;
      cfg.bnb_4bit_blocksize = blocksize;
      cfg.bnb_4bit_use_double_quant = dq;
      const eo::MemoryPlan plan = eo::plan_memory(cfg, model->config(), eo::Compute::Fp32, 1, false);
      EXPECT_EQ(plan.block_bytes, double(off.block_bytes(0))) << "blocksize " << blocksize << (dq ? ", double quant" : "");
      EXPECT_EQ(plan.host_pinned, double(off.home_bytes()));
    }
}

// Disk homes: the plan's pinned RAM is the engine's read ring, its file the file the engine writes,
// and its copies (= drive reads) per step those the engine makes along the trainer's schedule —
// 2N - 2S for N blocks and S slots.
TEST(HostMemory, DiskHomesPlanEqualsTheRingTheFileAndTheCopies) {
  const std::string dir = std::string(EO_SOURCE_DIR) + "/fixtures/tiny-qwen3-moe";
  const fs::path homes = fs::temp_directory_path() / ("eo-faults-disk-" + std::to_string(::getpid()));
  for (bool dq : {false, true})
    for (int depth : {1, 2}) {
      SCOPED_TRACE(std::string(dq ? "double quant" : "plain") + ", depth " + std::to_string(depth));
      eo::remove_tree(homes);
      eo::model::LoadOptions lo;
      lo.load_in_4bit = true;
      lo.double_quant = dq;
      lo.experts_on_host = true;
      auto model = eo::model::MoeModel::load(dir, lo);
      auto* resident = dynamic_cast<eo::model::ResidentWeights*>(&model->weight_provider());
      ASSERT_NE(resident, nullptr);
      eo::offload::OffloadOptions oo;
      oo.pin_memory = false;
      oo.prefetch_depth = depth;
      oo.disk = eo::offload::DiskHomesOptions{};
      oo.disk->dir = homes.string();
      eo::offload::ExpertOffloader off(std::move(resident->bank()), oo);
      eo::TrainConfig cfg;
      cfg.base_model = dir;
      cfg.load_in_4bit = true;
      cfg.adapter = "qlora";
      cfg.expert_offload = true;
      cfg.expert_offload_prefetch_depth = depth;
      cfg.bnb_4bit_use_double_quant = dq;
      cfg.expert_offload_homes = "disk";
      const eo::MemoryPlan plan = eo::plan_memory(cfg, model->config(), eo::Compute::Fp32, 1, false);
      EXPECT_TRUE(plan.disk_homes);
      EXPECT_EQ(plan.host_pinned, double(off.host_ram_bytes()));
      EXPECT_EQ(plan.disk_ring, off.disk_ring_size());
      EXPECT_EQ(plan.disk_file_bytes, double(fs::file_size(off.disk_file())));
      const int n = model->num_layers();
      std::vector<bool> moe(static_cast<std::size_t>(n));
      for (int i = 0; i < n; ++i) moe[static_cast<std::size_t>(i)] = model->config().is_moe_layer(i);
      const std::vector<int> order = eo::make_step_schedule(n, 1, eo::StepOrder::LayerMajor).staging_order(moe);
      off.set_schedule(order);
      eo::offload::OffloadStats st;
      for (int step = 0; step < 3; ++step) {
        for (int l : order) off.stage(l);
        st = off.take_step_stats();
      }
      EXPECT_EQ(st.copies, 2 * n - 2 * (1 + depth));
      EXPECT_EQ(plan.copies_per_step, st.copies);
      EXPECT_EQ(plan.disk_reads_per_step, double(st.copied_bytes));
    }
  eo::remove_tree(homes);
}

// ---- data -----------------------------------------------------------------------------------------

namespace {

struct DataCase {
  std::string name;
  std::string type;      // tokenized | tokens
  std::string contents;  // file bytes
  int micro_batch = 1;
  int accum = 1;
  std::vector<std::string> expect;  // substrings of the message (the file's path is always expected)
};

std::string u16(std::initializer_list<std::uint16_t> ids) {
  std::string s;
  for (auto id : ids) s.append(reinterpret_cast<const char*>(&id), 2);
  return s;
}

std::string jsonl_line(int n, int first) {
  std::string s = "{\"input_ids\": [";
  for (int i = 0; i < n; ++i) s += (i ? ", " : "") + std::to_string(first + i);
  return s + "]}\n";
}

}  // namespace

TEST_F(FaultTest, DataErrorsStopBeforeTrainingWithExit2) {
  const std::vector<DataCase> cases{
      {"empty.jsonl", "tokenized", "", 1, 1, {"no examples (the file is empty)", "tools/tokenize_data.py"}},
      {"empty.bin", "tokens", "", 1, 1, {"is empty"}},
      {"bad_id.jsonl", "tokenized", jsonl_line(20, 1) + jsonl_line(20, 1) + "{\"input_ids\": [5, 256, 7]}\n", 1, 1,
       {"bad_id.jsonl:3", "token id 256 is outside the vocabulary [0, 256)", "tokenizer"}},
      {"bad_id.bin", "tokens", u16({1, 2, 300, 4}), 1, 1, {"token 300 at index 2", "vocab_size 256", "tokenized with another tokenizer"}},
      {"short.jsonl", "tokenized", jsonl_line(10, 1) + jsonl_line(10, 1), 4, 1,
       {"has 2 sequences", "one step needs 4", "Add data or lower micro_batch_size"}},
      {"short_accum.jsonl", "tokenized", jsonl_line(10, 1) + jsonl_line(10, 1) + jsonl_line(10, 1) + jsonl_line(10, 1), 2, 4,
       {"has 4 sequences", "one optimizer step needs 8", "gradient_accumulation_steps 4"}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const fs::path data = dir_ / c.name;
    std::ofstream(data, std::ios::binary) << c.contents;
    const fs::path out = dir_ / ("out_" + c.name);
    const fs::path config = dir_ / (c.name + ".yaml");
    std::ofstream(config) << "base_model: " << EO_SOURCE_DIR << "/fixtures/tiny-qwen3-moe\n"
                          << "load_in_4bit: true\nadapter: qlora\nlora_r: 4\nlora_alpha: 8\n"
                          << "lora_target_modules: [q_proj]\n"
                          << "datasets:\n  - path: " << data.string() << "\n    type: " << c.type << "\n"
                          << (c.type == "tokens" ? "    dtype: uint16\n" : "") << "sequence_len: 16\nsample_packing: false\n"
                          << "micro_batch_size: " << c.micro_batch << "\ngradient_accumulation_steps: " << c.accum << "\n"
                          << "max_steps: 2\noutput_dir: " << out.string() << "\n";
    const Outcome o = run({eo_ddp(), "--config", config.string()}, dir_ / (c.name + ".log"), {{}, -1, 60});
    ASSERT_FALSE(o.timed_out) << o.describe();
    EXPECT_TRUE(o.exited && o.code == 2) << "a data error is a usage error (exit 2): " << o.describe();
    EXPECT_TRUE(contains(o.log, data.string())) << "the message must name the file:\n" << o.log;
    for (const auto& e : c.expect) EXPECT_TRUE(contains(o.log, e)) << "expected '" << e << "' in\n" << o.log;
    EXPECT_FALSE(fs::exists(out / "metrics.jsonl")) << "training started";
    EXPECT_FALSE(contains(o.log, "loading ")) << "the data is checked before any weight is read:\n" << o.log;
  }
}

// Issue #32 item 5: in a mix, a dataset whose every label is -100 trains nothing and would hide
// behind the other one: exit 2 naming it, before any weight is read; a mix of two trainable
// datasets trains (the control).
TEST_F(FaultTest, ADatasetThatTrainsNothingInAMixIsRefused) {
  const fs::path good = dir_ / "good.jsonl", good2 = dir_ / "good2.jsonl", none = dir_ / "none.jsonl";
  {
    std::ofstream g(good), g2(good2), n(none);
    for (int i = 0; i < 4; ++i) g << jsonl_line(12, 3 + i);
    for (int i = 0; i < 4; ++i) g2 << jsonl_line(10, 20 + i);
    for (int i = 0; i < 4; ++i) n << "{\"input_ids\": [5, 6, 7, 8], \"labels\": [-100, -100, -100, -100]}\n";
  }
  auto config = [&](const std::string& name, const std::vector<fs::path>& data) {
    const fs::path c = dir_ / (name + ".yaml");
    std::ofstream f(c);
    f << "base_model: " << EO_SOURCE_DIR << "/fixtures/tiny-qwen3-moe\n"
      << "load_in_4bit: true\nadapter: qlora\nlora_r: 4\nlora_alpha: 8\nlora_target_modules: [q_proj]\ndatasets:\n";
    for (const auto& d : data) f << "  - path: " << d.string() << "\n    type: tokenized\n";
    f << "sequence_len: 16\nsample_packing: false\nmax_steps: 1\nsave_steps: 0\noutput_dir: " << (dir_ / ("out_" + name)).string() << "\n";
    return c.string();
  };
  const Outcome o = run({eo_ddp(), "--config", config("mix", {good, none})}, dir_ / "mix.log", {{}, -1, 60});
  ASSERT_FALSE(o.timed_out) << o.describe();
  EXPECT_TRUE(o.exited && o.code == 2) << o.describe();
  EXPECT_TRUE(contains(o.log, "dataset " + none.string() + " (type tokenized, one of 2 in datasets) has no trainable token")) << o.log;
  EXPECT_FALSE(contains(o.log, "dataset " + good.string() + " (type")) << o.log;
  EXPECT_FALSE(contains(o.log, "loading ")) << "the data is checked before any weight is read:\n" << o.log;
  const Outcome control = run({eo_ddp(), "--config", config("good", {good, good2})}, dir_ / "good.log", {{}, -1, 120});
  EXPECT_TRUE(control.exited && control.code == 0) << control.describe();
}

// Issue #15 item 7: a requeued run re-saves checkpoint-N; a kill between moving the old one aside
// and renaming the new one in (EO_DDP_FAULT_KILL_IN_REPLACE) must not lose it: the next start
// trusts the complete temporary folder, and `auto` resumes checkpoint-N.
TEST_F(FaultTest, KillWhileReplacingACheckpointLosesNothing) {
  const fs::path out = dir_ / "run";
  const Outcome first = train(out, {"max_steps=2", "save_steps=0"});
  ASSERT_TRUE(first.exited && first.code == 0) << first.describe();
  ASSERT_TRUE(fs::exists(out / "checkpoint-2" / "trainer_state.json"));
  const Outcome killed = train(out, {"max_steps=2", "save_steps=0", "resume_from_checkpoint=auto"},
                               RunOptions{{"EO_DDP_FAULT_KILL_IN_REPLACE=2"}});
  ASSERT_TRUE(!killed.timed_out && !killed.exited && killed.signal == SIGKILL) << killed.describe();
  EXPECT_FALSE(fs::exists(out / "checkpoint-2")) << "the kill was meant to hit between the two renames";
  const Outcome again = train(out, {"max_steps=2", "save_steps=0", "resume_from_checkpoint=auto"});
  ASSERT_TRUE(again.exited && again.code == 0) << again.describe();
  EXPECT_TRUE(contains(again.log, "checkpoint-2 at step 2")) << again.log;
  EXPECT_TRUE(fs::exists(out / "checkpoint-2" / "trainer_state.json"));
  EXPECT_TRUE(leftovers(out).empty()) << leftovers(out).front();
}

// Issue #15 item 4, end to end: a second fresh run in a finished run's output_dir is refused
// (exit 2, before loading) and leaves that run's checkpoints and metrics.jsonl as they were.
TEST_F(FaultTest, FreshRunInAnotherRunsOutputDirIsRefused) {
  const fs::path out = dir_ / "run";
  const Outcome first = train(out, {"max_steps=4", "save_steps=2", "save_total_limit=10"});
  ASSERT_TRUE(first.exited && first.code == 0) << first.describe();
  const auto before = folder_bytes(out);
  const Outcome second = train(out, {"max_steps=2", "save_steps=1"});
  EXPECT_TRUE(second.exited && second.code == 2) << second.describe();
  EXPECT_TRUE(contains(second.log, "output_dir " + out.string() + " holds checkpoints of another run")) << second.log;
  EXPECT_FALSE(contains(second.log, "loading ")) << "it loaded the model before refusing:\n" << second.log;
  auto after = folder_bytes(out);
  after.erase(".eo-ddp.lock");
  auto expected = before;
  expected.erase(".eo-ddp.lock");
  EXPECT_EQ(after, expected) << "the refused run changed the other run's files";
  // Issue #49 item 1: overwrite_output_dir moves the other run's checkpoints to other-runs/, byte for
  // byte; this run's saves at the same steps and its pruning never touch them.
  const auto ckpt2 = folder_bytes(out / "checkpoint-2"), ckpt4 = folder_bytes(out / "checkpoint-4");
  const Outcome over = train(out, {"max_steps=2", "save_steps=1", "save_total_limit=1", "overwrite_output_dir=true"});
  ASSERT_TRUE(over.exited && over.code == 0) << over.describe();
  EXPECT_TRUE(contains(over.log, "to " + out.string() + "/other-runs/")) << over.log;
  std::vector<fs::path> moved;
  for (const auto& e : fs::directory_iterator(out / "other-runs")) moved.push_back(e.path());
  std::sort(moved.begin(), moved.end());
  ASSERT_EQ(moved.size(), 2u) << "the other run's checkpoint-2 and checkpoint-4";
  EXPECT_EQ(folder_bytes(moved[0]), ckpt2) << moved[0];
  EXPECT_EQ(folder_bytes(moved[1]), ckpt4) << moved[1];
  EXPECT_NE(folder_bytes(out / "checkpoint-2"), ckpt2) << "checkpoint-2 is this run's own now";
}
