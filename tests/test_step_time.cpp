// The step time predicted (runtime/step_time.h, runtime/cards.h): the step's FLOPs against a count
// by hand, the card table and the figures of an unlisted card, the efficiencies made again from the
// recorded H100 breakdown, and the recorded steps of docs/benchmarks.md within 15%.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <set>

#include "common/error.h"
#include "models/attention_path.h"
#include "models/hf_config.h"
#include "runtime/cards.h"
#include "runtime/config.h"
#include "runtime/plan.h"
#include "runtime/runspec.h"
#include "runtime/step_time.h"
#include "test_paths.h"

namespace {

using namespace eo;

struct Planned {
  RunSpec spec;
  MemoryPlan plan;
  StepWork work;
};

Planned planned(const std::string& yaml, std::vector<std::string> sets) {
  ConfigLoadOptions lo;
  lo.check_files = false;
  lo.check_architecture = true;
  model::ModelConfig mc;
  lo.model_out = &mc;
  const TrainConfig cfg = load_config_file(std::string(EO_SOURCE_DIR) + "/" + yaml, sets, lo);
  Planned p{resolve_run_spec(cfg, std::move(mc), Compute::Bf16, /*on_gpu=*/true, 1), {}, {}};
  p.plan = plan_memory(p.spec);
  p.work = step_work(p.spec, p.plan);
  return p;
}

// tiny-qwen3-moe (fixtures): hidden 64, 4 layers, 4 heads of 16, 2 kv heads, 8 experts of width 32,
// top 2, vocab 256. Sequence 16, micro-batch 2, accumulation 3: 96 tokens.
TEST(StepTime, WorkMatchesACountByHand) {
  const Planned p = planned("configs/tiny-qwen3-moe.yaml",
                            {"sequence_len=16", "micro_batch_size=2", "gradient_accumulation_steps=3", "lora_r=4",
                             "lora_target_modules=[q_proj, v_proj]", "lora_dropout=0"});
  const double T = 96, L = 4;
  EXPECT_DOUBLE_EQ(p.work.tokens, T);
  // Each expert: gate, up (64 -> 32) and down (32 -> 64); 2 multiply-add FLOPs; forward, recompute,
  // input gradient.
  EXPECT_DOUBLE_EQ(p.work.expert_gemm_flops, T * 2 * (3 * 64 * 32) * 2 * 3 * L);
  // q 64x64, k 64x32, v 64x32, o 64x64 frozen (3 passes); the router 64x8 (3 passes); LoRA r 4 on q
  // (64 + 64) and v (64 + 32), 4 passes (its weight gradient too).
  const double proj = T * 2 * (64.0 * 64 + 64 * 32 + 64 * 32 + 64 * 64) * 3 * L;
  const double router = T * 2 * 64 * 8 * 3 * L;
  const double lora = T * 2 * 4 * ((64 + 64) + (64 + 32)) * 4 * L;
  EXPECT_DOUBLE_EQ(p.work.other_gemm_flops, proj + router + lora);
  // Causal: a query attends to 8.5 keys on average over 16 positions; QK^T and PV, 16 dims each,
  // 4 heads; forward, recompute and a backward of twice the forward.
  EXPECT_DOUBLE_EQ(p.work.attention_flops, T * 8.5 * 4 * (16 + 16) * 2 * 4 * L);
  EXPECT_DOUBLE_EQ(p.work.head_flops, T * 2 * 64 * 256 * 2);
  // Every bank dequantised twice per micro-batch (forward, recompute kept for the backward): the
  // 4-bit bytes read and bf16 written.
  ASSERT_EQ(p.spec.bank_reuse, model::BankReuse::All);
  const double params = L * 8 * 3 * 64 * 32;
  EXPECT_GT(p.plan.expert_bytes, params / 2);  // 4 bits a weight and the block scales
  EXPECT_DOUBLE_EQ(p.work.dequant_bytes, (p.plan.expert_bytes + params * 2) * 2 * 3);
  EXPECT_DOUBLE_EQ(p.work.layer_passes, L * 3);
  EXPECT_EQ(p.work.staged_bytes, 0);
}

// Offloaded, the floor's bytes are the staged experts', and with the experts' LoRA state on the host
// its 20 bytes a parameter up each step too (expert_lora_link_bytes); with that state on the device,
// the experts' alone.
TEST(StepTime, TheFloorCountsTheExpertLorasCopies) {
  const std::vector<std::string> sets = {"expert_offload=true", "lora_dropout=0",
                                         "lora_target_parameters=[mlp.experts.gate_up_proj, mlp.experts.down_proj]"};
  const Planned host = planned("configs/tiny-qwen3-moe.yaml", sets);
  std::vector<std::string> on_device = sets;
  on_device.push_back("expert_lora_offload=false");
  const Planned device = planned("configs/tiny-qwen3-moe.yaml", on_device);
  ASSERT_TRUE(host.spec.expert_lora_offload);
  ASSERT_GT(host.plan.expert_lora_params, 0);
  const double experts = double(host.plan.copies_per_step) * host.plan.block_bytes;
  EXPECT_GT(experts, 0);
  EXPECT_DOUBLE_EQ(device.work.staged_bytes, experts);
  EXPECT_DOUBLE_EQ(host.work.staged_bytes, experts + 20 * host.plan.expert_lora_params);
}

TEST(StepTime, SlidingWindowsShortenTheContext) {
  // gpt-oss-20b: every other layer a 128-token window. At sequence 2048 a windowed layer sees
  // (128 * 129 / 2 + 1920 * 128) / 2048 keys on average, a full one 1024.5.
  const Planned p = planned("configs/bench/qwen3-30b-a3b-offload.yaml",
                            {"base_model=" + std::string(EO_SOURCE_DIR) + "/configs/models/gpt-oss-20b", "expert_offload=false"});
  const double T = 2048, heads = 64, dims = 64 + 64;
  const double windowed = (128.0 * 129 / 2 + 1920.0 * 128) / 2048, full = 1024.5;
  EXPECT_NEAR(p.work.attention_flops, T * (12 * windowed + 12 * full) * heads * dims * 2 * 4, 1e-6 * p.work.attention_flops);
}

TEST(StepTime, CardTableIsComplete) {
  std::set<std::string> names;
  for (const auto& c : known_cards()) {
    EXPECT_TRUE(names.insert(c.name).second) << c.name << " listed twice";
    EXPECT_GT(c.vram_gib, 0) << c.name;
    EXPECT_GT(c.bf16_tflops, 0) << c.name;
    EXPECT_GT(c.mem_gbps, 0) << c.name;
    EXPECT_GT(c.link_gbps, 0) << c.name;
  }
  for (const char* n : {"t4", "a2000", "3090", "4090", "5090", "a100", "h100", "h200"}) EXPECT_TRUE(names.count(n)) << n;
  EXPECT_EQ(find_card("H100").bf16_tflops, 989.4);
  EXPECT_EQ(card_memory(find_card("3090")), "24GiB");
}

TEST(StepTime, UnknownCardIsRefusedListingTheKnownOnes) {
  try {
    find_card("3080", "plan: --card");
    FAIL() << "3080 accepted";
  } catch (const UsageError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("plan: --card"), std::string::npos) << m;
    EXPECT_NE(m.find("'3080'"), std::string::npos) << m;
    for (const auto& c : known_cards()) EXPECT_NE(m.find(c.name), std::string::npos) << m;
    EXPECT_NE(m.find("--card-figures"), std::string::npos) << m;
  }
}

