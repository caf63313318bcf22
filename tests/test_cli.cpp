// The eo-ddp binary as users run it: exit codes and messages.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>

#include "common/files.h"
#include "tests/test_paths.h"

namespace fs = std::filesystem;

namespace {

struct Result {
  int code;
  std::string out;
};

// eo-ddp with `args`, run by the shell from the folder `from` (empty: this test's).
Result run(const std::string& args, const fs::path& from = {}) {
  const std::string cmd = (from.empty() ? "" : "cd '" + from.string() + "' && ") + std::string(EO_BINARY_DIR) + "/eo-ddp " +
                          args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  std::array<char, 4096> buf;
  while (size_t n = fread(buf.data(), 1, buf.size(), p)) out.append(buf.data(), n);
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

class Cli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("eo_cli_" + std::to_string(::getpid()));
    fs::create_directories(dir_ / "model");
    fs::copy_file(std::string(EO_SOURCE_DIR) + "/fixtures/tiny-qwen3-moe/config.json", dir_ / "model" / "config.json");
    std::ofstream(dir_ / "train.jsonl") << "{\"input_ids\": [1, 2, 3]}\n";
  }
  void TearDown() override { eo::remove_tree(dir_); }
  std::string write(const std::string& name, const std::string& body) {
    const fs::path p = dir_ / name;
    std::ofstream(p) << "base_model: " << (dir_ / "model").string() << "\ndatasets: [{path: " << (dir_ / "train.jsonl").string()
                     << "}]\nload_in_4bit: true\nadapter: qlora\n"
                     << body;
    return p.string();
  }
  fs::path dir_;
};

}  // namespace

TEST_F(Cli, VersionAndHelp) {
  auto v = run("--version");
  EXPECT_EQ(v.code, 0);
  EXPECT_EQ(v.out.rfind("eo-ddp ", 0), 0u) << v.out;
  // The build says what it is: CUDA with its architectures, or a CPU build.
#ifdef EO_WITH_CUDA
  EXPECT_NE(v.out.find("(CUDA "), std::string::npos) << v.out;
  EXPECT_NE(v.out.find(" sm_"), std::string::npos) << v.out;
#else
  EXPECT_NE(v.out.find("(CPU build, libtorch "), std::string::npos) << v.out;
#endif
  auto h = run("--help");
  EXPECT_EQ(h.code, 0);
  EXPECT_NE(h.out.find("--config FILE"), std::string::npos);
  EXPECT_EQ(run("").code, 2);
  auto bad = run("frobnicate");
  EXPECT_EQ(bad.code, 2);
  EXPECT_NE(bad.out.find("unknown command 'frobnicate'"), std::string::npos) << bad.out;
}

// Every command explains itself: `eo-ddp CMD --help` (or -h, or `eo-ddp help CMD`) prints that
// command's usage and exits 0.
TEST_F(Cli, EveryCommandHasItsOwnHelp) {
  for (const std::string cmd : {"train", "preprocess", "score", "plan", "merge", "generate"}) {
    for (const std::string form : {cmd + " --help", cmd + " -h", "help " + cmd}) {
      const Result r = run(form);
      EXPECT_EQ(r.code, 0) << form << "\n" << r.out;
      EXPECT_EQ(r.out.rfind("usage: eo-ddp " + std::string(cmd == "train" ? "[train]" : cmd), 0), 0u) << form << "\n" << r.out;
      std::istringstream lines(r.out);
      for (std::string line; std::getline(lines, line);) EXPECT_LE(line.size(), 120u) << form << ": " << line;
    }
  }
  EXPECT_NE(run("plan --help").out.find("--vram SIZE"), std::string::npos);
  EXPECT_NE(run("score --help").out.find("--window N"), std::string::npos);
  // Train's options after --config, as users type them, are train's help too.
  const Result t = run("--config x.yaml --help");
  EXPECT_EQ(t.code, 0) << t.out;
  EXPECT_NE(t.out.find("--check"), std::string::npos) << t.out;
  EXPECT_EQ(run("frobnicate --help").code, 2);
}

