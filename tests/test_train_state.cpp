// output_dir ownership and checkpoint files (runtime/train_state.h, runtime/metrics.h,
// common/files.h), in process: run lineage and `auto`, foreign checkpoints, the output_dir lock,
// stray folder names, atomic replacement of a checkpoint, links under output_dir, writability,
// the resume compatibility check, checkpoint checksums and NaN/Inf refusal. Expectations come from the scenarios (which
// checkpoint a run may resume or delete), never from values the code under test prints.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <ATen/ATen.h>

#include <csignal>
#include <filesystem>
#include <functional>
#include <limits>
#include <fstream>
#include <string>
#include <thread>
#include <algorithm>
#include <chrono>

#include "common/error.h"
#include "common/files.h"
#include "models/lora.h"
#include "models/safetensors.h"
#include "runtime/adapter_files.h"
#include "runtime/config.h"
#include "runtime/metrics.h"
#include "runtime/model_identity.h"
#include "runtime/resume_check.h"
#include "runtime/runspec.h"
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
  // The folders under out/other-runs/, by name.
  std::vector<fs::path> other_runs() const {
    std::vector<fs::path> out;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(dir_ / "out" / "other-runs", ec)) out.push_back(e.path());
    std::sort(out.begin(), out.end());
    return out;
  }
  std::string tag_of(const fs::path& checkpoint) const {
    return eo::load_checkpoint(checkpoint.string(), false).data_cursor.value("tag", std::string());
  }
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
  EXPECT_FALSE(fs::exists(ckpt(5)) || fs::exists(ckpt(10))) << "overwrite_output_dir moves the other run's away";
  EXPECT_EQ(other_runs().size(), 2u) << "the other run's checkpoints were deleted";
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