TEST(StepTime, CardFiguresAreParsed) {
  const CardFigures c = card_from_figures("bf16_tflops=165.2,mem_gbps=1008,link_gbps=24,vram_gib=24");
  EXPECT_EQ(c.bf16_tflops, 165.2);
  EXPECT_EQ(c.mem_gbps, 1008);
  EXPECT_EQ(c.link_gbps, 24);
  EXPECT_EQ(c.vram_gib, 24);
  auto refused = [](const std::string& text, const std::string& says) {
    try {
      card_from_figures(text);
      ADD_FAILURE() << text << " accepted";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("bf16_tflops=N,mem_gbps=N,link_gbps=N,vram_gib=N"), std::string::npos) << e.what();
    }
  };
  refused("bf16_tflops=165,mem_gbps=1008,link_gbps=24", "missing vram_gib;");
  refused("bf16_tflops=165,mem_gbps=1008,link_gbps=24,vram_gib=24,tflops=3", "unknown key 'tflops'");
  refused("bf16_tflops=fast,mem_gbps=1008,link_gbps=24,vram_gib=24", "bf16_tflops must be a positive number, got 'fast'");
  refused("bf16_tflops=-1,mem_gbps=1008,link_gbps=24,vram_gib=24", "bf16_tflops must be a positive number");
  refused("bf16_tflops=1,bf16_tflops=2,mem_gbps=1008,link_gbps=24,vram_gib=24", "bf16_tflops given twice");
}

