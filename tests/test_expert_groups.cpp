// Blocks streamed in groups of experts (expert_group_size; offload/engine.h, OffloadOptions::
// group_size): the engine's grouped state machine on the CPU build, the model's group-by-group
// grouped GEMMs against the whole-block ones bit for bit, and the plan that picks a group size
// for the real shapes whose blocks are larger than a card (Llama 4 Maverick, GLM-4.6).
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <filesystem>
#include <string>
#include <unistd.h>
#include <vector>

#include "common/error.h"
#include "common/text.h"
#include "models/hf_config.h"
#include "models/linear4bit.h"
#include "models/moe_model.h"
#include "models/nf4.h"
#include "offload/engine.h"
#include "offload/layout.h"
#include "runtime/config.h"
#include "runtime/plan.h"
#include "runtime/runspec.h"
#include "ref_support.h"
#include "test_paths.h"

using namespace eo;
using model::ExpertMatrix;

namespace {

constexpr int kExperts = 7;

model::ResidentWeights::Bank make_bank(int layers) {
  at::manual_seed(0);
  model::ResidentWeights::Bank bank(layers);
  for (int l = 0; l < layers; ++l) {
    bank[l].resize(kExperts);
    for (int e = 0; e < kExperts; ++e) {
      bank[l][e][0] = nf4::quantize(at::randn({24, 64}), 64, false);
      bank[l][e][1] = nf4::quantize(at::randn({24, 64}), 64, false);
      bank[l][e][2] = nf4::quantize(at::randn({64, 24}), 64, false);
    }
  }
  return bank;
}

std::vector<std::vector<std::array<at::Tensor, 3>>> reference(const model::ResidentWeights::Bank& bank) {
  std::vector<std::vector<std::array<at::Tensor, 3>>> out(bank.size());
  for (std::size_t l = 0; l < bank.size(); ++l)
    for (const auto& ex : bank[l])
      out[l].push_back({eo::dequantize(ex[0], at::kFloat), eo::dequantize(ex[1], at::kFloat), eo::dequantize(ex[2], at::kFloat)});
  return out;
}

}  // namespace

// Every expert reads back exactly through group slots, in the forward's order (up), the backward's
// (down) and any other; the slots are a group's size, two of them with prefetch; each group is
// copied once per pass in order, and a switch copies the next group in the direction of reading.
TEST(ExpertGroups, EngineReadsEveryExpertThroughGroupSlots) {
  for (int group : {1, 3, 4}) {
    for (bool prefetch : {true, false}) {
      SCOPED_TRACE("group " + std::to_string(group) + (prefetch ? ", prefetch" : ", synchronous"));
      auto bank = make_bank(3);
      const auto ref = reference(bank);
      offload::OffloadOptions oo;
      oo.group_size = group;
      oo.prefetch = prefetch;
      offload::ExpertOffloader off(std::move(bank), oo);
      const int groups = (kExperts + group - 1) / group;
      ASSERT_EQ(off.expert_group_size(), group);
      ASSERT_EQ(off.num_slots(), prefetch ? 2 : 1);
      EXPECT_LT(off.slot_bytes(), off.block_bytes(0) * off.num_slots());
      auto read = [&](int layer, int e) {
        for (int m = 0; m < 3; ++m)
          ASSERT_TRUE(at::equal(eo::dequantize(off.expert_weight(layer, e, ExpertMatrix(m)), at::kFloat), ref[layer][e][m]))
              << "layer " << layer << " expert " << e << " matrix " << m;
      };
      off.set_schedule({0, 1, 2, 2, 1, 0});
      (void)off.take_step_stats();
      for (int layer : {0, 1, 2}) {  // forward: groups upwards
        off.stage(layer);
        for (int e = 0; e < kExperts; ++e) read(layer, e);
      }
      // Each forward copies each group once; with prefetch the last switch also copied nothing
      // beyond the block (there is no next group).
      const offload::OffloadStats fwd = off.take_step_stats();
      EXPECT_EQ(fwd.copies, 3 * groups);
      EXPECT_EQ(fwd.copied_bytes, 3 * off.block_bytes(0));
      for (int layer : {2, 1, 0}) {  // recompute (up), then backward (down)
        off.stage(layer);
        for (int e = 0; e < kExperts; ++e) read(layer, e);
        for (int e = kExperts - 1; e >= 0; --e) read(layer, e);
      }
      const offload::OffloadStats back = off.take_step_stats();
      // The backward finds the recompute's last group (and with prefetch the one before) in a slot.
      // With prefetch and at most two groups, the first block of the backward (the forward's last)
      // is still in the slots: nothing is copied for it.
      const int kept = std::min(groups, prefetch ? 2 : 1), turn = prefetch && groups <= 2 ? groups : 0;
      EXPECT_EQ(back.copies, 3 * (groups + groups - kept) - turn);
      // Out of order: any expert, any time, exact.
      off.stage(0);
      for (int e : {5, 0, 6, 2, 2, 4, 1, 3}) read(0, e % kExperts);
      // Another block than the staged one cannot be read.
      EXPECT_THROW(off.expert_weight(1, 0, ExpertMatrix::Gate), eo::Error);
    }
  }
}

