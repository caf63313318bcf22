// Single-rank training, end to end through the eo-ddp binary on the bundled tiny Qwen3-MoE:
// the loss falls, activation checkpointing changes nothing, resume (from a checkpoint folder,
// `auto`, after SIGTERM, after a crash in the middle of a save) continues exactly as an
// uninterrupted run, and config errors come before any weight is read.
//
// The reference for every resume test is an uninterrupted run of the same config: on the CPU with
// one thread, training is deterministic, so losses and adapters must match bit for bit.
// Each test owns a temporary folder; every child process has a bounded wait and is killed on timeout.
// (The numbering follows the task list; 3, the adapter loading in peft, is tests/ref/train_peft_check.py.)
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "models/safetensors.h"
#include "runtime/train_state.h"
#include "tests/fault_support.h"
#include "tests/temp_dir_test.h"
#include "tests/test_paths.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// ---- child processes: tests/fault_support.h (spawn, wait_for, train) ----------------------------

using eo::faults::Child;
using eo::faults::eo_ddp_command;
using eo::faults::Outcome;
using eo::faults::read_text;
using eo::faults::RunOptions;
using eo::faults::run;
using eo::faults::spawn;
using eo::faults::train;
using eo::faults::train_args;
using eo::faults::wait_for;

// metrics.jsonl by step (a resumed run appends; the last line of a step wins).
using eo::faults::read_metrics;

std::size_t count_lines(const fs::path& p) {
  std::ifstream in(p);
  std::size_t n = 0;
  for (std::string line; std::getline(in, line);) n += !line.empty();
  return n;
}

// Steps first..last of `a` and `b` have bitwise equal loss and grad norm.
void expect_same_steps(const std::map<std::int64_t, json>& a, const std::map<std::int64_t, json>& b, std::int64_t first,
                       std::int64_t last) {
  for (std::int64_t s = first; s <= last; ++s) {
    ASSERT_TRUE(a.count(s) && b.count(s)) << "step " << s << " missing from metrics";
    EXPECT_EQ(a.at(s)["loss"].get<double>(), b.at(s)["loss"].get<double>()) << "loss of step " << s;
    EXPECT_EQ(a.at(s)["grad_norm"].get<double>(), b.at(s)["grad_norm"].get<double>()) << "grad norm of step " << s;
  }
}

// Two adapter_model.safetensors hold the same names with bitwise equal tensors.
void expect_same_adapter(const fs::path& dir_a, const fs::path& dir_b) {
  auto a = eo::st::File::open((dir_a / "adapter_model.safetensors").string());
  auto b = eo::st::File::open((dir_b / "adapter_model.safetensors").string());
  ASSERT_EQ(a->tensors().size(), b->tensors().size());
  ASSERT_GT(a->tensors().size(), 0u);
  int differing = 0;
  std::string example;
  for (const auto& t : a->tensors()) {
    ASSERT_NE(b->find(t.name), nullptr) << t.name << " missing from " << dir_b;
    const at::Tensor x = a->load(t.name), y = b->load(t.name);
    if (!at::equal(x, y)) {
      if (!differing++)
        example = t.name + " (max |diff| " + std::to_string((x - y).abs().max().item<double>()) + ")";
    }
  }
  EXPECT_EQ(differing, 0) << differing << " of " << a->tensors().size() << " LoRA tensors differ between " << dir_a << " and "
                          << dir_b << ", e.g. " << example;
}

// A temporary folder of an unfinished checkpoint save in `out`.
bool has_partial_save(const fs::path& out) {
  for (const auto& e : fs::directory_iterator(out))
    if (e.path().filename().string().rfind(".tmp-checkpoint-", 0) == 0) return true;
  return false;
}

void copy_checkpoint(const fs::path& from, const fs::path& to) {
  fs::create_directories(to.parent_path());
  fs::copy(from, to, fs::copy_options::recursive);
}