// The H100 breakdown of issue 48 (main f9ce426, `eo-bench --breakdown`, Qwen3-30B-A3B resident
// 2048 x 4, profiled step 0.676 s): shares of the step, scaled to the unprofiled 0.634 s/step.
PhaseSeconds h100_breakdown() {
  const double step = 0.634;
  PhaseSeconds m;
  m.expert_gemm = 0.21 * step;
  m.other_gemm = 0.17 * step;
  m.attention = 0.09 * step;
  m.memory = (0.19 + 0.10 + 0.09 + 0.06) * step;  // elementwise, NF4 dequantisation, routing, norms
  m.fixed = 0.08 * step;                          // the GPU waiting for the host
  return m;
}

Planned qwen3(const std::vector<std::string>& more) {
  std::vector<std::string> sets = {"base_model=" + std::string(EO_SOURCE_DIR) + "/configs/models/qwen3-30b-a3b", "expert_offload=false"};
  sets.insert(sets.end(), more.begin(), more.end());
  return planned("configs/bench/qwen3-30b-a3b-offload.yaml", sets);
}

TEST(StepTime, DefaultEfficienciesAreTheH100Breakdowns) {
  const StepEfficiency made = calibrate_step_efficiency(qwen3({"micro_batch_size=4"}).work, find_card("h100"), h100_breakdown());
  const StepEfficiency given;
  std::printf("calibrated: expert %.4f other %.4f attention %.4f memory %.4f layer pass %.4g s\n", made.expert_gemm,
              made.other_gemm, made.attention, made.memory, made.layer_pass_s);
  EXPECT_NEAR(given.expert_gemm, made.expert_gemm, 0.005 * made.expert_gemm);
  EXPECT_NEAR(given.other_gemm, made.other_gemm, 0.005 * made.other_gemm);
  EXPECT_NEAR(given.attention, made.attention, 0.005 * made.attention);
  EXPECT_NEAR(given.memory, made.memory, 0.005 * made.memory);
  EXPECT_NEAR(given.layer_pass_s, made.layer_pass_s, 0.005 * made.layer_pass_s);
}

