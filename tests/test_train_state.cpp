// output_dir ownership and checkpoint files (runtime/train_state.h, runtime/metrics.h,
// common/files.h), in process: run lineage and `auto`, foreign checkpoints, the output_dir lock,
// stray folder names, atomic replacement of a checkpoint, links under output_dir, writability,
// and the resume compatibility check. Expectations come from the scenarios (which
// checkpoint a run may resume or delete), never from values the code under test prints.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <ATen/ATen.h>

#include <csignal>
#include <filesystem>
#include <functional>
#include <fstream>
#include <string>

#include "common/error.h"
#include "common/files.h"
#include "runtime/config.h"
#include "runtime/metrics.h"
#include "runtime/train_state.h"
#include "tests/temp_dir_test.h"

namespace fs = std::filesystem;
using eo::RunClaim;
using eo::TrainConfig;
using eo::TrainingState;

namespace {

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

class TrainStateTest : public eo::testing::TempDirTest {
 protected:
  TrainStateTest() : TempDirTest("eo_train_state_") {}
  TrainConfig config(const std::string& resume = "") const {
    TrainConfig c;
    c.base_model = (dir_ / "model").string();
    c.adapter = "lora";
    c.output_dir = (dir_ / "out").string();
    c.resume_from_checkpoint = resume;
    return c;
  }
  void SetUp() override {
    TempDirTest::SetUp();
    fs::create_directories(dir_ / "model");
    std::ofstream(dir_ / "model" / "config.json") << "{\"model_type\": \"qwen3_moe\"}";
  }
  // A checkpoint whose data cursor carries `tag`, so tests can tell checkpoints of one step apart.
  std::string save(const TrainConfig& c, std::int64_t step, int keep = 100, const std::string& tag = "") const {
    TrainingState s;
    s.step = step;
    s.data_cursor = {{"tag", tag}};
    s.lora = {{"base_model.model.x.lora_A.weight", at::full({2, 2}, double(step))}};
    s.optimizer = {{"exp_avg", at::zeros({2})}};
    s.rng = {{"cpu", at::zeros({4}, at::kByte)}};
    return eo::save_checkpoint(c.output_dir, s, c, keep);
  }
  fs::path ckpt(int step) const { return dir_ / "out" / ("checkpoint-" + std::to_string(step)); }
};

std::string usage_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const eo::UsageError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

// Item 4: a fresh run in a folder with another run's checkpoints is refused, with the folder and
// the three ways out; with overwrite_output_dir it runs but never prunes the other run's ones.
TEST_F(TrainStateTest, ForeignCheckpointsRefuseAFreshRunAndAreNeverPruned) {
  {
    RunClaim a = eo::claim_output_dir(config());
    save(config(), 5);
    save(config(), 10);
  }
  const std::string msg = usage_error([&] { eo::claim_output_dir(config()); });
  ASSERT_FALSE(msg.empty()) << "a fresh run was allowed beside another run's checkpoints";
  EXPECT_TRUE(contains(msg, (dir_ / "out").string())) << msg;
  EXPECT_TRUE(contains(msg, "checkpoint-5") && contains(msg, "checkpoint-10")) << msg;
  EXPECT_TRUE(contains(msg, "resume_from_checkpoint: auto") && contains(msg, "another output_dir") &&
              contains(msg, "overwrite_output_dir: true"))
      << msg;

  TrainConfig over = config();
  over.overwrite_output_dir = true;
  RunClaim b = eo::claim_output_dir(over);
  EXPECT_TRUE(b.resume.empty());
  for (int s : {2, 4, 6}) save(over, s, /*keep=*/2);
  EXPECT_TRUE(fs::exists(ckpt(5)) && fs::exists(ckpt(10))) << "the other run's checkpoints were deleted";
  EXPECT_FALSE(fs::exists(ckpt(2))) << "keep=2 of this run's checkpoints: checkpoint-2 goes";
  EXPECT_TRUE(fs::exists(ckpt(4)) && fs::exists(ckpt(6))) << "this run's newest were pruned (the old run's rank newer)";
  EXPECT_EQ(eo::latest_checkpoint(over.output_dir), ckpt(6).string()) << "auto must not pick the other run's checkpoint-10";
}

// Item 4: after an explicit resume from checkpoint-2 and a crash, auto takes the new branch's
// checkpoint-4, not the abandoned checkpoint-6 (which is left on disk).
TEST_F(TrainStateTest, AutoFollowsTheLineageBeingResumed) {
  {
    RunClaim a = eo::claim_output_dir(config());
    for (int s : {2, 4, 6}) save(config(), s, 100, "first");
  }
  {
    RunClaim b = eo::claim_output_dir(config(ckpt(2).string()));
    EXPECT_EQ(b.resume, ckpt(2).string());
    save(config(), 4, 100, "second");  // then the run crashes
  }
  RunClaim c = eo::claim_output_dir(config("auto"));
  EXPECT_EQ(c.resume, ckpt(4).string()) << "auto picked the abandoned branch";
  EXPECT_EQ(eo::load_checkpoint(c.resume, false).data_cursor["tag"], "second");
  EXPECT_TRUE(fs::exists(ckpt(6))) << "a checkpoint of the run was deleted by the resume";
}

// Item 13 with item 4: a resume refused by the compatibility check leaves the lineage alone, so
// `auto` still continues where the run was (checkpoint-6), and the refusal names the key.
TEST_F(TrainStateTest, RefusedResumeDoesNotMoveTheLineage) {
  {
    RunClaim a = eo::claim_output_dir(config());
    for (int s : {2, 4, 6}) save(config(), s);
  }
  TrainConfig changed = config(ckpt(2).string());
  changed.lora_r = 16;
  const std::string msg = usage_error([&] { eo::claim_output_dir(changed); });
  EXPECT_TRUE(contains(msg, "lora_r: the checkpoint has 8, this config 16")) << msg;
  RunClaim b = eo::claim_output_dir(config("auto"));
  EXPECT_EQ(b.resume, ckpt(6).string());
}

// Item 5: a second run on a locked output_dir is refused naming the holder.
TEST_F(TrainStateTest, SecondRunOnALockedOutputDirIsRefused) {
  RunClaim a = eo::claim_output_dir(config());
  const std::string msg = usage_error([&] { eo::claim_output_dir(config()); });
  ASSERT_FALSE(msg.empty()) << "two runs took the same output_dir";
  EXPECT_TRUE(contains(msg, "pid " + std::to_string(::getpid()))) << msg;
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  EXPECT_TRUE(contains(msg, host)) << msg;
  a.lock.reset();  // the first run ends
  TrainConfig again = config();
  EXPECT_NO_THROW(eo::claim_output_dir(again));
}

// Item 6: a folder name that does not parse as a step is ignored, never `stoll`.
TEST_F(TrainStateTest, UnparsableCheckpointNamesAreIgnored) {
  RunClaim a = eo::claim_output_dir(config());
  fs::create_directories(dir_ / "out" / "checkpoint-99999999999999999999");
  fs::create_directories(dir_ / "out" / "checkpoint-12abc");
  EXPECT_NO_THROW(save(config(), 3, 1));
  EXPECT_EQ(eo::latest_checkpoint(config().output_dir), ckpt(3).string());
  EXPECT_TRUE(fs::exists(dir_ / "out" / "checkpoint-99999999999999999999")) << "a folder eo-ddp did not write was removed";
}

// Item 7: re-saving a step replaces it whole; a crash between moving the old one aside and
// renaming the new one in is recovered from the complete temporary folder (or the old one).
TEST_F(TrainStateTest, ReplacingACheckpointIsAtomic) {
  {
    RunClaim a = eo::claim_output_dir(config());
    save(config(), 4, 100, "old");
    save(config(), 4, 100, "new");
    EXPECT_EQ(eo::load_checkpoint(ckpt(4).string(), false).data_cursor["tag"], "new");
    for (const auto& e : fs::directory_iterator(dir_ / "out"))
      EXPECT_NE(e.path().filename().string()[0] == '.' && e.is_directory(), true) << "left behind: " << e.path();
  }
  // The state a kill between the two renames leaves: old aside, complete new temporary, no checkpoint-4.
  const fs::path out = dir_ / "out";
  fs::copy(ckpt(4), out / ".tmp-checkpoint-4-999", fs::copy_options::recursive);
  fs::rename(ckpt(4), out / ".old-checkpoint-4-999");
  {
    RunClaim b = eo::claim_output_dir(config("auto"));
    EXPECT_EQ(b.resume, ckpt(4).string()) << "the complete temporary folder was not trusted";
  }
  EXPECT_FALSE(fs::exists(out / ".old-checkpoint-4-999"));
  // A kill before the new one was complete: the old one comes back.
  fs::rename(ckpt(4), out / ".old-checkpoint-4-998");
  fs::create_directories(out / ".tmp-checkpoint-4-998");  // no trainer_state.json: incomplete
  RunClaim c = eo::claim_output_dir(config("auto"));
  EXPECT_EQ(c.resume, ckpt(4).string());
  EXPECT_FALSE(fs::exists(out / ".tmp-checkpoint-4-998")) << "an incomplete temporary folder is never trusted";
}

// Item 8: metrics.jsonl that is a link is refused and its target left alone.
TEST_F(TrainStateTest, MetricsThroughASymlinkIsRefused) {
  fs::create_directories(dir_ / "out");
  std::ofstream(dir_ / "victim") << "precious\n";
  fs::create_symlink(dir_ / "victim", dir_ / "out" / "metrics.jsonl");
  for (std::int64_t resumed : {0, 3}) {
    try {
      eo::MetricsLog log((dir_ / "out").string(), resumed);
      ADD_FAILURE() << "metrics.jsonl was opened through a link";
    } catch (const eo::Error& e) {
      EXPECT_TRUE(contains(e.what(), "symbolic link")) << e.what();
    }
  }
  EXPECT_EQ(read_text(dir_ / "victim"), "precious\n");
}

// Item 8 / 19: the atomic writer replaces a link at the target instead of writing through it.
TEST_F(TrainStateTest, AtomicWriteReplacesALinkInsteadOfFollowingIt) {
  std::ofstream(dir_ / "victim") << "precious\n";
  fs::create_symlink(dir_ / "victim", dir_ / "file.json");
  eo::write_file_atomic((dir_ / "file.json").string(), "new\n");
  EXPECT_EQ(read_text(dir_ / "victim"), "precious\n");
  EXPECT_FALSE(fs::is_symlink(dir_ / "file.json"));
  EXPECT_EQ(read_text(dir_ / "file.json"), "new\n");
}

// Item 9: an output_dir that cannot be written is a usage error before anything is loaded.
TEST_F(TrainStateTest, UnwritableOutputDirIsAUsageError) {
  std::ofstream(dir_ / "plain-file") << "x";
  for (const std::string bad : {(dir_ / "plain-file" / "out").string(), std::string("/sys/eo-ddp-test-out"),
                                std::string("/proc/eo-ddp-test-out")}) {
    const std::string msg = usage_error([&] { eo::check_output_dir_writable(bad); });
    EXPECT_TRUE(contains(msg, bad) && contains(msg, "output_dir")) << bad << ": " << msg;
  }
  EXPECT_NO_THROW(eo::check_output_dir_writable((dir_ / "new" / "deeper").string()));
  EXPECT_FALSE(fs::exists(dir_ / "new")) << "the check created the folder";
}

// Item 13: what the checkpoint recorded is compared key by key.
TEST_F(TrainStateTest, ResumeCompatibilityIsCheckedByKey) {
  const auto write_weights = [](const fs::path& dir, char fill) {
    fs::create_directories(dir);
    std::ofstream(dir / "config.json") << "{\"model_type\": \"qwen3_moe\"}";
    std::ofstream(dir / "model.safetensors", std::ios::binary) << std::string(100000, fill);
  };
  write_weights(dir_ / "model", 'a');
  write_weights(dir_ / "copy", 'a');
  write_weights(dir_ / "finetune", 'b');
  TrainingState s;
  s.step = 7;
  s.recorded = eo::recorded_config(config());

  EXPECT_TRUE(eo::check_resume_compatible(s, config()).empty());
  TrainConfig c = config();
  c.lora_alpha = 32;
  c.sequence_len = 512;
  c.lora_target_modules = {"q_proj"};
  std::string msg = usage_error([&] { eo::check_resume_compatible(s, c); });
  EXPECT_TRUE(contains(msg, "lora_alpha") && contains(msg, "sequence_len") && contains(msg, "lora_target_modules")) << msg;
  EXPECT_FALSE(contains(msg, "lora_r:")) << msg;

  c = config();
  c.base_model = (dir_ / "finetune").string();
  msg = usage_error([&] { eo::check_resume_compatible(s, c); });
  EXPECT_TRUE(contains(msg, "base_model")) << "another model of the same shapes was accepted: " << msg;

  c = config();
  c.base_model = (dir_ / "copy").string();
  c.learning_rate = 1e-3;
  const auto warnings = eo::check_resume_compatible(s, c);
  ASSERT_EQ(warnings.size(), 2u);
  EXPECT_TRUE(contains(warnings[0] + warnings[1], "base_model moved")) << warnings[0];
  EXPECT_TRUE(contains(warnings[0] + warnings[1], "learning_rate")) << warnings[1];

  TrainingState old;  // a checkpoint of an eo-ddp that recorded nothing
  EXPECT_EQ(eo::check_resume_compatible(old, config()).size(), 1u);
}