class Train : public eo::testing::TempDirTest {
 protected:
  Train() : TempDirTest("eo_train_") {}
};

}  // namespace

// 1. The bundled config trains: the loss falls, every metrics line is complete, a peft adapter is written.
TEST_F(Train, LossFallsAndWritesAdapterAndMetrics) {
  const fs::path out = dir_ / "run";
  const Outcome o = train(out, {"max_steps=60", "save_steps=0"});
  ASSERT_TRUE(o.exited && o.code == 0) << o.describe();
  const auto m = read_metrics(out);
  ASSERT_EQ(count_lines(out / "metrics.jsonl"), 60u);
  ASSERT_EQ(m.size(), 60u);
  for (const auto& [step, j] : m)
    for (const char* key : {"step", "loss", "lr", "tokens_per_sec", "step_time_s", "peak_mem_bytes"})
      EXPECT_TRUE(j.contains(key) && j[key].is_number()) << "step " << step << " has no numeric " << key << ": " << j.dump();
  const double first = m.at(1)["loss"].get<double>();
  double last10 = 0;
  for (std::int64_t s = 51; s <= 60; ++s) last10 += m.at(s)["loss"].get<double>() / 10;
  EXPECT_LT(last10, 0.75 * first) << "first loss " << first << ", mean of the last 10 " << last10;
  // peft's names and shapes (design 3.4) for LoRA r=8 on the attention projections of 4 layers:
  // hidden 64, 4 query heads and 2 kv heads of 16.
  auto adapter = eo::st::File::open((out / "adapter_model.safetensors").string());
  EXPECT_EQ(adapter->tensors().size(), 4u * 4 * 2);
  const std::map<std::string, std::vector<std::int64_t>> expected_shapes{
      {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", {8, 64}},
      {"base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight", {32, 8}},
      {"base_model.model.model.layers.3.self_attn.o_proj.lora_B.weight", {64, 8}},
      {"base_model.model.model.layers.2.self_attn.v_proj.lora_A.weight", {8, 64}}};
  for (const auto& [name, shape] : expected_shapes) {
    const eo::st::TensorInfo* t = adapter->find(name);
    ASSERT_NE(t, nullptr) << name << " not in the adapter";
    EXPECT_EQ(t->shape, shape) << name;
  }
  ASSERT_TRUE(fs::exists(out / "adapter_config.json"));
  const json cfg = json::parse(read_text(out / "adapter_config.json"));
  EXPECT_EQ(cfg.at("peft_type"), "LORA");
  EXPECT_EQ(cfg.at("r"), 8);
  // The summary block that ends the run, its losses those of metrics.jsonl's first and last step.
  auto loss_text = [&](std::int64_t step) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.4f", m.at(step)["loss"].get<double>());
    return std::string(buf);
  };
  const auto summary = o.log.find("run summary:");
  ASSERT_NE(summary, std::string::npos) << o.log;
  const std::string block = o.log.substr(summary);
  for (const std::string& line : {std::string("  steps        60 of 60\n"), "  loss         " + loss_text(1) + " first, " +
                                  loss_text(60) + " last\n", std::string("  eval loss    - (no evaluation rows)\n"),
                                  "  adapter      " + out.string()})
    EXPECT_NE(block.find(line), std::string::npos) << "no '" << line << "' in\n" << block;
  for (const char* field : {"  wall time    ", "  throughput   ", " tok/s", "  peak RSS     "})
    EXPECT_NE(block.find(field), std::string::npos) << field << " in\n" << block;
}