// Recorded measurements (docs/benchmarks.md; earlier commits, named there): eo-bench, synthetic NF4
// weights of the real shapes, LoRA r 16 on attention, sequence 2048.
struct Recorded {
  const char* card;
  const char* model;  // configs/models/
  int mb, accum;
  bool offload;
  double s_per_step, floor_s;  // floor: staged bytes at the pinned rate measured in that run
  const char* where;
  double vram_gib = 0;  // device_memory_limit of the run, the plan fitted to it; 0: none
  bool packed = false;  // sample_packing: eo-bench's :packed rows of four documents
  int expert_lora_r = 0;  // lora_target_parameters (gate_up_proj, down_proj) plus attention, of this rank; 0: none
};
const Recorded kRecorded[] = {
    {"h100", "qwen3-30b-a3b", 2, 1, false, 0.372, 0, "H100, f9ce426"},
    {"h100", "qwen3-30b-a3b", 4, 1, false, 0.634, 0, "H100, f9ce426"},
    {"h200", "qwen3-30b-a3b", 4, 1, false, 0.573, 0, "H200, 675ee97"},
    {"h200", "qwen3-30b-a3b", 1, 1, true, 0.617, 0.563, "H200, 675ee97"},
    {"h200", "qwen3-30b-a3b", 1, 8, false, 1.766, 0, "H200, 675ee97"},
    {"h200", "qwen3-30b-a3b", 1, 8, true, 1.774, 0.566, "H200, 675ee97"},
    {"h200", "olmoe-1b-7b", 4, 1, false, 0.180, 0, "H200, 675ee97"},
    {"h200", "olmoe-1b-7b", 4, 1, true, 0.193, 0.114, "H200, 675ee97"},
    {"h200", "gpt-oss-20b", 1, 1, true, 0.418, 0.355, "H200, 675ee97"},
    // scripts/device-expert-lora's attention-only run: 12 GiB cap, mean of steps 3 and 4.
    {"h100", "qwen3-30b-a3b", 1, 8, true, 2.028, 0, "H100, 4bf46b3", 12},
    // scripts/device-steptime at 6fef652 (2026-12-06).
    {"h100", "qwen3-30b-a3b", 2, 1, false, 0.370, 0, "H100, 6fef652"},
    {"h100", "qwen3-30b-a3b", 4, 1, false, 0.634, 0, "H100, 6fef652"},
    {"h100", "qwen3-30b-a3b", 1, 1, true, 0.624, 0, "H100, 6fef652"},
    {"h100", "qwen3-30b-a3b", 1, 8, false, 2.018, 0, "H100, 6fef652"},
    {"h100", "qwen3-30b-a3b", 1, 8, true, 2.029, 0, "H100, 6fef652"},
    {"h100", "olmoe-1b-7b", 4, 1, false, 0.198, 0, "H100, 6fef652"},
    {"h100", "olmoe-1b-7b", 4, 1, true, 0.208, 0, "H100, 6fef652"},
    {"h100", "gpt-oss-20b", 1, 1, true, 0.424, 0, "H100, 6fef652"},
    // scripts/device-steptime at 8ca6deb (2026-12-06): packed rows through flash's variable-length form.
    {"h200", "qwen3-30b-a3b", 2, 1, false, 0.329, 0, "H200, 8ca6deb"},
    {"h200", "qwen3-30b-a3b", 4, 1, false, 0.573, 0, "H200, 8ca6deb"},
    {"h200", "qwen3-30b-a3b", 4, 1, false, 0.557, 0, "H200, 8ca6deb, packed", 0, true},
    // scripts/device-expert-lora at 4a30182 (2026-12-07): attention only, and lora_target_parameters with the
    // state on the host (expert_lora_offload), 12 GiB cap, mean of steps 3 to 6.
    {"h100", "qwen3-30b-a3b", 1, 8, true, 2.030, 0, "H100, 4a30182", 12},
    {"h100", "qwen3-30b-a3b", 1, 8, true, 2.685, 0, "H100, 4a30182, experts r 32", 12, false, 32},
    {"h100", "qwen3-30b-a3b", 1, 8, true, 2.604, 0, "H100, 4a30182, experts r 16", 12, false, 16},  // the experts' LoRA fit
    {"h100", "gpt-oss-20b", 4, 1, false, 0.903, 0, "H100, 6fef652"},  // the masked kernel's fit
    // Gemma 4's rows (H200 45523aa, H100 56b42ed) measured its 512-wide full layers on SDPA's math path, which no
    // longer runs (models/attention_path.h): docs/benchmarks.md keeps them; this model does not describe that code.
};
const Recorded& kMaskedFit = kRecorded[std::size(kRecorded) - 1];
const Recorded& kExpertLoraFit = kRecorded[std::size(kRecorded) - 2];
constexpr double kPinnedGbps = 55.5;  // the H200 runs' measured pinned rate