// adapter_config.json has one writer, atomic whichever path writes it: the final adapter and
// checkpoints (write_adapter) and MoeModel::save_adapter (model::write_adapter_config) write the
// same keys, peft's LoraConfig fields, and replace a link in the file's place instead of writing
// through it.
TEST_F(TrainStateTest, AdapterConfigHasOneAtomicWriter) {
  TrainConfig c = config();
  c.lora_r = 4;
  c.lora_alpha = 8;
  c.lora_target_modules = {"q_proj", "v_proj"};
  const fs::path a = dir_ / "final", b = dir_ / "saved";
  for (const fs::path& d : {a, b}) {
    fs::create_directories(d);
    std::ofstream(dir_ / (d.filename().string() + ".victim")) << "precious\n";
    fs::create_symlink(dir_ / (d.filename().string() + ".victim"), d / "adapter_config.json");
  }
  eo::write_adapter(a.string(), {{"base_model.model.x.q_proj.lora_A.weight", at::ones({4, 2})}}, eo::adapter_record(c));
  eo::model::write_adapter_config(b.string(), eo::lora_spec(c), c.base_model);
  for (const fs::path& d : {a, b}) {
    EXPECT_EQ(read_text(dir_ / (d.filename().string() + ".victim")), "precious\n") << d;
    EXPECT_FALSE(fs::is_symlink(d / "adapter_config.json")) << d;
    for (const auto& e : fs::directory_iterator(d))
      EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << "a temporary was left: " << e.path();
  }
  const std::string text = read_text(a / "adapter_config.json");
  EXPECT_EQ(read_text(b / "adapter_config.json"), text);
  const auto j = nlohmann::json::parse(text);
  EXPECT_EQ(j.at("peft_type"), "LORA");
  EXPECT_EQ(j.at("task_type"), "CAUSAL_LM");
  EXPECT_EQ(j.at("r"), 4);
  EXPECT_EQ(j.at("lora_alpha"), 8.0);
  EXPECT_EQ(j.at("lora_dropout"), 0.0);
  EXPECT_EQ(j.at("target_modules"), nlohmann::json::array({"q_proj", "v_proj"}));
  EXPECT_FALSE(j.contains("target_parameters"));
  EXPECT_EQ(j.at("bias"), "none");
  EXPECT_EQ(j.at("use_rslora"), false);
  EXPECT_EQ(j.at("fan_in_fan_out"), false);
  EXPECT_EQ(j.at("base_model_name_or_path"), c.base_model);
  EXPECT_EQ(j.at("inference_mode"), true);
  EXPECT_EQ(j.at("init_lora_weights"), true);
  EXPECT_TRUE(j.at("modules_to_save").is_null());
  const eo::model::LoraSpec back = eo::model::read_adapter_config(a.string());
  EXPECT_EQ(back.r, 4);
  EXPECT_EQ(back.alpha, 8.0);
  EXPECT_EQ(back.targets, c.lora_target_modules);
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

// Issue #32 item 6: a checkpoint carries checksums of every file in it. A changed byte anywhere is
// detected: every byte of each file's first and last 1 KiB (headers, JSON, the checksum list) and every
// 7th byte between (each check re-reads the whole checkpoint, so all bytes of the tensor files would
// cost minutes for no new coverage: the checksum reads every byte alike). `auto` then takes the
// previous intact checkpoint, and an explicit resume of the damaged one is refused naming the file.
TEST_F(TrainStateTest, AChangedByteAnywhereInACheckpointIsDetectedAndAutoFallsBack) {
  {
    RunClaim a = eo::claim_output_dir(config());
    save(config(), 2);
    save(config(), 4);
  }
  ASSERT_EQ(eo::checkpoint_damage(ckpt(4).string()), "");
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(ckpt(4))) files.push_back(e.path());
  ASSERT_GE(files.size(), 7u) << "adapter (3 files), optimizer, rng, trainer_state.json, checksums.txt";
  std::size_t flips = 0;
  for (const auto& f : files) {
    const std::string good = read_text(f);
    bool fell_back_checked = false;
    for (std::size_t i = 0; i < good.size(); i += (i < 1024 || i + 1024 >= good.size()) ? 1 : 7) {
      std::string bad = good;
      bad[i] = static_cast<char>(bad[i] ^ 0x01);
      std::ofstream(f, std::ios::binary | std::ios::trunc) << bad;
      ASSERT_NE(eo::checkpoint_damage(ckpt(4).string()), "") << "byte " << i << " of " << f << " changed unnoticed";
      ++flips;
      if (!fell_back_checked && i >= good.size() / 2) {
        fell_back_checked = true;
        EXPECT_EQ(eo::latest_checkpoint(config().output_dir), ckpt(2).string()) << "auto took the damaged " << f;
        const std::string msg = usage_error([&] { eo::load_checkpoint(ckpt(4).string(), false); });
        EXPECT_TRUE(contains(msg, "is damaged") && contains(msg, f.filename().string()) && contains(msg, "resume_from_checkpoint: auto"))
            << msg;
      }
    }
    std::ofstream(f, std::ios::binary | std::ios::trunc) << good;
  }
  EXPECT_GT(flips, 1000u);
  EXPECT_EQ(eo::checkpoint_damage(ckpt(4).string()), "");
  // A missing file, or a file appended to, is damage too.
  const fs::path opt = ckpt(4) / "optimizer.safetensors";
  const std::string opt_bytes = read_text(opt);
  std::ofstream(opt, std::ios::app) << "x";
  EXPECT_TRUE(contains(eo::checkpoint_damage(ckpt(4).string()), "optimizer.safetensors changed after it was saved"));
  fs::remove(opt);
  EXPECT_TRUE(contains(eo::checkpoint_damage(ckpt(4).string()), "optimizer.safetensors is missing"));
  // End to end through the claim: auto resumes checkpoint-2.
  RunClaim b = eo::claim_output_dir(config("auto"));
  EXPECT_EQ(b.resume, ckpt(2).string());
  b.lock.reset();
  std::ofstream(opt, std::ios::binary) << opt_bytes;
}

