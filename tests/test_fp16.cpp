// fp16 compute, end to end through the eo-ddp binary on the bundled tiny Qwen3-MoE, on the CPU
// (fp16 tensors there emulate a GPU without bf16): the loss follows the fp32 run's within 1% at
// every step; the loss scale's decisions (a skipped step and a backoff on an overflow, growth
// after loss_scale_growth_interval clean steps) are torch.amp.GradScaler's rule, written out in
// float64 here, with overflows injected through the fault seam (EO_DDP_FAULT_OVERFLOW); and a run
// resumed from a checkpoint continues bitwise, the scale and its count restored.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "models/safetensors.h"
#include "tests/fault_support.h"
#include "tests/grad_scaler_rule.h"
#include "tests/temp_dir_test.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

using eo::faults::Outcome;
using eo::faults::read_metrics;
using eo::faults::RunOptions;
using eo::faults::train;

class Fp16 : public eo::testing::TempDirTest {
 protected:
  Fp16() : TempDirTest("eo_fp16_") {}
};

// Two micro-batches per step (gradient sums across micro-batches), no dropout (the comparison
// is of precision alone), every step logged.
std::vector<std::string> common(std::int64_t steps) {
  return {"max_steps=" + std::to_string(steps), "save_steps=0", "lora_dropout=0", "micro_batch_size=2",
          "gradient_accumulation_steps=2", "logging_steps=1"};
}

std::vector<std::string> with(std::vector<std::string> v, const std::vector<std::string>& more) {
  v.insert(v.end(), more.begin(), more.end());
  return v;
}

// GradScaler's rule (tests/grad_scaler_rule.h): the scale each step's loss is multiplied by, for
// the set of steps that overflow; 1-based.
std::vector<double> reference_scales(std::int64_t steps, const std::set<std::int64_t>& overflow, std::int64_t interval) {
  std::string flags;
  for (std::int64_t s = 1; s <= steps; ++s) flags += overflow.count(s) ? '1' : '0';
  std::vector<double> used = eo::testing::grad_scaler_scales(flags, interval);
  used.insert(used.begin(), 0.0);
  return used;
}

// Two adapters hold bitwise equal tensors.
void expect_same_adapter(const fs::path& a_dir, const fs::path& b_dir) {
  auto a = eo::st::File::open((a_dir / "adapter_model.safetensors").string());
  auto b = eo::st::File::open((b_dir / "adapter_model.safetensors").string());
  ASSERT_EQ(a->tensors().size(), b->tensors().size());
  for (const auto& t : a->tensors()) {
    ASSERT_NE(b->find(t.name), nullptr) << t.name;
    EXPECT_TRUE(at::equal(a->load(t.name), b->load(t.name))) << t.name;
  }
}

}  // namespace

// 50 steps in fp16 against the same 50 in fp32: within 1% at every step, and the loss falls.
// At learning_rate 3e-3 rather than the bundled config's 5e-3: at 5e-3 AdamW amplifies any
// rounding, and bf16 and fp16 alike drift to 0.7-0.95% of fp32 by step 40 (fp16 there slightly
// above fp32, its smallest scaled gradients near fp16's subnormals at 2^16); at 3e-3 both stay
// near 0.5%, so the bar measures the precision, with room, and the loss still falls by a quarter.
TEST_F(Fp16, LossFollowsFp32Within1PercentFor50Steps) {
  const auto sets = with(common(50), {"learning_rate=3e-3"});
  const Outcome f32 = train(dir_ / "fp32", with(sets, {"bf16=false"}));
  ASSERT_TRUE(f32.exited && f32.code == 0) << f32.describe();
  const Outcome f16 = train(dir_ / "fp16", with(sets, {"fp16=true", "bf16=false"}));
  ASSERT_TRUE(f16.exited && f16.code == 0) << f16.describe();
  EXPECT_NE(f16.log.find("compute: fp16 (fp16: true)"), std::string::npos) << f16.log;
  const auto a = read_metrics(dir_ / "fp32"), b = read_metrics(dir_ / "fp16");
  ASSERT_EQ(a.size(), 50u);
  ASSERT_EQ(b.size(), 50u);
  double worst = 0;
  std::int64_t worst_step = 0;
  for (std::int64_t s = 1; s <= 50; ++s) {
    const double l32 = a.at(s)["loss"].get<double>(), l16 = b.at(s)["loss"].get<double>();
    ASSERT_TRUE(std::isfinite(l16)) << "step " << s;
    const double rel = std::fabs(l16 - l32) / l32;
    if (rel > worst) worst = rel, worst_step = s;
    EXPECT_LT(rel, 0.01) << "step " << s << ": fp16 " << l16 << ", fp32 " << l32;
    EXPECT_FALSE(a.at(s).contains("loss_scale")) << "fp32 has no loss scale";
    ASSERT_TRUE(b.at(s).contains("loss_scale")) << b.at(s).dump();
  }
  // The scale's sequence is GradScaler's for the overflows this run had (none expected at 2^16
  // on this model; the rule holds either way).
  std::set<std::int64_t> overflowed;
  std::int64_t before = 0;
  for (std::int64_t s = 1; s <= 50; ++s) {
    const std::int64_t n = b.at(s)["skipped_overflow"].get<std::int64_t>();
    if (n > before) overflowed.insert(s);
    before = n;
  }
  const std::vector<double> want = reference_scales(50, overflowed, 2000);
  for (std::int64_t s = 1; s <= 50; ++s) EXPECT_EQ(b.at(s)["loss_scale"].get<double>(), want[s]) << "step " << s;
  EXPECT_LT(b.at(50)["loss"].get<double>(), 0.8 * b.at(1)["loss"].get<double>());
  // fp16 did compute in fp16: the loss scale alone (a power of two) would leave fp32 bitwise.
  EXPECT_GT(worst, 1e-5);
  RecordProperty("worst_relative_loss_difference", std::to_string(worst) + " at step " + std::to_string(worst_step));
}

