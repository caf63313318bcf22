// Fault injection with data parallelism (2 CPU ranks under mpirun): a NaN on one rank only must
// make every rank skip the same step (no rank updates its LoRA, so they stay identical), and a
// rank whose steps are all non-finite must stop the whole job at max_nonfinite_steps.
// Single-rank fault cases: tests/test_faults.cpp.
#include <gtest/gtest.h>

#include "fault_support.h"
#include "runtime/train_state.h"

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