// Loading shows its progress (a plain line when stderr is no terminal, as here): every layer,
// the checkpoint's one shard read whole, and the matrices quantised to NF4: 4 attention linears
// and 8 experts x 3 per layer (config.json); then the expert homes, every MoE block filled.
TEST_F(Train, LoadingShowsProgressInTheLog) {
  const fs::path out = dir_ / "run";
  const Outcome o = run(eo_ddp_command({"--config", "configs/tiny-qwen3-moe-offload.yaml", "--set", "output_dir=" + out.string(),
                                        "--set", "max_steps=1", "--set", "save_steps=0", "--set",
                                        "dataset_prepared_path=" + (dir_ / "prepared").string()}),
                        out.string() + ".log");
  ASSERT_TRUE(o.exited && o.code == 0) << o.describe();
  EXPECT_EQ(o.log.find('\r'), std::string::npos) << "no terminal: plain lines only";
  const json mc = json::parse(read_text(fs::path(EO_SOURCE_DIR) / "fixtures/tiny-qwen3-moe/config.json"));
  const int layers = mc.at("num_hidden_layers"), experts = mc.at("num_local_experts");
  const auto at = o.log.find("\nloaded   layer " + std::to_string(layers) + "/" + std::to_string(layers) + "  shard 1/1  read ");
  ASSERT_NE(at, std::string::npos) << o.log;
  const std::string line = o.log.substr(at + 1, o.log.find('\n', at + 1) - at - 1);
  const auto read = line.find("read "), of = line.find(" of "), rate = line.find("  ", of);
  EXPECT_EQ(line.substr(read + 5, of - read - 5), line.substr(of + 4, rate - of - 4)) << "the whole checkpoint read: " << line;
  EXPECT_NE(line.find(" GB/s  quantised " + std::to_string(layers * (4 + experts * 3)) + " matrices to NF4  in "),
            std::string::npos) << line;
  EXPECT_NE(o.log.find("\nfilled   expert homes  block " + std::to_string(layers) + "/" + std::to_string(layers) + "  "),
            std::string::npos) << o.log;
  EXPECT_LT(at, o.log.find("step 1/1")) << "loading comes before the first step";
}

// 2. Activation checkpointing recomputes the same forward (dropout masks included, via the RNG
//    replay), so per-step grad norms and the final adapter are bitwise those of a plain run.
TEST_F(Train, CheckpointedAndPlainTrainingAreBitwiseEqual) {
  const std::vector<std::string> common{"max_steps=4", "save_steps=0", "lora_dropout=0.1"};
  auto with = common, without = common;
  with.push_back("gradient_checkpointing=true");
  without.push_back("gradient_checkpointing=false");
  const Outcome a = train(dir_ / "ckpt", with);
  ASSERT_TRUE(a.exited && a.code == 0) << a.describe();
  const Outcome b = train(dir_ / "plain", without);
  ASSERT_TRUE(b.exited && b.code == 0) << b.describe();
  expect_same_steps(read_metrics(dir_ / "ckpt"), read_metrics(dir_ / "plain"), 1, 4);
  expect_same_adapter(dir_ / "ckpt", dir_ / "plain");
}