// --help-config for a terminal: grouped, no line over 120 columns; one key; the markdown table.
TEST_F(Cli, HelpConfigIsReadableInATerminal) {
  const Result r = run("--help-config");
  EXPECT_EQ(r.code, 0);
  std::istringstream lines(r.out);
  std::string line;
  std::size_t widest = 0;
  while (std::getline(lines, line)) widest = std::max(widest, line.size());
  EXPECT_LE(widest, 120u) << r.out;
  EXPECT_NE(r.out.find("\nModel and adapter\n  base_model  ("), std::string::npos) << r.out;
  const Result md = run("--help-config --markdown");
  EXPECT_EQ(md.code, 0);
  EXPECT_EQ(md.out.rfind("| key | type | default | meaning |", 0), 0u) << md.out.substr(0, 200);
  const Result one = run("--help-config micro_batch_size");
  EXPECT_EQ(one.code, 0);
  EXPECT_EQ(one.out, "  micro_batch_size  (int; default 1)\n      Sequences per rank per micro-step.\n");
  const Result foreign = run("--help-config max_seq_length");
  EXPECT_EQ(foreign.code, 0);
  EXPECT_NE(foreign.out.find("'max_seq_length' is spelled 'sequence_len' here"), std::string::npos) << foreign.out;
  const Result typo = run("--help-config micro_bach_size");
  EXPECT_EQ(typo.code, 2);
  EXPECT_NE(typo.out.find("unknown config key 'micro_bach_size'; did you mean 'micro_batch_size'?"), std::string::npos)
      << typo.out;
}

// The names users bring from other tools, given with --set.
TEST_F(Cli, SetWithAnotherToolsNameSaysHowItIsSpelledHere) {
  const std::string f = write("ok.yaml", "");
  const Result r = run("--check --config " + f + " --set lr=1 --set lora_rank=16 --set max_seq_length=512 --set epochs=2");
  EXPECT_EQ(r.code, 2) << r.out;
  for (const std::string s : {"'lr' is spelled 'learning_rate' here", "'lora_rank' is spelled 'lora_r' here",
                              "'max_seq_length' is spelled 'sequence_len' here", "'epochs' is spelled 'num_epochs' here"})
    EXPECT_NE(r.out.find(s), std::string::npos) << s << "\n" << r.out;
  EXPECT_EQ(r.out.find("did you mean"), std::string::npos) << r.out;
}

// --check of a run that does not fit device_memory_limit fails as training would (exit 2), with
// the changes that make it fit, instead of "does NOT fit" followed by "config ok".
TEST_F(Cli, CheckOfARunThatDoesNotFitExits2WithTheChanges) {
  const std::string f = write("big.yaml", "device_memory_limit: 3MiB\nsequence_len: 4096\nmicro_batch_size: 4\n"
                                          "output_dir: " + (dir_ / "out").string() + "\n");
  const Result r = run("--check --config " + f);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_EQ(r.out.find("config ok"), std::string::npos) << r.out;
  EXPECT_TRUE(r.out.find("what to change to fit device_memory_limit 3.00 MiB") != std::string::npos ||
              r.out.find("no single change fits device_memory_limit 3.00 MiB; these together do") != std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("--set micro_batch_size="), std::string::npos) << r.out;
  const Result ok = run("--check --config " + f + " --set device_memory_limit=1GiB");
  EXPECT_EQ(ok.code, 0) << ok.out;
  EXPECT_NE(ok.out.find("config ok"), std::string::npos) << ok.out;
}

// One rule for relative paths: a config's are relative to its folder (so it runs from any folder),
// --set ones to the current folder; one found only under the current folder is used from there
// with a warning; a path error names the folder it was resolved against.
TEST_F(Cli, RelativePathsInAConfigAreRelativeToItsFolder) {
  fs::create_directories(dir_ / "elsewhere");
  std::ofstream(dir_ / "rel.yaml") << "base_model: model\ndatasets: [{path: ./train.jsonl}]\nload_in_4bit: true\nadapter: qlora\n"
                                      "output_dir: out\n";
  const std::string check = " --check --config " + (dir_ / "rel.yaml").string();
  Result r = run(check, dir_ / "elsewhere");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("base_model: " + (dir_ / "model").string() + "\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("output_dir: " + (dir_ / "out").string() + "\n"), std::string::npos) << r.out;
  // --set: the current folder.
  r = run(check + " --set datasets.0.path=elsewhere/none.jsonl", dir_);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("file 'elsewhere/none.jsonl' (resolved against " + dir_.string() + ") not found"), std::string::npos) << r.out;
  // Written for the folder it is run from: found there, with a warning.
  fs::create_directories(dir_ / "configs");
  std::ofstream(dir_ / "configs" / "old.yaml") << "base_model: model\ndatasets: [{path: train.jsonl}]\nload_in_4bit: true\n"
                                                  "adapter: qlora\noutput_dir: " << (dir_ / "out").string() << "\n";
  r = run("--check --config configs/old.yaml", dir_);
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("base_model: 'model' is not under the config's folder " + (dir_ / "configs").string()), std::string::npos)
      << r.out;
  // Found nowhere: the message names the config's folder.
  r = run("--check --config ../configs/old.yaml", dir_ / "elsewhere");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("base_model: 'model' (resolved against " + (dir_ / "configs").string() + ") is not a folder"),
            std::string::npos)
      << r.out;
}