// A group of every expert (or more) is the whole block; the disk homes read whole blocks, so
// groups refuse them.
TEST(ExpertGroups, WholeBlocksAndDiskHomes) {
  offload::OffloadOptions oo;
  oo.group_size = kExperts;
  offload::ExpertOffloader whole(make_bank(2), oo);
  EXPECT_EQ(whole.expert_group_size(), 0);
  oo.group_size = 2;
  oo.disk = offload::DiskHomesOptions{};
  oo.disk->dir = (std::filesystem::temp_directory_path() / ("eo-groups-disk-" + std::to_string(::getpid()))).string();
  try {
    offload::ExpertOffloader off(make_bank(2), oo);
    FAIL() << "disk homes with groups were accepted";
  } catch (const eo::Error& e) {
    EXPECT_NE(std::string(e.what()).find("expert groups need the homes in host RAM"), std::string::npos) << e.what();
  }
}

namespace {

struct StepResult {
  std::vector<at::Tensor> outputs;  // per block: its output, its input's gradient
  std::vector<std::pair<std::string, at::Tensor>> grads;
};

// Forward and backward of the tiny Qwen3-MoE with NF4 experts and LoRA on attention and the
// experts (fused parameters, or per expert), on the resident store or offloaded in groups of
// `group` (0: resident); `grouped_gemm`: the GPU's grouped path on fp32 CPU tensors, else the loop.
StepResult step(int group, bool grouped_gemm, bool fused_lora,
               const std::string& dir = std::string(EO_SOURCE_DIR) + "/fixtures/tiny-qwen3-moe") {
  model::LoadOptions lo;
  lo.load_in_4bit = true;
  auto m = model::MoeModel::load(dir, lo);
  at::manual_seed(1);
  model::LoraSpec spec;
  spec.r = 8;  // a multiple of 8: the expert LoRA runs as grouped GEMMs too
  spec.alpha = 16;
  spec.targets = {"o_proj"};  // every family has it (DeepSeek's latent attention has no q_proj)
  if (fused_lora)
    spec.target_parameters = {model::kGateUpParam, model::kDownParam};
  else
    spec.targets.insert(spec.targets.end(), {"gate_proj", "up_proj", "down_proj"});
  m->add_lora(spec);
  {  // B nonzero too, so every factor has a gradient (the same values in every run: one seed, one order)
    c10::NoGradGuard ng;
    for (auto& [name, p] : m->lora_parameters()) p.normal_(0, 0.1);
  }
  if (group > 0) {
    offload::OffloadOptions oo;
    oo.group_size = group;
    auto& bank = static_cast<model::ResidentWeights&>(m->weight_provider()).bank();
    m->set_weight_provider(std::make_shared<offload::ExpertOffloader>(std::move(bank), oo));
  }
  model::Batch b;
  at::manual_seed(2);
  b.input_ids = at::randint(0, m->config().vocab, {2, 12}, at::kLong);
  model::set_grouped_gemm_on_cpu(grouped_gemm);
  const std::int64_t banks = model::grouped_bank_dequantisations();
  // Block by block, each staged and then run forward and backward at once (as a checkpointed
  // step's recompute and backward): every block's output and input gradient, and the LoRA's.
  const model::BlockContext ctx = m->context(b, /*training=*/true);
  at::Tensor h = m->embed(b.input_ids).detach();
  StepResult r;
  for (int i = 0; i < m->num_layers(); ++i) {
    const at::Tensor x = h.detach().requires_grad_(true);
    if (m->block(i).is_moe()) m->weight_provider().stage(i);
    const at::Tensor y = m->block(i).forward(x, ctx);
    at::manual_seed(10 + i);
    (y * at::randn_like(y)).sum().backward();
    r.outputs.push_back(y.detach());
    r.outputs.push_back(x.grad());
    h = y.detach();
  }
  model::set_grouped_gemm_on_cpu(false);
  EXPECT_EQ(model::grouped_bank_dequantisations() > banks, grouped_gemm) << "the grouped path ran: " << !grouped_gemm;
  for (const auto& [name, p] : m->lora_parameters()) r.grads.emplace_back(name, p.grad().defined() ? p.grad().clone() : at::Tensor());
  return r;
}

// Bit for bit, or (tolerance > 0) within that relative distance.
bool near(const at::Tensor& a, const at::Tensor& b, double tolerance) {
  if (tolerance == 0) return a.equal(b);
  return (a - b).abs().max().item<double>() <= tolerance * a.abs().max().item<double>();
}

void expect_same(const StepResult& a, const StepResult& b, double tolerance = 0) {
  ASSERT_EQ(a.outputs.size(), b.outputs.size());
  for (std::size_t i = 0; i < a.outputs.size(); ++i)
    EXPECT_TRUE(near(a.outputs[i], b.outputs[i], tolerance))
        << "block " << i / 2 << (i % 2 ? " input gradient" : " output") << ": max |diff| "
        << (a.outputs[i] - b.outputs[i]).abs().max().item<double>() << " of " << a.outputs[i].abs().max().item<double>();
  ASSERT_EQ(a.grads.size(), b.grads.size());
  int expert_grads = 0;
  for (std::size_t i = 0; i < a.grads.size(); ++i) {
    SCOPED_TRACE(a.grads[i].first);
    ASSERT_TRUE(a.grads[i].second.defined());
    ASSERT_TRUE(b.grads[i].second.defined());
    EXPECT_TRUE(near(a.grads[i].second, b.grads[i].second, tolerance));
    EXPECT_GT(a.grads[i].second.abs().sum().item<double>(), 0);
    expert_grads += a.grads[i].first.find("experts") != std::string::npos ? 1 : 0;
  }
  EXPECT_GT(expert_grads, 0);
}

}  // namespace

