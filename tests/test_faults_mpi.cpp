// Fault injection with data parallelism (2 CPU ranks under mpirun): a NaN on one rank only must
// make every rank skip the same step (no rank updates its LoRA, so they stay identical), and a
// rank whose steps are all non-finite must stop the whole job at max_nonfinite_steps.
// Single-rank fault cases: tests/test_faults.cpp.
#include <gtest/gtest.h>

#include "fault_support.h"
#include "runtime/config.h"
#include "runtime/train_state.h"
#include "tests/test_paths.h"

#include <csignal>

using namespace eo::faults;

namespace {

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// mpirun -np 2 eo-ddp ..., the EO_DDP_FAULT* variables exported to the ranks.
Outcome mpi_train(const fs::path& out, const std::vector<std::string>& sets, const std::vector<std::string>& env, double timeout_s) {
  std::vector<std::string> argv{EO_MPIEXEC, "-np", "2", "--oversubscribe", "--bind-to", "none"};
  for (const auto& kv : env) {
    argv.push_back("-x");
    argv.push_back(kv.substr(0, kv.find('=')));
  }
  argv.push_back("-x");
  argv.push_back("OMP_NUM_THREADS");
  argv.push_back(eo_ddp());
  for (auto& a : train_args(out, sets)) argv.push_back(a);
  RunOptions ro;
  ro.env = env;
  ro.timeout_s = timeout_s;
  return run(argv, out.string() + ".log", ro);
}

}  // namespace

TEST_F(FaultTest, NanOnOneRankIsSkippedOnEveryRank) {
  const fs::path out = dir_ / "run";
  const Outcome o = mpi_train(out, {"max_steps=5", "save_steps=1", "save_total_limit=10", "micro_batch_size=2"},
                              {"EO_DDP_FAULT=nan", "EO_DDP_FAULT_STEP=3", "EO_DDP_FAULT_RANK=1"}, 300);
  ASSERT_TRUE(o.exited && o.code == 0) << o.describe();
  EXPECT_TRUE(contains(o.log, "(non-finite loss on 1 of 2 rank(s)); skipped without an optimizer update")) << o.log;
  EXPECT_TRUE(contains(o.log, "LoRA identical on all 2 ranks")) << "the ranks diverged:\n" << o.log;
  const auto m = read_metrics(out);
  ASSERT_EQ(m.size(), 5u);
  for (std::int64_t s = 1; s <= 5; ++s)
    EXPECT_EQ(m.at(s).at("skipped_nonfinite").get<int>(), s >= 3 ? 1 : 0) << m.at(s).dump();
  EXPECT_TRUE(m.at(3).at("loss").is_null()) << "the reported (all-reduced) loss of step 3 includes rank 1's NaN";
  EXPECT_TRUE(m.at(4).at("loss").is_number());
  const auto c2 = folder_bytes(out / "checkpoint-2"), c3 = folder_bytes(out / "checkpoint-3"), c4 = folder_bytes(out / "checkpoint-4");
  EXPECT_EQ(c3.at("adapter_model.safetensors"), c2.at("adapter_model.safetensors")) << "the skipped step changed the LoRA";
  EXPECT_EQ(c3.at("optimizer.safetensors"), c2.at("optimizer.safetensors")) << "the skipped step changed the optimizer state";
  EXPECT_NE(c4.at("adapter_model.safetensors"), c3.at("adapter_model.safetensors")) << "training did not continue after the skip";
}

TEST_F(FaultTest, NonFiniteStepsOnOneRankStopEveryRank) {
  const fs::path out = dir_ / "run";
  const Outcome o = mpi_train(out, {"max_steps=50", "save_steps=0", "micro_batch_size=2", "max_nonfinite_steps=2"},
                              {"EO_DDP_FAULT=nan", "EO_DDP_FAULT_STEP=all", "EO_DDP_FAULT_RANK=1"}, 120);
  ASSERT_FALSE(o.timed_out) << "the job did not end by itself: " << o.describe();
  EXPECT_FALSE(o.exited && o.code == 0) << o.describe();
  EXPECT_LT(o.seconds, 100) << o.describe();
  EXPECT_TRUE(contains(o.log, "the loss or gradients were NaN/Inf for 2 consecutive steps (1 to 2, max_nonfinite_steps: 2)")) << o.log;
  EXPECT_EQ(read_metrics(out).size(), 2u);
  EXPECT_FALSE(fs::exists(out / "adapter_model.safetensors"));
}