// 4. Resuming from a checkpoint continues exactly: from an explicit folder into a fresh
//    output_dir, and with `auto`, which takes the newest *complete* checkpoint.
TEST_F(Train, ResumeFromCheckpointIsExact) {
  const fs::path a = dir_ / "a";
  const Outcome ra = train(a, {"max_steps=8", "save_steps=2", "save_total_limit=10"});
  ASSERT_TRUE(ra.exited && ra.code == 0) << ra.describe();
  for (int s : {2, 4, 6, 8}) ASSERT_TRUE(fs::exists(a / ("checkpoint-" + std::to_string(s)) / "trainer_state.json")) << s;
  const auto ma = read_metrics(a);

  const fs::path b = dir_ / "b";
  const Outcome rb = train(b, {"max_steps=8", "save_steps=0", "resume_from_checkpoint=" + (a / "checkpoint-4").string()});
  ASSERT_TRUE(rb.exited && rb.code == 0) << rb.describe();
  const auto mb = read_metrics(b);
  ASSERT_FALSE(mb.empty());
  EXPECT_EQ(mb.begin()->first, 5) << "the resumed run starts after step 4";
  EXPECT_EQ(mb.size(), 4u);
  expect_same_steps(ma, mb, 5, 8);
  expect_same_adapter(a, b);

  // auto: checkpoints 2 and 4, plus a checkpoint-6 whose save never finished (no trainer_state.json).
  const fs::path c = dir_ / "c";
  copy_checkpoint(a / "checkpoint-2", c / "checkpoint-2");
  copy_checkpoint(a / "checkpoint-4", c / "checkpoint-4");
  copy_checkpoint(a / "checkpoint-6", c / "checkpoint-6");
  fs::remove(c / "checkpoint-6" / "trainer_state.json");
  const Outcome rc = train(c, {"max_steps=8", "save_steps=0", "resume_from_checkpoint=auto"});
  ASSERT_TRUE(rc.exited && rc.code == 0) << rc.describe();
  const auto mc = read_metrics(c);
  ASSERT_FALSE(mc.empty());
  EXPECT_EQ(mc.begin()->first, 5) << "auto must pick checkpoint-4 (newest complete)\n" << rc.log;
  expect_same_steps(ma, mc, 5, 8);
  expect_same_adapter(a, c);
}

// 4b. LoRA on every linear, experts included (trained stacked, written per expert): the adapter
//     and each checkpoint's adapter are peft's per-expert names and shapes, and resuming from a
//     checkpoint continues bitwise (adapter restacked, optimizer state by stacked name).
TEST_F(Train, ExpertLoraWritesPeftPerExpertAndResumesExactly) {
  const std::vector<std::string> expert_lora = {"lora_target_linear=true", "lora_dropout=0.1"};
  auto with = [&](std::vector<std::string> v) {
    v.insert(v.end(), expert_lora.begin(), expert_lora.end());
    return v;
  };
  const fs::path a = dir_ / "a";
  const Outcome ra = train(a, with({"max_steps=6", "save_steps=3", "save_total_limit=10"}));
  ASSERT_TRUE(ra.exited && ra.code == 0) << ra.describe();
  // 4 layers x (4 attention + 8 experts x 3) modules x (A, B); hidden 64, expert width 32, r 8.
  for (const fs::path& f : {a / "adapter_model.safetensors", a / "checkpoint-3" / "adapter_model.safetensors"}) {
    auto adapter = eo::st::File::open(f.string());
    EXPECT_EQ(adapter->tensors().size(), 4u * (4 + 8 * 3) * 2) << f;
    const eo::st::TensorInfo* up = adapter->find("base_model.model.model.layers.2.mlp.experts.7.up_proj.lora_A.weight");
    ASSERT_NE(up, nullptr) << f;
    EXPECT_EQ(up->shape, (std::vector<std::int64_t>{8, 64}));
    const eo::st::TensorInfo* down = adapter->find("base_model.model.model.layers.0.mlp.experts.0.down_proj.lora_B.weight");
    ASSERT_NE(down, nullptr) << f;
    EXPECT_EQ(down->shape, (std::vector<std::int64_t>{64, 8}));
  }
  const fs::path b = dir_ / "b";
  const Outcome rb = train(b, with({"max_steps=6", "save_steps=0", "resume_from_checkpoint=" + (a / "checkpoint-3").string()}));
  ASSERT_TRUE(rb.exited && rb.code == 0) << rb.describe();
  expect_same_steps(read_metrics(a), read_metrics(b), 4, 6);
  expect_same_adapter(a, b);
}