// Group by group equals the whole block bit for bit: every block's output and input gradient and
// every LoRA gradient, on the
// grouped GEMM path (group-local offsets, the LoRA over all rows) and on the per-expert loop, for
// groups of 1, of 3 (not dividing 8 experts) and of 4, with the fused and the per-expert LoRA.
TEST(ExpertGroups, GroupByGroupEqualsTheWholeBlockBitwise) {
  for (bool grouped_gemm : {true, false})
    for (bool fused : {true, false}) {
      const StepResult whole = step(0, grouped_gemm, fused);
      for (int group : {1, 3, 4}) {
        SCOPED_TRACE(std::string(grouped_gemm ? "grouped GEMMs" : "per-expert loop") + (fused ? ", fused LoRA" : ", per-expert LoRA") +
                     ", groups of " + std::to_string(group));
        expect_same(whole, step(group, grouped_gemm, fused));
      }
    }
}

// The same for the families whose grouped path does more per group: gpt-oss (expert biases by each
// row's expert, the clamped activation on the formed sums), Llama 4 (the router's weight on the
// expert input), Gemma 4 (GELU, a dense MLP beside), DeepSeek-V3 and Qwen3-Next (shared experts).
// Gemma 4's grouped path on the CPU only to 1e-5 of the largest element: its tiny experts' rows are
// 24 wide, and ATen's CPU elementwise loops compute the elements past the last full SIMD chunk with
// the scalar function (GELU's tanh: another last bit), so a group's slice rounds a few elements
// differently from the whole tensor. Which elements fall in the tail depends on the CPU's vector
// width, and three blocks' backward carried those last bits to 2e-6 on a CI machine. A
// wrong group (rows or offsets) differs by the order of the values themselves. A GPU kernel
// computes every element alike; the CPU's per-expert loop, what CPU training runs, is bitwise.
TEST(ExpertGroups, GroupByGroupEqualsTheWholeBlockForOtherFamilies) {
  for (const char* arch : {"gpt_oss", "llama4", "gemma4", "deepseek_v3", "qwen3_next"}) {
    const std::string dir = eo::testing::python_fixture("model_ref.py", "model_ref", arch) + "/model";
    for (bool grouped_gemm : {true, false}) {
      const StepResult whole = step(0, grouped_gemm, true, dir);
      const double tolerance = grouped_gemm && std::string(arch) == "gemma4" ? 1e-5 : 0;
      for (int group : {1, 3}) {
        SCOPED_TRACE(std::string(arch) + (grouped_gemm ? ", grouped GEMMs" : ", per-expert loop") + ", groups of " +
                     std::to_string(group));
        expect_same(whole, step(group, grouped_gemm, true, dir), tolerance);
      }
    }
  }
}