// Issue #15 item 1: a usage error on one rank only (MPMD: rank 1 gets a bad --set) ends every rank
// within seconds, with the cause, the rank and exit 2 -- not a hang in MPI_Finalize or a broadcast.
TEST_F(FaultTest, UsageErrorOnOneRankEndsTheJobWithExit2) {
  const fs::path out = dir_ / "run";
  std::vector<std::string> argv{EO_MPIEXEC, "--oversubscribe", "--bind-to", "none", "-np", "1", eo_ddp()};
  for (auto& a : train_args(out, {"max_steps=50"})) argv.push_back(a);
  for (const char* a : {":", "-np", "1"}) argv.push_back(a);
  argv.push_back(eo_ddp());
  for (auto& a : train_args(out, {"max_steps=50", "lora_r=abc"})) argv.push_back(a);
  RunOptions ro;
  ro.timeout_s = 120;
  const Outcome o = run(argv, out.string() + ".log", ro);
  ASSERT_FALSE(o.timed_out) << o.describe();
  EXPECT_TRUE(o.exited && o.code == 2) << o.describe();
  EXPECT_LT(o.seconds, 30) << o.describe();
  EXPECT_TRUE(contains(o.log, "[rank 1] error: config configs/tiny-qwen3-moe.yaml has 1 problem")) << o.log;
  EXPECT_TRUE(contains(o.log, "lora_r: expected an integer, got 'abc'")) << o.log;
}

// Items 1 and 5: rank 0 alone fails (output_dir locked by another run) while rank 1 waits for it
// in a broadcast: the job ends at once with exit 2 and the holder named.
TEST_F(FaultTest, LockedOutputDirOnRankZeroEndsTheJobWithExit2) {
  const fs::path out = dir_ / "run";
  eo::TrainConfig held;
  held.output_dir = out.string();
  const eo::RunClaim holder = eo::claim_output_dir(held);
  const Outcome o = mpi_train(out, {"max_steps=5"}, {}, 120);
  ASSERT_FALSE(o.timed_out) << o.describe();
  EXPECT_TRUE(o.exited && o.code == 2) << o.describe();
  EXPECT_LT(o.seconds, 30) << o.describe();
  EXPECT_TRUE(contains(o.log, "is in use by another eo-ddp run (pid " + std::to_string(::getpid()))) << o.log;
}

// Issue #15 item 3: SIGTERM to the launcher saves a checkpoint and the job exits 3. Plain mpirun
// exits 1 on SIGTERM whatever the ranks do (it records 1 before forwarding), so the documented
// launcher is launch/eo-mpirun, which hands mpirun SIGUSR1 instead (forwarded to every rank).
TEST_F(FaultTest, SigtermToTheLauncherSavesAndExits3) {
  const fs::path out = dir_ / "run";
  std::vector<std::string> argv{std::string(EO_SOURCE_DIR) + "/launch/eo-mpirun", "-np", "2", "--oversubscribe", "--bind-to",
                                "none", "-x", "OMP_NUM_THREADS", eo_ddp()};
  for (auto& a : train_args(out, {"max_steps=400", "save_steps=0", "lr_scheduler=constant"})) argv.push_back(a);
  RunOptions ro;
  ro.env = {std::string("MPIRUN=") + EO_MPIEXEC};
  const Child child = spawn(argv, out.string() + ".log", ro);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(180);
  while (read_metrics(out).size() < 3 && std::chrono::steady_clock::now() < deadline) {
    int status = 0;
    ASSERT_EQ(waitpid(child.pid, &status, WNOHANG), 0) << "the job ended before it was signalled:\n" << read_text(child.log);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  kill(child.pid, SIGTERM);
  const Outcome o = wait_for(child, 120);
  ASSERT_FALSE(o.timed_out) << o.describe();
  EXPECT_TRUE(o.exited && o.code == 3) << o.describe();
  const auto saved = eo::latest_checkpoint(out.string());
  ASSERT_TRUE(saved.has_value()) << "no checkpoint after SIGTERM\n" << o.log;
  EXPECT_GE(eo::load_checkpoint(*saved, false).step, 3);
}