// 4c. lora_target_parameters (fused expert LoRA): the adapter and each checkpoint's adapter carry
//     peft's ParamWrapper names and shapes (gate_up_proj nested under base_layer), and resuming
//     from a checkpoint continues bitwise (ParamWrapper tensors taken back to the trained form).
TEST_F(Train, FusedExpertLoraWritesPeftParamWrapperAndResumesExactly) {
  const std::vector<std::string> fused = {"lora_dropout=0", "lora_target_modules=[q_proj, v_proj]",
                                          "lora_target_parameters=[mlp.experts.gate_up_proj, mlp.experts.down_proj]"};
  auto with = [&](std::vector<std::string> v) {
    v.insert(v.end(), fused.begin(), fused.end());
    return v;
  };
  const fs::path a = dir_ / "a";
  const Outcome ra = train(a, with({"max_steps=6", "save_steps=3", "save_total_limit=10"}));
  ASSERT_TRUE(ra.exited && ra.code == 0) << ra.describe();
  // 4 layers x (2 attention + 2 fused) modules x (A, B); hidden 64, expert width 32, 8 experts, r 8.
  for (const fs::path& f : {a / "adapter_model.safetensors", a / "checkpoint-3" / "adapter_model.safetensors"}) {
    auto adapter = eo::st::File::open(f.string());
    EXPECT_EQ(adapter->tensors().size(), 4u * (2 + 2) * 2) << f;
    const std::string p = "base_model.model.model.layers.2.mlp.experts.";
    const std::pair<const char*, std::vector<std::int64_t>> want[] = {{"base_layer.lora_A.weight", {64, 64}},
                                                                      {"base_layer.lora_B.weight", {64, 64}},
                                                                      {"lora_A.weight", {64, 32}},
                                                                      {"lora_B.weight", {64, 64}}};
    for (const auto& [name, shape] : want) {
      const eo::st::TensorInfo* t = adapter->find(p + name);
      ASSERT_NE(t, nullptr) << f << " " << name;
      EXPECT_EQ(t->shape, shape) << name;
    }
    EXPECT_EQ(adapter->find("base_model.model.model.layers.2.mlp.experts.0.down_proj.lora_A.weight"), nullptr);
  }
  const fs::path b = dir_ / "b";
  const Outcome rb = train(b, with({"max_steps=6", "save_steps=0", "resume_from_checkpoint=" + (a / "checkpoint-3").string()}));
  ASSERT_TRUE(rb.exited && rb.code == 0) << rb.describe();
  expect_same_steps(read_metrics(a), read_metrics(b), 4, 6);
  expect_same_adapter(a, b);
}

// 4d. The same on the fused layouts peft gives gpt-oss (gate and up interleaved in [E, H, 2I]) and
//     Llama 4 (its factors on swapped sides), on their tiny checkpoints: resuming continues bitwise.
TEST_F(Train, FusedExpertLoraInTheirLayoutsResumesExactly) {
  for (const std::string arch : {"gpt_oss", "llama4"}) {
    SCOPED_TRACE(arch);
    const fs::path model = dir_ / ("model_" + arch);
    const std::string make = std::string(EO_PYTHON) + " " + EO_SOURCE_DIR + "/tools/make_tiny_model.py --arch " + arch +
                             " --out " + model.string() + " >/dev/null 2>&1";
    ASSERT_EQ(std::system(make.c_str()), 0) << make;
    const std::vector<std::string> sets = {"base_model=" + model.string(), "sequence_len=64", "lora_dropout=0",
                                           "lora_target_modules=[q_proj]", "lora_target_parameters=[gate_up_proj, down_proj]"};
    auto with = [&](std::vector<std::string> v) {
      v.insert(v.end(), sets.begin(), sets.end());
      return v;
    };
    const fs::path a = dir_ / (arch + "_a"), b = dir_ / (arch + "_b");
    const Outcome ra = train(a, with({"max_steps=6", "save_steps=3", "save_total_limit=10"}));
    ASSERT_TRUE(ra.exited && ra.code == 0) << ra.describe();
    const Outcome rb = train(b, with({"max_steps=6", "save_steps=0", "resume_from_checkpoint=" + (a / "checkpoint-3").string()}));
    ASSERT_TRUE(rb.exited && rb.code == 0) << rb.describe();
    expect_same_steps(read_metrics(a), read_metrics(b), 4, 6);
    expect_same_adapter(a, b);
  }
}