TEST_F(Cli, CheckOfBadConfigNamesEveryProblemAndExits2) {
  const std::string f = write("bad.yaml", "expert_offlaod_pin_memory: true\nfsdp: [full_shard]\nexpert_offload: true\n"
                                          "gradient_checkpointing: true\n");
  auto r = run("--check --config " + f);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("has 3 problems"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("did you mean 'expert_offload_pin_memory'"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("fsdp: not supported"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("gradient_checkpointing_kwargs.use_reentrant"), std::string::npos) << r.out;
}

TEST_F(Cli, CheckOfValidConfigPrintsPlanAndExits0) {
  const std::string f = write("good.yaml", "expert_offload: true\ngradient_checkpointing: true\n");
  auto r = run("--check --config " + f + " --set gradient_checkpointing_kwargs.use_reentrant=false --set lora_r=4");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("lora_r: 4"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("plan:"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("expert offload: every MoE block"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("config ok"), std::string::npos) << r.out;
  // The plan is computed from config.json alone.
  EXPECT_NE(r.out.find("model: qwen3_moe, 4 layers (4 MoE), 8 experts of width 32"), std::string::npos) << r.out;
}

TEST_F(Cli, CheckWithABrokenModelConfigExits2) {
  std::ofstream(dir_ / "model" / "config.json") << "{\"model_type\": \"llama\"}";
  const std::string f = write("llama.yaml", "");
  auto r = run("--check --config " + f);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("llama"), std::string::npos) << r.out;
}

TEST_F(Cli, UsageErrorsExit2) {
  EXPECT_EQ(run("--check").code, 2);
  EXPECT_EQ(run("--check --config /nonexistent.yaml").code, 2);
  const std::string f = write("ok.yaml", "");
  auto r = run("--check --config " + f + " --bogus");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("unexpected argument(s) for 'train': --bogus"), std::string::npos) << r.out;
}

// Resource limits (issue #8): a run that cannot fit stops at start with the plan's numbers,
// before any weight is read — here the model folder has no weights at all, so reaching the
// loader would fail differently. On the CPU the check applies to an explicit device_memory_limit.
TEST_F(Cli, RunThatCannotFitStopsAtStartWithThePlan) {
  const std::string src = std::string(EO_SOURCE_DIR);
  const std::string base = "--config " + src + "/configs/tiny-qwen3-moe.yaml --set base_model=" + (dir_ / "model").string() +
                           " --set datasets.0.path=" + src + "/fixtures/tiny-data/train.jsonl --set output_dir=" +
                           (dir_ / "out").string();
  // A sequence far too long for a 2 MiB "card".
  Result r = run(base + " --set device_memory_limit=2MiB --set sequence_len=4096");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("this run does not fit"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("memory plan (per rank"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("checkpoints"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("device_memory_limit 2.00 MiB"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("--set sequence_len="), std::string::npos) << "what to change: " << r.out;
  EXPECT_EQ(r.out.find("loading "), std::string::npos) << "must stop before loading: " << r.out;
  EXPECT_FALSE(fs::exists(dir_ / "out" / "adapter_model.safetensors"));
  // A VRAM budget for resident expert blocks larger than the card.
  r = run(base + " --set device_memory_limit=3MiB --set expert_offload=true --set expert_offload_vram_budget=1GiB");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("resident blocks"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("loading "), std::string::npos) << r.out;
  // The plan subcommand says the same without starting.
  r = run("plan " + base.substr(0, base.find(" --set output_dir")) + " --vram 2MiB --set sequence_len=4096");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("does NOT fit a 2.00 MiB card"), std::string::npos) << r.out;
}

// Issue #15 items 9 and 11: an output_dir that cannot be written, and an empty --set value, are
// usage errors of --check itself (exit 2), before anything is loaded.
TEST_F(Cli, CheckRefusesAnUnwritableOutputDirAndAnEmptySet) {
  const std::string f = write("ok.yaml", "");
  std::ofstream(dir_ / "a-file") << "x";
  for (const std::string bad : {std::string("/sys/eo-ddp-cli-out"), (dir_ / "a-file" / "out").string()}) {
    auto r = run("--check --config " + f + " --set output_dir=" + bad);
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_NE(r.out.find("output_dir " + bad), std::string::npos) << r.out;
    EXPECT_EQ(r.out.find("config ok"), std::string::npos) << r.out;
  }
  auto r = run("--check --config " + f + " --set lora_r=");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("empty value"), std::string::npos) << r.out;
}

// Issue #32 items 13 and 14, through `eo-ddp plan` itself: a config.json with 2^31 - 1 experts is
// refused at once (it planned for over 40 s), and lora targets are checked against config.json as
// training checks them (gate_proj on Mixtral, whose expert linears are w1/w2/w3; as in peft, a name
// that matches nothing is an error only when no other name matches).
TEST_F(Cli, PlanRefusesHugeShapesAndTargetsTrainingRefuses) {
  const std::string mixtral = std::string(EO_SOURCE_DIR) + "/configs/models/mixtral-8x7b";
  std::ifstream in(mixtral + "/config.json");
  std::string text((std::istreambuf_iterator<char>(in)), {});
  const std::string eight = "\"num_local_experts\": 8";
  ASSERT_NE(text.find(eight), std::string::npos);
  fs::create_directories(dir_ / "huge");
  std::ofstream(dir_ / "huge" / "config.json") << text.replace(text.find(eight), eight.size(), "\"num_local_experts\": 2147483647");
  const std::string f = write("plan.yaml", "");
  const auto t0 = std::chrono::steady_clock::now();
  auto r = run("plan --config " + f + " --set base_model=" + (dir_ / "huge").string());
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("2147483647 experts is over eo-ddp's limit of 65536"), std::string::npos) << r.out;
  EXPECT_LT(seconds, 20) << r.out;

  r = run("plan --config " + f + " --set base_model=" + mixtral + " --set \"lora_target_modules=[gate_proj]\"");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("'gate_proj' matches no linear of mixtral"), std::string::npos) << r.out;
  r = run("plan --config " + f + " --set base_model=" + mixtral + " --set \"lora_target_modules=[q_proj, w1]\"");
  EXPECT_EQ(r.code, 0) << "the control: Mixtral's own expert linear plans\n" << r.out;
}

// `plan --card`: the step time predicted beside the memory plan, the card's memory taken as --vram;
// an unlisted card by its figures gives the same prediction as the listed row with those figures;
// an unknown card is refused naming the known ones.
TEST_F(Cli, PlanCardPredictsTheStepTime) {
  const std::string f = write("card.yaml", "lora_r: 16\nlora_target_modules: [q_proj, k_proj, v_proj, o_proj]\n"
                                           "sequence_len: 2048\nmicro_batch_size: 4\ngradient_checkpointing: true\n");
  const std::string base = "plan --config " + f + " --set base_model=" + EO_SOURCE_DIR + "/configs/models/qwen3-30b-a3b";
  auto r = run(base + " --card h100");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("fits a 79.60 GiB card"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("step time on h100 (H100 80 GB HBM3 SXM"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("expert grouped GEMMs"), std::string::npos) << r.out;
  const auto at = r.out.find("predicted: ");
  ASSERT_NE(at, std::string::npos) << r.out;
  // Recorded on an H100 (docs/benchmarks.md): 0.634 s/step.
  const double s = std::stod(r.out.substr(at + 11));
  EXPECT_NEAR(s, 0.634, 0.15 * 0.634) << r.out;
  const std::string predicted = r.out.substr(at, r.out.find('\n', at) - at);

  r = run(base + " --card-figures bf16_tflops=989.4,mem_gbps=3350,link_gbps=55,vram_gib=79.6");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("step time on given figures"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(predicted), std::string::npos) << predicted << "\n" << r.out;

  r = run(base + " --card 3080");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("unknown card '3080'; known cards: t4, a2000, 3090, 4090, 5090, a100, h100, h200"), std::string::npos)
      << r.out;
  r = run(base + " --card-figures bf16_tflops=100");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("missing link_gbps, mem_gbps, vram_gib;"), std::string::npos) << r.out;
  r = run(base + " --card h100 --card-figures bf16_tflops=1,mem_gbps=1,link_gbps=1,vram_gib=1");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("not both"), std::string::npos) << r.out;
}