// Item 6: a checkpoint of an older eo-ddp (no checksums.txt, format 1) still loads; one whose
// tensors hold NaN is refused on load, and no checkpoint or adapter is ever saved with NaN/Inf.
TEST_F(TrainStateTest, NonFiniteValuesAreNeverSavedAndRefusedOnLoad) {
  RunClaim a = eo::claim_output_dir(config());
  TrainingState s;
  s.step = 3;
  s.data_cursor = {{"tag", ""}};
  s.lora = {{"base_model.model.x.lora_A.weight", at::ones({2, 2})}};
  s.optimizer = {{"exp_avg", at::zeros({2})}};
  s.rng = {{"cpu", at::zeros({4}, at::kByte)}};
  TrainingState bad = s;
  bad.optimizer = {{"exp_avg", at::tensor({0.0f, std::numeric_limits<float>::quiet_NaN()})}};
  EXPECT_THROW(eo::save_checkpoint(config().output_dir, bad, config(), 10), eo::Error);
  EXPECT_FALSE(fs::exists(ckpt(3)));
  TrainingState inf = s;
  inf.lora = {{"base_model.model.x.lora_A.weight", at::full({2, 2}, std::numeric_limits<float>::infinity())}};
  EXPECT_THROW(eo::write_adapter((dir_ / "final").string(), inf.lora, eo::adapter_record(config())), eo::Error);
  EXPECT_FALSE(fs::exists(dir_ / "final" / "adapter_model.safetensors"));

  // An older checkpoint: no checksums, format 1; then NaN in its optimizer state.
  eo::save_checkpoint(config().output_dir, s, config(), 10);
  fs::remove(ckpt(3) / "checksums.txt");
  auto state = nlohmann::json::parse(read_text(ckpt(3) / "trainer_state.json"));
  state["format"] = "eo-ddp-checkpoint-1";
  std::ofstream(ckpt(3) / "trainer_state.json", std::ios::trunc) << state.dump(2);
  EXPECT_EQ(eo::checkpoint_damage(ckpt(3).string()), "");
  EXPECT_EQ(eo::load_checkpoint(ckpt(3).string()).step, 3);
  eo::st::save((ckpt(3) / "optimizer.safetensors").string(), bad.optimizer);
  try {
    eo::load_checkpoint(ckpt(3).string());
    ADD_FAILURE() << "a checkpoint with NaN in its optimizer state was loaded";
  } catch (const eo::Error& e) {
    EXPECT_TRUE(contains(e.what(), "exp_avg holds NaN/Inf")) << e.what();
  }
  // Format 2 without its checksum file is damaged, not an older checkpoint.
  state["format"] = "eo-ddp-checkpoint-2";
  std::ofstream(ckpt(3) / "trainer_state.json", std::ios::trunc) << state.dump(2);
  EXPECT_TRUE(contains(eo::checkpoint_damage(ckpt(3).string()), "checksums.txt is missing"));
}

// Item 6: with save_total_limit 1, the newest checkpoint from before the run's first non-finite
// step is kept (keep_newest_before), the others pruned as usual.
TEST_F(TrainStateTest, TheLastCheckpointBeforeANonFiniteStepIsNeverPruned) {
  RunClaim a = eo::claim_output_dir(config());
  save(config(), 1, 1);
  save(config(), 2, 1);
  EXPECT_FALSE(fs::exists(ckpt(1)));
  TrainingState s;
  s.data_cursor = {{"tag", ""}};
  s.lora = {{"base_model.model.x.lora_A.weight", at::zeros({2, 2})}};
  s.rng = {{"cpu", at::zeros({4}, at::kByte)}};
  for (int step : {3, 4, 5}) {
    s.step = step;
    eo::save_checkpoint(config().output_dir, s, config(), 1, /*keep_newest_before=*/3);
  }
  EXPECT_TRUE(fs::exists(ckpt(2))) << "the last checkpoint before step 3 was pruned";
  EXPECT_FALSE(fs::exists(ckpt(3)) || fs::exists(ckpt(4)));
  EXPECT_TRUE(fs::exists(ckpt(5)));
}