// 5. SIGTERM: the run saves a checkpoint at the end of the current step and exits 3; resuming
//    with `auto` gives the losses of an uninterrupted run. (Constant lr: the interrupted run was
//    planned for 400 steps, the others for fewer, and a cosine schedule depends on the total.)
TEST_F(Train, SigtermSavesAndResumesExactly) {
  const fs::path s = dir_ / "stopped";
  const Child child = spawn(eo_ddp_command(train_args(s, {"max_steps=400", "save_steps=0", "lr_scheduler=constant"})), dir_ / "stopped.log");
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  int status = 0;
  bool exited_early = false;
  while (count_lines(s / "metrics.jsonl") < 3 && std::chrono::steady_clock::now() < deadline) {
    if (waitpid(child.pid, &status, WNOHANG) == child.pid) {
      exited_early = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_FALSE(exited_early) << "the run ended before it was signalled:\n" << read_text(child.log);
  kill(child.pid, SIGTERM);
  const Outcome o = wait_for(child, 60);
  ASSERT_TRUE(o.exited && o.code == 3) << o.describe();
  const auto saved = eo::latest_checkpoint(s.string());
  ASSERT_TRUE(saved.has_value()) << "no checkpoint after SIGTERM\n" << o.log;
  const std::int64_t n = eo::load_checkpoint(*saved).step;
  const auto stopped = read_metrics(s);
  ASSERT_GE(n, 3);
  ASSERT_LT(n, 400);
  EXPECT_EQ(stopped.rbegin()->first, n) << "the checkpoint is of the last logged step";

  const std::string total = "max_steps=" + std::to_string(n + 3);
  const Outcome r = train(s, {total, "save_steps=0", "lr_scheduler=constant", "resume_from_checkpoint=auto"});
  ASSERT_TRUE(r.exited && r.code == 0) << r.describe();
  const fs::path ref = dir_ / "uninterrupted";
  const Outcome u = train(ref, {total, "save_steps=0", "lr_scheduler=constant"});
  ASSERT_TRUE(u.exited && u.code == 0) << u.describe();
  expect_same_steps(read_metrics(s), read_metrics(ref), 1, n + 3);
  expect_same_adapter(s, ref);
}

// 6. A crash (SIGKILL) in the middle of writing checkpoint-4 leaves checkpoint-2 intact and no
//    checkpoint-4; `auto` resumes from checkpoint-2 and matches an uninterrupted run.
TEST_F(Train, KilledSaveKeepsPreviousCheckpoint) {
  const fs::path k = dir_ / "killed";
  const std::vector<std::string> sets{"max_steps=6", "save_steps=2"};
  const Outcome o = train(k, sets, RunOptions{{"EO_DDP_FAULT_KILL_IN_SAVE=4"}});
  ASSERT_TRUE(!o.timed_out && !o.exited && o.signal == SIGKILL) << "expected death by SIGKILL in the save of step 4: " << o.describe();
  EXPECT_FALSE(fs::exists(k / "checkpoint-4")) << "a half-written checkpoint-4 is in place";
  EXPECT_FALSE(fs::exists(k / "adapter_model.safetensors"));
  EXPECT_TRUE(has_partial_save(k)) << "the kill was meant to hit the middle of the save (a .tmp-checkpoint-4-* folder)";
  ASSERT_TRUE(fs::exists(k / "checkpoint-2" / "trainer_state.json"));
  EXPECT_EQ(eo::latest_checkpoint(k.string()), (k / "checkpoint-2").string());
  EXPECT_EQ(eo::load_checkpoint((k / "checkpoint-2").string()).step, 2);

  const Outcome r = train(k, {"max_steps=6", "save_steps=2", "resume_from_checkpoint=auto"});
  ASSERT_TRUE(r.exited && r.code == 0) << r.describe();
  EXPECT_NE(r.log.find("checkpoint-2 at step 2"), std::string::npos) << r.log;
  const fs::path ref = dir_ / "uninterrupted";
  const Outcome u = train(ref, sets);
  ASSERT_TRUE(u.exited && u.code == 0) << u.describe();
  expect_same_steps(read_metrics(k), read_metrics(ref), 1, 6);
  expect_same_adapter(k, ref);
  EXPECT_FALSE(has_partial_save(k)) << "the next save removes the dead save's temporary folder";
  for (int s : {4, 6}) EXPECT_TRUE(fs::exists(k / ("checkpoint-" + std::to_string(s)) / "trainer_state.json")) << s;
}

// 7. Config problems are reported (exit 2) before any weight is read: with --check, and when
//    training with a model folder whose weights are garbage.
TEST_F(Train, ConfigErrorsComeBeforeWeights) {
  const std::vector<std::string> missing{"base_model=" + (dir_ / "no-such-model").string()};
  for (bool check : {true, false}) {
    std::vector<std::string> args = train_args(dir_ / "out", missing);
    if (check) args.push_back("--check");
    const Outcome o = wait_for(spawn(eo_ddp_command(args), dir_ / "missing.log"), 60);
    EXPECT_TRUE(o.exited && o.code == 2) << (check ? "--check: " : "train: ") << o.describe();
    EXPECT_NE(o.log.find("base_model"), std::string::npos) << o.log;
    EXPECT_NE(o.log.find("no-such-model"), std::string::npos) << o.log;
  }

  // A model folder with a valid config.json and unreadable weights, plus a misspelt key.
  const fs::path model = dir_ / "garbage-model";
  fs::create_directories(model);
  fs::copy_file(fs::path(EO_SOURCE_DIR) / "fixtures/tiny-qwen3-moe/config.json", model / "config.json");
  std::ofstream(model / "model.safetensors") << "not a safetensors file";
  const Outcome bad = wait_for(spawn(eo_ddp_command(train_args(dir_ / "out", {"base_model=" + model.string(), "learning_rat=1e-4"})), dir_ / "bad.log"), 60);
  EXPECT_TRUE(bad.exited && bad.code == 2) << bad.describe();
  EXPECT_NE(bad.log.find("learning_rat"), std::string::npos) << bad.log;
  EXPECT_EQ(bad.log.find("safetensors"), std::string::npos) << "weights were read before the config was checked:\n" << bad.log;
  EXPECT_FALSE(fs::exists(dir_ / "out")) << "output_dir was created for a run that never started";
  // Control: with a valid config the garbage weights are read, and fail as a runtime error.
  const Outcome control = wait_for(spawn(eo_ddp_command(train_args(dir_ / "out2", {"base_model=" + model.string()})), dir_ / "control.log"), 60);
  EXPECT_TRUE(control.exited && control.code == 1) << control.describe();
  EXPECT_NE(control.log.find("model.safetensors"), std::string::npos) << control.log;
}

// Step times are the step's own device time (on the CPU: the wall clock after its work), not the
// host's interval between reading two steps. Every step's work is lengthened by 0.3 s and step 3's
// by 0.9 s (through the test seam). The host reads step s after queueing step s + 1, so the old
// host interval put step 3's time on step 2 (host_s keeps that interval, and shows it), and gave
// the last step, read right after the one before, about 0 s. No progress line may claim a rate
// far from the run's own: the fixed 0.3 s keeps the machine's own speed changes (other processes
// on the cores) from moving a step's true rate by 1.5x.
TEST_F(Train, StepTimesAreTheStepsOwnTimeNotTheHostsReadInterval) {
  const fs::path out = dir_ / "run";
  RunOptions o;
  o.env = {"EO_DDP_FAULT_DEVICE_DELAY=all:0.3,3:0.9"};
  const Outcome r = run(eo_ddp_command(train_args(out, {"max_steps=20", "save_steps=0", "logging_steps=1"})), dir_ / "run.log", o);
  ASSERT_TRUE(r.exited && r.code == 0) << r.describe();
  const auto m = read_metrics(out);
  ASSERT_EQ(m.size(), 20u);
  for (std::int64_t s = 1; s <= 20; ++s) EXPECT_GE(m.at(s)["step_time_s"].get<double>(), s == 3 ? 0.9 : 0.3) << m.at(s).dump();
  EXPECT_LT(m.at(2)["step_time_s"].get<double>(), 0.9) << m.at(2).dump();
  EXPECT_LT(m.at(4)["step_time_s"].get<double>(), 0.9) << m.at(4).dump();
  EXPECT_GE(m.at(2)["host_s"].get<double>(), 0.9) << "host_s is the read interval, which holds step 3's work: " << m.at(2).dump();
  // The device clock runs through every step: each step's end minus the one before is its time.
  for (std::int64_t s = 2; s <= 20; ++s)
    EXPECT_NEAR(m.at(s)["device_clock_s"].get<double>() - m.at(s - 1)["device_clock_s"].get<double>(),
                m.at(s)["step_time_s"].get<double>(), 1e-9)
        << "step " << s;
  std::vector<double> rates;
  for (std::int64_t s = 1; s <= 20; ++s) rates.push_back(m.at(s)["tokens_per_sec"].get<double>());
  std::vector<double> sorted = rates;
  std::sort(sorted.begin(), sorted.end());
  const double med = 0.5 * (sorted[9] + sorted[10]);
  for (std::size_t i = 0; i < rates.size(); ++i) EXPECT_LE(rates[i], 1.5 * med) << "step " << i + 1 << " of a run with median " << med;
}

// epoch = rows consumed / rows an epoch uses, at every step. 10 one-document rows, micro-batches
// of 3 rows: an epoch uses 9 (the tenth is dropped for that epoch), so after s steps of g micro-
// batches the run has consumed 3 g s rows and is at epoch 3 g s / 9.
TEST_F(Train, EpochIsRowsConsumedOverRowsPerEpoch) {
  {
    std::ofstream data(dir_ / "rows.jsonl");
    for (int i = 0; i < 10; ++i) data << "{\"input_ids\": [1, " << 10 + i << ", 20, 30, 40, 2]}\n";
  }
  for (int accum : {1, 2}) {
    const fs::path out = dir_ / ("run-g" + std::to_string(accum));
    std::ifstream in(fs::path(EO_SOURCE_DIR) / "configs/tiny-qwen3-moe.yaml");
    std::stringstream yaml;
    for (std::string line; std::getline(in, line);) {
      if (line.find("fixtures/tiny-data/train.jsonl") != std::string::npos) line = "  - path: " + (dir_ / "rows.jsonl").string();
      if (line.rfind("base_model:", 0) == 0) line = "base_model: " + (fs::path(EO_SOURCE_DIR) / "fixtures/tiny-qwen3-moe").string();
      yaml << line << "\n";
    }
    std::ofstream(dir_ / "rows.yaml") << yaml.str();
    const Outcome r = run(eo_ddp_command(train_args(out,
                                                    {"max_steps=7", "save_steps=0", "logging_steps=1", "sample_packing=false",
                                                     "micro_batch_size=3", "gradient_accumulation_steps=" + std::to_string(accum)},
                                                    (dir_ / "rows.yaml").string())),
                          dir_ / "rows.log");
    ASSERT_TRUE(r.exited && r.code == 0) << r.describe();
    const auto m = read_metrics(out);
    ASSERT_EQ(m.size(), 7u);
    for (const auto& [s, j] : m) EXPECT_NEAR(j["epoch"].get<double>(), 3.0 * accum * double(s) / 9.0, 1e-12) << "g " << accum << ", step " << s;
  }
}