// Overflows injected at steps 2, 3 and 9 (the loss scale infinite there): each is skipped (no
// update, the gradient norm not finite), the scale halves, and after 3 clean steps it doubles;
// overflows in a row count towards max_nonfinite_steps (2 in a row here, under 3), apart from NaN steps.
// The sequence is GradScaler's, and a second run takes the same decisions bitwise.
TEST_F(Fp16, InjectedOverflowSkipsBacksOffAndGrowsAsGradScaler) {
  const std::set<std::int64_t> overflow{2, 3, 9};
  RunOptions o;
  o.env = {"EO_DDP_FAULT_OVERFLOW=2,3,9"};
  const auto sets = with(common(12), {"fp16=true", "bf16=false", "loss_scale_growth_interval=3", "max_nonfinite_steps=3"});
  const Outcome r = train(dir_ / "a", sets, o);
  ASSERT_TRUE(r.exited && r.code == 0) << r.describe();
  EXPECT_NE(r.log.find("step 2: the gradients overflowed fp16 at loss scale 65536"), std::string::npos) << r.log;
  const auto m = read_metrics(dir_ / "a");
  ASSERT_EQ(m.size(), 12u);
  const std::vector<double> want = reference_scales(12, overflow, 3);
  std::int64_t skipped = 0;
  for (std::int64_t s = 1; s <= 12; ++s) {
    const json& j = m.at(s);
    EXPECT_EQ(j["loss_scale"].get<double>(), want[s]) << "step " << s << ": " << j.dump();
    skipped += overflow.count(s);
    EXPECT_EQ(j["skipped_overflow"].get<std::int64_t>(), skipped) << "step " << s;
    EXPECT_EQ(j["skipped_nonfinite"].get<std::int64_t>(), 0) << "step " << s;
    EXPECT_TRUE(std::isfinite(j["loss"].get<double>())) << "step " << s;
    // metrics.jsonl writes a non-finite number as null.
    const bool finite_norm = j["grad_norm"].is_number() && std::isfinite(j["grad_norm"].get<double>());
    EXPECT_EQ(finite_norm, !overflow.count(s)) << "step " << s << ": " << j.dump();
  }
  // The scale went 65536 -> 32768 -> 16384, grew back to 32768 after steps 4-6, halved at 9 and
  // grew again after 10-12: both directions seen.
  EXPECT_EQ(want[4], 16384.0);
  EXPECT_EQ(want[7], 32768.0);
  EXPECT_EQ(want[10], 16384.0);
  const Outcome again = train(dir_ / "b", sets, o);
  ASSERT_TRUE(again.exited && again.code == 0) << again.describe();
  const auto m2 = read_metrics(dir_ / "b");
  for (std::int64_t s = 1; s <= 12; ++s) {
    EXPECT_EQ(m.at(s)["loss"], m2.at(s)["loss"]) << "step " << s;
    EXPECT_EQ(m.at(s)["grad_norm"], m2.at(s)["grad_norm"]) << "step " << s;
    EXPECT_EQ(m.at(s)["loss_scale"], m2.at(s)["loss_scale"]) << "step " << s;
  }
  expect_same_adapter(dir_ / "a", dir_ / "b");
}