StepTime predicted(const Recorded& r, const StepEfficiency& eff, StepWork* work_out = nullptr) {
  std::vector<std::string> sets = {
      "base_model=" + std::string(EO_SOURCE_DIR) + "/configs/models/" + r.model, std::string("expert_offload=") + (r.offload ? "true" : "false"),
      "micro_batch_size=" + std::to_string(r.mb), "gradient_accumulation_steps=" + std::to_string(r.accum),
      std::string("sample_packing=") + (r.packed ? "true" : "false")};
  if (r.expert_lora_r)
    sets.insert(sets.end(), {"lora_target_parameters=[mlp.experts.gate_up_proj, mlp.experts.down_proj]",
                             "lora_r=" + std::to_string(r.expert_lora_r), "lora_alpha=" + std::to_string(2 * r.expert_lora_r)});
  const Planned p = planned("configs/bench/qwen3-30b-a3b-offload.yaml", sets);
  StepWork work = p.work;
  if (r.vram_gib > 0) {  // as training fits it (plan --card does the same)
    const FittedPlan f = fit_plan(p.spec, r.vram_gib * 1024 * 1024 * 1024);
    work = step_work(f.spec, f.plan);
  }
  if (work_out) *work_out = work;
  return predict_step_time(work, find_card(r.card), eff);
}

TEST(StepTime, RecordedStepsWithinFifteenPercent) {
  for (const Recorded& r : kRecorded) {
    StepWork w;
    const StepTime t = predicted(r, StepEfficiency{}, &w);
    const double err = t.step_s / r.s_per_step - 1;
    std::printf("%s %s 2048x%dx%d %s: predicted %.3f s, measured %.3f s (%+.1f%%)\n", r.where, r.model, r.mb, r.accum,
                r.offload ? "offloaded" : "resident", t.step_s, r.s_per_step, 100 * err);
    EXPECT_LT(std::abs(err), 0.15) << r.where << " " << r.model << " mb " << r.mb << " g " << r.accum;
    // The plan's staged bytes are the bytes the run staged: its floor at the rate it measured.
    if (r.floor_s > 0) EXPECT_NEAR(w.staged_bytes / (kPinnedGbps * 1e9), r.floor_s, 0.02 * r.floor_s) << r.model;
  }
}

// The reverse: the same phase shares, scaled so that the H200's Qwen3-30B-A3B 2048 x 4 row is
// met exactly, predict the H100's rows (and every other H200 row).
TEST(StepTime, FittedOnTheH200PredictsTheH100) {
  const Recorded& anchor = kRecorded[2];
  const double scale = predicted(anchor, StepEfficiency{}).step_s / anchor.s_per_step;
  StepEfficiency eff;
  eff.expert_gemm *= scale;
  eff.other_gemm *= scale;
  eff.attention *= scale;
  eff.memory *= scale;
  eff.layer_pass_s /= scale;
  EXPECT_NEAR(predicted(anchor, eff).step_s, anchor.s_per_step, 1e-9);
  for (const Recorded& r : kRecorded) {
    const StepTime t = predicted(r, eff);
    const double err = t.step_s / r.s_per_step - 1;
    std::printf("fitted on the H200: %s %s 2048x%dx%d %s: predicted %.3f s (%+.1f%%)\n", r.where, r.model, r.mb, r.accum,
                r.offload ? "offloaded" : "resident", t.step_s, 100 * err);
    EXPECT_LT(std::abs(err), 0.15) << r.where << " " << r.model << " mb " << r.mb << " g " << r.accum;
  }
}

}  // namespace