// Issue #32 item 4: the base model's identity covers every byte of its weights. One byte changed
// where the sampled fingerprint of earlier versions never looked (16 windows of 4 KiB, computed
// here as that code did) gives another identity, and a resume is refused; so does a change
// whose modification time is set back (the cache is keyed by ctime too). A copy elsewhere is equal.
TEST_F(TrainStateTest, BaseModelIdentityCoversEveryByteOfTheWeights) {
  ::setenv("XDG_CACHE_HOME", (dir_ / "cache").c_str(), 1);
  const std::size_t size = 200000;
  std::string weights(size, '\0');
  for (std::size_t i = 0; i < size; ++i) weights[i] = static_cast<char>(i * 7 % 251);
  std::ofstream(dir_ / "model" / "model.safetensors", std::ios::binary) << weights;
  std::this_thread::sleep_for(std::chrono::milliseconds(150));  // past the window in which a hash is not cached
  const TrainConfig c = config();
  const std::string before = eo::base_model_identity(c);
  EXPECT_EQ(eo::base_model_identity(c), before);
  EXPECT_TRUE(fs::exists(dir_ / "cache" / "eo-ddp" / "file-hashes.json")) << "the content hash was not cached";

  fs::create_directories(dir_ / "copy");
  fs::copy_file(dir_ / "model" / "config.json", dir_ / "copy" / "config.json");
  fs::copy_file(dir_ / "model" / "model.safetensors", dir_ / "copy" / "model.safetensors");
  TrainConfig copy = config();
  copy.base_model = (dir_ / "copy").string();
  EXPECT_EQ(eo::base_model_identity(copy), before) << "a copy in another folder must be the same base model";

  // A byte outside every old sampling window.
  std::size_t pos = size;
  for (std::size_t p = 4096; p < size && pos == size; ++p) {
    bool sampled = false;
    for (int w = 0; w < 16; ++w) {
      const std::size_t off = (size - 4096) / 15 * w;
      sampled = sampled || (p >= off && p < off + 4096);
    }
    if (!sampled) pos = p;
  }
  ASSERT_LT(pos, size);
  TrainingState s;
  s.step = 7;
  s.recorded = eo::recorded_config(config());
  const auto old_mtime = fs::last_write_time(dir_ / "model" / "model.safetensors");
  std::string changed = weights;
  changed[pos] = static_cast<char>(changed[pos] ^ 0x80);
  {
    std::fstream f(dir_ / "model" / "model.safetensors", std::ios::binary | std::ios::in | std::ios::out);
    f.seekp(static_cast<std::streamoff>(pos));
    f.put(changed[pos]);
  }
  fs::last_write_time(dir_ / "model" / "model.safetensors", old_mtime);  // same size, same mtime
  EXPECT_NE(eo::base_model_identity(c), before) << "byte " << pos << " changed unnoticed";
  const std::string msg = usage_error([&] { eo::check_resume_compatible(s, c); });
  EXPECT_TRUE(contains(msg, "base_model") && contains(msg, "other contents")) << msg;
}

// Issue #32 item 5: a dataset edited in place since the checkpoint (same path) is noticed on
// resume with a warning; an unchanged one gives none.
TEST_F(TrainStateTest, ADatasetEditedInPlaceIsNoticedOnResume) {
  ::setenv("XDG_CACHE_HOME", (dir_ / "cache").c_str(), 1);
  const fs::path data = dir_ / "train.jsonl";
  std::ofstream(data) << "{\"input_ids\": [1, 2, 3]}\n";
  TrainConfig c = config();
  eo::DatasetSpec d;
  d.path = data.string();
  d.type = "tokenized";
  c.datasets = {d};
  TrainingState s;
  s.step = 3;
  s.recorded = eo::recorded_config(c);
  EXPECT_TRUE(eo::check_resume_compatible(s, c).empty());
  std::ofstream(data, std::ios::trunc) << "{\"input_ids\": [1, 2, 4]}\n";  // same size
  const auto warnings = eo::check_resume_compatible(s, c);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_TRUE(contains(warnings[0], "a dataset was edited since the checkpoint")) << warnings[0];
}

// Issue #32 item 9: the lock is held on output_dir itself, so deleting .eo-ddp.lock during a run
// lets no second run in; the lock file says what it is.
TEST_F(TrainStateTest, DeletingTheLockFileLetsNoSecondRunIn) {
  RunClaim a = eo::claim_output_dir(config());
  const std::string text = read_text(dir_ / "out" / ".eo-ddp.lock");
  EXPECT_TRUE(contains(text, "eo-ddp run lock: held by pid " + std::to_string(::getpid()))) << text;
  EXPECT_TRUE(contains(text, "no other eo-ddp run may use this folder")) << text;
  fs::remove(dir_ / "out" / ".eo-ddp.lock");
  const std::string msg = usage_error([&] { eo::claim_output_dir(config()); });
  EXPECT_TRUE(contains(msg, "is in use by another eo-ddp run")) << "a second run started after the lock file was deleted";
  EXPECT_NO_THROW(save(config(), 2)) << "the first run can still save";
  a.lock.reset();
  EXPECT_NO_THROW(eo::claim_output_dir(config("auto")));
}