namespace {

RunSpec real_shape(const std::string& model, const std::vector<std::string>& extra = {}) {
  std::vector<std::string> sets = {"base_model=" + std::string(EO_SOURCE_DIR) + "/configs/models/" + model,
                                   "expert_offload=true", "sequence_len=2048", "micro_batch_size=1",
                                   "lora_r=16", "lora_alpha=32", "lora_dropout=0",
                                   "lora_target_modules=[q_proj, k_proj, v_proj, o_proj]"};
  sets.insert(sets.end(), extra.begin(), extra.end());
  ConfigLoadOptions lo;
  lo.check_files = false;
  const TrainConfig cfg = load_config_file(std::string(EO_SOURCE_DIR) + "/configs/tiny-qwen3-moe.yaml", sets, lo);
  return resolve_run_spec(cfg, model::load_config(cfg.base_model), Compute::Bf16, /*on_gpu=*/true, 1);
}

}  // namespace

// Llama 4 Maverick (8.44 GiB NF4 experts a block, 10 GiB dequantised) with attention LoRA at a
// 24 GiB cap: whole blocks do not fit; the plan picks the largest group that does, its peak at
// most 22 GiB, and says so. GLM-4.6 (1.98 GiB a block) fits whole once the recompute keeps only
// the down projection's bank (expert_bank_reuse: auto -> down, tried first); with all three banks
// kept (expert_bank_reuse: all) it needs groups, and gets them.
TEST(ExpertGroups, RealShapesLargerThanACardPlanAGroup) {
  const double cap = 24.0 * (1ull << 30), most = 22.0 * (1ull << 30);
  auto expect_grouped = [&](const RunSpec& spec) {
    ASSERT_TRUE(spec.group_auto);
    const MemoryPlan whole = plan_memory(spec);
    EXPECT_GT(whole.device_peak + whole.margin, cap) << describe_plan(whole, cap);
    const FittedPlan f = fit_plan(spec, cap);
    EXPECT_GT(f.grouped_from, 0);
    const int g = f.spec.group_size;
    ASSERT_GT(g, 0);
    ASSERT_LT(g, spec.model.experts);
    EXPECT_EQ(f.plan.group_size, g);
    EXPECT_LE(f.plan.device_peak, most) << describe_plan(f.plan, cap);
    EXPECT_LE(f.plan.device_peak + f.plan.margin, cap) << describe_plan(f.plan, cap);
    // The largest such group: the next larger one tried (twice the size) does not fit.
    RunSpec larger = f.spec;
    larger.group_size = static_cast<int>(std::min<std::int64_t>(spec.model.experts, 2 * g));
    if (larger.group_size < spec.model.experts) {
      const MemoryPlan p = plan_memory(larger);
      EXPECT_GT(p.device_peak + p.margin, cap) << describe_plan(p, cap);
    }
    // Slots and bank are a group's: the slot is the layout's group range, the bank g experts.
    EXPECT_EQ(f.plan.slot_bytes, double(offload::expert_group_bytes(spec.model, spec.blocksize, spec.double_quant,
                                                                     f.plan.expert_format, g)));
    const std::string text = describe_plan(f.plan, cap);
    EXPECT_NE(text.find("each a group of " + std::to_string(g) + " of a block's " + std::to_string(spec.model.experts) + " experts"),
              std::string::npos) << text;
    EXPECT_NE(text.find("(a group of " + std::to_string(g) + " experts)"), std::string::npos) << text;
    EXPECT_NE(text.find("fits a 24.00 GiB card"), std::string::npos) << text;
  };
  {
    SCOPED_TRACE("Llama 4 Maverick");
    expect_grouped(real_shape("llama-4-maverick-17b-128e"));
  }
  {
    SCOPED_TRACE("GLM-4.6");
    const FittedPlan auto_fit = fit_plan(real_shape("glm-4.6"), cap);
    EXPECT_EQ(auto_fit.spec.group_size, 0);
    EXPECT_GT(auto_fit.down_from, 0);
    EXPECT_LE(auto_fit.plan.device_peak, most) << describe_plan(auto_fit.plan, cap);
    EXPECT_LE(auto_fit.plan.device_peak + auto_fit.plan.margin, cap);
    expect_grouped(real_shape("glm-4.6", {"expert_bank_reuse=all"}));
  }
  // Forced: expert_group_size: N is planned as asked; whole never groups.
  const RunSpec forced = real_shape("llama-4-maverick-17b-128e", {"expert_group_size=16"});
  EXPECT_EQ(forced.group_size, 16);
  EXPECT_FALSE(forced.group_auto);
  EXPECT_EQ(plan_memory(forced).group_size, 16);
  const RunSpec whole = real_shape("llama-4-maverick-17b-128e", {"expert_group_size=whole"});
  EXPECT_EQ(fit_plan(whole, cap).spec.group_size, 0);
}

// The group's bytes: the layout's ranges, the last group shorter where the size does not divide.
TEST(ExpertGroups, GroupBytesFollowTheArenaLayout) {
  model::ModelConfig c;
  c.hidden = 64;
  c.expert_width = 24;
  c.experts = 7;
  const std::int64_t block = offload::expert_block_bytes(c, 64, false);
  EXPECT_EQ(offload::expert_group_bytes(c, 64, false, QuantFormat::Nf4, 7), block);
  EXPECT_EQ(offload::expert_group_bytes(c, 64, false, QuantFormat::Nf4, 1) * 7, block);  // every expert the same span
  EXPECT_EQ(offload::expert_group_bytes(c, 64, false, QuantFormat::Nf4, 3), 3 * (block / 7));
  // The engine's slots are exactly that size.
  offload::OffloadOptions oo;
  oo.group_size = 3;
  offload::ExpertOffloader off(make_bank(1), oo);
  EXPECT_EQ(off.slot_bytes(), 2 * offload::expert_group_bytes(c, 64, false, QuantFormat::Nf4, 3));
}