// A run resumed from checkpoint-4 continues bitwise: the scale (32768 after the overflow at 2)
// and its count of clean steps (2) are restored, so it grows at the same step (after 5).
TEST_F(Fp16, ResumeIsBitwiseWithTheScaleRestored) {
  RunOptions o;
  o.env = {"EO_DDP_FAULT_OVERFLOW=2"};
  const auto sets = with(common(8), {"fp16=true", "bf16=false", "loss_scale_growth_interval=3"});
  auto saving = sets;
  for (auto& s : saving)
    if (s == "save_steps=0") s = "save_steps=4";
  const Outcome a = train(dir_ / "a", saving, o);
  ASSERT_TRUE(a.exited && a.code == 0) << a.describe();
  std::ifstream in(dir_ / "a" / "checkpoint-4" / "trainer_state.json");
  const json state = json::parse(in);
  EXPECT_EQ(state.at("extra").at("loss_scale").get<double>(), 32768.0) << state.dump();
  EXPECT_EQ(state.at("extra").at("loss_scale_growth_tracker").get<std::int64_t>(), 2) << state.dump();
  const Outcome b = train(dir_ / "b", with(sets, {"resume_from_checkpoint=" + (dir_ / "a" / "checkpoint-4").string()}), o);
  ASSERT_TRUE(b.exited && b.code == 0) << b.describe();
  const auto ma = read_metrics(dir_ / "a"), mb = read_metrics(dir_ / "b");
  ASSERT_EQ(mb.size(), 4u);
  const std::vector<double> want = reference_scales(8, {2}, 3);
  for (std::int64_t s = 5; s <= 8; ++s) {
    EXPECT_EQ(ma.at(s)["loss"].get<double>(), mb.at(s)["loss"].get<double>()) << "step " << s;
    EXPECT_EQ(ma.at(s)["grad_norm"].get<double>(), mb.at(s)["grad_norm"].get<double>()) << "step " << s;
    EXPECT_EQ(mb.at(s)["loss_scale"].get<double>(), want[s]) << "step " << s;
    EXPECT_EQ(ma.at(s)["loss_scale"].get<double>(), want[s]) << "step " << s;
  }
  EXPECT_EQ(want[6], 65536.0) << "the restored count makes the scale grow after step 5";
  expect_same_adapter(dir_ / "a", dir_ / "b");
}

// Issue #49 item 6: a run whose every step overflowed learned nothing: it exits 1 naming why and
// writes no adapter (it used to exit 0 with the untrained one).
TEST_F(Fp16, ARunWhoseEveryStepWasSkippedFails) {
  RunOptions o;
  o.env = {"EO_DDP_FAULT_OVERFLOW=1,2,3,4"};
  const Outcome r = train(dir_ / "a", with(common(4), {"fp16=true", "bf16=false", "max_nonfinite_steps=10"}), o);
  EXPECT_TRUE(r.exited && r.code == 1) << r.describe();
  EXPECT_NE(r.log.find("every one of the run's 4 steps was skipped (4 on an fp16 overflow"), std::string::npos) << r.log;
  EXPECT_FALSE(fs::exists(dir_ / "a" / "adapter_model.safetensors")) << "the untrained adapter was written";
}

// Issue #49 item 6: overflows in a row count towards max_nonfinite_steps; the stop names the
// collapsing loss scale and, with only untrained checkpoints, offers none of them.
TEST_F(Fp16, OverflowsInARowStopTheRunNamingTheCollapsingScale) {
  RunOptions o;
  o.env = {"EO_DDP_FAULT_OVERFLOW=1,2,3,4,5,6,7,8"};
  const Outcome r = train(dir_ / "a", with(common(8), {"fp16=true", "bf16=false", "max_nonfinite_steps=3", "save_steps=1"}), o);
  EXPECT_TRUE(r.exited && r.code == 1) << r.describe();
  EXPECT_NE(r.log.find("the fp16 loss scale is collapsing: the scaled gradients overflowed on 3 consecutive steps"),
            std::string::npos) << r.log;
  EXPECT_NE(r.log.find("start again (no checkpoint of this run from before that has trained"), std::string::npos) << r.log;
  EXPECT_EQ(r.log.find("Lower learning_rate"), std::string::npos) << "blames the learning rate: " << r.log;
}