// Issue #32 item 11: a run started with overwrite_output_dir beside another run's checkpoints
// resumes with `auto` (the folder is its own by run.json); a run.json that names no checkpoint's
// run is refused with advice other than the `auto` that was given.
TEST_F(TrainStateTest, AutoResumesARunStartedWithOverwriteAndATamperedRunFileGetsOtherAdvice) {
  {
    RunClaim a = eo::claim_output_dir(config());
    save(config(), 2);
  }
  TrainConfig over = config();
  over.overwrite_output_dir = true;
  {
    RunClaim b = eo::claim_output_dir(over);
    save(over, 6);  // then the run crashes
  }
  RunClaim again = eo::claim_output_dir(config("auto"));
  EXPECT_EQ(again.resume, ckpt(6).string());
  again.lock.reset();
  auto run = nlohmann::json::parse(read_text(dir_ / "out" / "run.json"));
  run["run_id"] = "0000000000000000";
  std::ofstream(dir_ / "out" / "run.json", std::ios::trunc) << run.dump(2);
  const std::string msg = usage_error([&] { eo::claim_output_dir(config("auto")); });
  EXPECT_TRUE(contains(msg, "found no checkpoint of the run that") && contains(msg, "resume_from_checkpoint: " + (dir_ / "out").string() + "/checkpoint-<step>"))
      << msg;
  EXPECT_FALSE(contains(msg, "(resume_from_checkpoint: auto)")) << msg;
}

// Issue #32 item 14: a folder named checkpoint-00041 (holding step 40) is not taken as the
// newest; nor is a checkpoint-<n> folder whose state is of another step.
TEST_F(TrainStateTest, AFolderWhoseNameIsNotItsStepIsIgnored) {
  RunClaim a = eo::claim_output_dir(config());
  save(config(), 40);
  save(config(), 30);
  fs::copy(ckpt(40), dir_ / "out" / "checkpoint-00041", fs::copy_options::recursive);
  fs::copy(ckpt(40), dir_ / "out" / "checkpoint-50", fs::copy_options::recursive);
  EXPECT_EQ(eo::latest_checkpoint(config().output_dir), ckpt(40).string());
}

// Issue #49 item 1: a run started with overwrite_output_dir beside another run's checkpoints moves
// them to other-runs/ intact; its own saves at the same steps and its pruning never reach them.
TEST_F(TrainStateTest, OverwriteMovesAnotherRunsCheckpointsAsideAndNeverWritesIntoThem) {
  {
    RunClaim a = eo::claim_output_dir(config());
    for (int s : {1, 2, 3}) save(config(), s, 100, "first");
  }
  TrainConfig over = config();
  over.overwrite_output_dir = true;
  RunClaim b = eo::claim_output_dir(over);
  for (int s : {1, 2, 3}) save(over, s, /*keep=*/1, "second");
  const auto moved = other_runs();
  ASSERT_EQ(moved.size(), 3u) << "the first run's three checkpoints, kept";
  for (const auto& m : moved) {
    EXPECT_EQ(tag_of(m), "first") << m;
    EXPECT_EQ(eo::checkpoint_damage(m.string()), "") << m;
  }
  EXPECT_EQ(tag_of(ckpt(3)), "second");
  EXPECT_FALSE(fs::exists(ckpt(1)) || fs::exists(ckpt(2))) << "keep=1 prunes this run's own";
}

// Issue #49 item 1: resuming the run of run.json beside a checkpoint another run wrote at a step
// this run later saves: `auto` ignores it saying why, and the save moves it aside, not over it.
TEST_F(TrainStateTest, ASaveAtTheStepOfAnotherRunsCheckpointMovesItAside) {
  {
    RunClaim a = eo::claim_output_dir(config());
    save(config(), 2, 100, "mine");
  }
  // Another run's checkpoint-4, copied in (its run id differs).
  const fs::path other = dir_ / "other";
  {
    TrainConfig o = config();
    o.output_dir = other.string();
    RunClaim x = eo::claim_output_dir(o);
    TrainingState s;
    s.step = 4;
    s.data_cursor = {{"tag", "theirs"}};
    s.lora = {{"base_model.model.x.lora_A.weight", at::full({2, 2}, 4.0)}};
    s.optimizer = {{"exp_avg", at::zeros({2})}};
    s.rng = {{"cpu", at::zeros({4}, at::kByte)}};
    eo::save_checkpoint(o.output_dir, s, o, 100);
  }
  fs::copy(other / "checkpoint-4", ckpt(4), fs::copy_options::recursive);
  RunClaim again = eo::claim_output_dir(config("auto"));
  EXPECT_EQ(again.resume, ckpt(2).string()) << "auto resumed another run's checkpoint";
  save(config(), 4, /*keep=*/1, "mine");
  EXPECT_EQ(tag_of(ckpt(4)), "mine");
  const auto moved = other_runs();
  ASSERT_EQ(moved.size(), 1u) << "the other run's checkpoint-4 was overwritten";
  EXPECT_EQ(tag_of(moved[0]), "theirs");
  EXPECT_EQ(eo::checkpoint_damage(moved[0].string()), "");
}