namespace {

// The masked kernel's and the link's efficiencies: each the one that meets its fit row with every other phase at
// its default.
TEST(StepTime, MaskedExpertLoraAndLinkEfficienciesMeetTheirRows) {
  StepEfficiency without;
  without.masked_attention = 1e30;  // the phase costs nothing
  StepWork w;
  const double rest = predicted(kMaskedFit, without, &w).step_s;
  ASSERT_GT(w.masked_attention_flops, 0);
  ASSERT_GT(kMaskedFit.s_per_step, rest);
  const double made = w.masked_attention_flops / (find_card(kMaskedFit.card).bf16_tflops * 1e12 * (kMaskedFit.s_per_step - rest));
  std::printf("calibrated: masked %.4f\n", made);
  const StepEfficiency given;
  EXPECT_NEAR(given.masked_attention, made, 0.005 * made);
  // The experts' LoRA: its bytes over the seconds the r 16 row spends beyond the other phases.
  StepEfficiency no_lora;
  no_lora.expert_lora = 1e30;
  const double others = predicted(kExpertLoraFit, no_lora, &w).step_s;
  ASSERT_GT(w.expert_lora_bytes, 0);
  ASSERT_GT(kExpertLoraFit.s_per_step, others);
  const double lora_made =
      w.expert_lora_bytes / (find_card(kExpertLoraFit.card).mem_gbps * 1e9 * (kExpertLoraFit.s_per_step - others));
  std::printf("calibrated: experts' LoRA %.4f\n", lora_made);
  EXPECT_NEAR(given.expert_lora, lora_made, 0.005 * lora_made);
  // The link's: the transfer-bound H200 Qwen3 row's floor over its step.
  const Recorded& link_fit = kRecorded[3];
  ASSERT_GT(link_fit.floor_s, 0);
  EXPECT_NEAR(given.link, link_fit.floor_s / link_fit.s_per_step, 0.005 * given.link);
}

// Which SDPA kernel each layer runs, as the prediction counts it: plain causal attention the fused
// kernel; packed rows flash's variable-length form where it runs, else the mask; Gemma 4's sliding
// layers flash's local window where it runs, else the mask; gpt-oss's sinks and Llama 4's chunks
// (beyond one chunk) the masked kernel, and Gemma 4's 512-wide full-attention heads too (kv heads repeated).
TEST(StepTime, EachLayerRunsTheSdpaKernelItsMaskAndHeadsAllow) {
  auto paths = [](const std::string& model, std::int64_t seq, bool packed, bool flash = true) {
    const Planned p = qwen3({"base_model=" + std::string(EO_SOURCE_DIR) + "/configs/models/" + model});
    std::multiset<model::AttentionPath> out;
    for (int l = 0; l < int(p.spec.model.layers); ++l)
      if (!p.spec.model.is_linear_attention_layer(l))
        out.insert(model::attention_path(p.spec.model, l, seq, packed, flash));
    return out;
  };
  using model::AttentionPath;
  EXPECT_EQ(paths("qwen3-30b-a3b", 2048, false).count(AttentionPath::Fused), 48u);
  EXPECT_EQ(paths("qwen3-30b-a3b", 2048, true).count(AttentionPath::Varlen), 48u);
  EXPECT_EQ(paths("qwen3-30b-a3b", 2048, true, /*flash=*/false).count(AttentionPath::Masked), 48u);
  // Latent attention's keys (192 wide) and values (128) differ: flash does not take them.
  EXPECT_EQ(paths("deepseek-v2-lite", 2048, true).count(AttentionPath::Masked), 27u);
  // Qwen3-Next's gated full-attention layers (one in four) take the variable-length form.
  EXPECT_EQ(paths("qwen3-next-80b-a3b", 2048, true).count(AttentionPath::Varlen), 12u);
  EXPECT_EQ(paths("gpt-oss-20b", 2048, true).count(AttentionPath::Masked), 24u);
  // The run's log line.
  const Planned qwen = qwen3({}), oss = qwen3({"base_model=" + std::string(EO_SOURCE_DIR) + "/configs/models/gpt-oss-20b"});
  EXPECT_EQ(model::packed_attention_summary(qwen.spec.model, 2048, true),
            "48 attention layers through flash attention's variable-length form (each document causal on its own)");
  EXPECT_NE(model::packed_attention_summary(qwen.spec.model, 2048, false).find("48 attention layers through the packing "
                                                                              "mask on the memory-efficient kernel (flash's"),
            std::string::npos);
  EXPECT_NE(model::packed_attention_summary(oss.spec.model, 2048, true).find("24 attention layers through the packing mask"),
            std::string::npos);
  EXPECT_EQ(paths("gpt-oss-20b", 2048, false).count(AttentionPath::Masked), 24u);
  const auto gemma = paths("gemma-4-26b-a4b", 2048, false);
  EXPECT_EQ(gemma.count(AttentionPath::Masked), 5u);  // every sixth layer of 30 is full attention, 512 wide
  EXPECT_EQ(gemma.count(AttentionPath::Fused), 25u);  // the sliding layers: flash's local window
  EXPECT_EQ(paths("gemma-4-26b-a4b", 2048, false, /*flash=*/false).count(AttentionPath::Masked), 30u);
  EXPECT_EQ(paths("gemma-4-26b-a4b", 2048, true).count(AttentionPath::Varlen), 25u);  // windows per document
  // Llama 4 Scout: three of every four layers chunked by 8192 positions.
  EXPECT_EQ(paths("llama-4-scout-17b-16e", 8192, false).count(AttentionPath::Fused), 48u);
  EXPECT_EQ(paths("llama-4-scout-17b-16e", 16384, false).count(AttentionPath::Masked), 36u);
  // A packed step: on a card with flash attention, the variable-length form skips what the documents
  // cannot see (counted as whole rows, so no more than unpacked); on the T4, which has no flash
  // kernels, the masked kernel computes every key.
  const Planned unpacked = qwen3({"micro_batch_size=4"}), packed = qwen3({"micro_batch_size=4", "sample_packing=true"});
  EXPECT_EQ(unpacked.work.attention_flops, packed.work.attention_flops);  // the useful work is the same
  EXPECT_EQ(packed.work.flash_forms_flops, unpacked.work.fused_attention_flops);
  EXPECT_GT(packed.work.flash_forms_masked_flops, 1.9 * unpacked.work.fused_attention_flops);
  EXPECT_DOUBLE_EQ(predict_step_time(packed.work, find_card("h100")).step_s,
                   predict_step_time(unpacked.work, find_card("h100")).step_s);
  EXPECT_GT(predict_step_time(packed.work, find_card("t4")).step_s,
            predict_step_time(unpacked.work, find_card("t4")).step_s + 0.2);
  // Gemma 4's sliding layers (window 1024 at 2048): the window's keys through flash on a card with
  // it, every key through the mask on the T4.
  const Planned gemma4 = qwen3({"base_model=" + std::string(EO_SOURCE_DIR) + "/configs/models/gemma-4-26b-a4b"});
  EXPECT_GT(gemma4.work.flash_forms_flops, 0);
  EXPECT_NEAR(gemma4.work.flash_forms_masked_flops / gemma4.work.flash_forms_flops, 2048 / 768.25, 1e-9);
  EXPECT_GT(gemma4.work.masked_attention_flops, 0);  // the five 512-wide full layers
}

// Packed rows' documents as flash's variable-length form reads them: each run of one id a document
// (padding too), rows never joined, the list padded with empty documents to a power of two; an id
// that comes back later in its row is not a run, so the mask must decide.
TEST(StepTime, PackedRowsGiveFlashTheirDocumentsRunByRun) {
  const at::Tensor seg = at::tensor({1, 1, 1, 2, 2, 0, 0, 0, /*row 2*/ 5, 5, 5, 5, 5, 5, 7, 7}, at::kInt).view({2, 8});
  const at::Tensor starts = model::packed_document_starts(seg);
  ASSERT_TRUE(starts.defined());
  EXPECT_EQ(starts.scalar_type(), at::kInt);
  const std::vector<std::int32_t> want = {0, 3, 5, 8, 14, 16, 16, 16};
  EXPECT_TRUE(at::equal(starts, at::tensor(want, at::kInt))) << starts;
  // Nine documents: sixteen entries (the end, then seven empty documents).
  const at::Tensor many = model::packed_document_starts(at::arange(9, at::kInt).repeat_interleave(2).view({1, 18}));
  ASSERT_EQ(many.size(0), 16);
  EXPECT_EQ(many[8].item<int>(), 16);
  EXPECT_EQ(many[9].item<int>(), 18);
  EXPECT_EQ(many[15].item<int>(), 18);
  // Document 1 in two pieces.
  EXPECT_FALSE(model::packed_document_starts(at::tensor({1, 1, 2, 1}, at::kLong).view({1, 4})).defined());
  // The same id in two rows is two documents.
  EXPECT_EQ(model::packed_document_starts(at::ones({2, 4}, at::kInt))[1].item<int>(), 4);
}

}  // namespace