// Issue #49 item 2: saves go into the folder the run locked, not whatever has its name later. A
// rename during the run moves the run's files with it; a new folder of the old name stays empty.
TEST_F(TrainStateTest, RenamingOutputDirDuringARunCannotRedirectItsSaves) {
  RunClaim a = eo::claim_output_dir(config());
  save(config(), 1);
  fs::rename(dir_ / "out", dir_ / "moved");
  fs::create_directories(dir_ / "out");
  const std::string shown = save(config(), 2);
  EXPECT_EQ(shown, ckpt(2).string()) << "the log names the checkpoint by output_dir";
  EXPECT_TRUE(fs::exists(dir_ / "moved" / "checkpoint-2" / "trainer_state.json")) << "the save left the locked folder";
  EXPECT_TRUE(fs::is_empty(dir_ / "out")) << "the save went into the new folder of the old name";
  // A second run may take the new folder: it is not the first run's.
  RunClaim b = eo::claim_output_dir(config());
  EXPECT_TRUE(b.resume.empty());
}

// Issue #49 item 9: when every checkpoint of the run is damaged, `auto` says so, not that they
// belong to another run.
TEST_F(TrainStateTest, EveryCheckpointDamagedIsReportedAsDamage) {
  {
    RunClaim a = eo::claim_output_dir(config());
    for (int s : {1, 2}) save(config(), s);
  }
  for (int s : {1, 2}) {
    std::fstream f(ckpt(s) / "optimizer.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-1, std::ios::end);
    f.put('\x7f');
  }
  const std::string msg = usage_error([&] { eo::claim_output_dir(config("auto")); });
  EXPECT_TRUE(contains(msg, "every checkpoint of the run") && contains(msg, "is damaged")) << msg;
  EXPECT_FALSE(contains(msg, "another run")) << msg;
}

// Issue #49 item 5: resume says what changed among the settings a checkpoint did not record
// before: each change gives its own warning naming the key (the run goes on with the new value).
TEST_F(TrainStateTest, ResumeWarnsOnEachChangedSettingOfTheRun) {
  TrainingState s;
  s.step = 7;
  s.world_size = 2;
  s.recorded = eo::recorded_config(config());
  EXPECT_TRUE(eo::check_resume_compatible(s, config(), 2).empty());
  const std::vector<std::pair<std::string, std::function<void(TrainConfig&)>>> changes{
      {"max_steps", [](TrainConfig& c) { c.max_steps = 50; }},
      {"warmup_steps", [](TrainConfig& c) { c.warmup_steps = 3; }},
      {"max_grad_norm", [](TrainConfig& c) { c.max_grad_norm = 0.5; }},
      {"adam_beta2", [](TrainConfig& c) { c.adam_beta2 = 0.95; }},
      {"adam_epsilon", [](TrainConfig& c) { c.adam_epsilon = 1e-6; }},
      {"output_router_logits", [](TrainConfig& c) { c.output_router_logits = true; }},
      {"fp16", [](TrainConfig& c) { c.fp16 = true; }},
      {"bf16", [](TrainConfig& c) { c.bf16 = "false"; }},
  };
  for (const auto& [key, change] : changes) {
    TrainConfig c = config();
    change(c);
    const auto w = eo::check_resume_compatible(s, c, 2);
    ASSERT_EQ(w.size(), 1u) << key;
    EXPECT_EQ(w[0].rfind(key + " changed since the checkpoint", 0), 0u) << w[0];
  }
  const auto w = eo::check_resume_compatible(s, config(), 4);
  ASSERT_EQ(w.size(), 1u);
  EXPECT_TRUE(contains(w[0], "world size changed") && contains(w[0], "2 -> 4")) << w[0];
}
