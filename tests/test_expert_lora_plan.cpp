// The plan's expert-LoRA terms (expert_lora_offload) follow from the code's own sizes: the host
// state and the device's working copies the plan counts are what ExpertLoraOffload holds on a
// loaded model; the rule between parameters and bytes is expert_lora_bytes, checked by hand; and
// the staging rule those bytes assume (two blocks at most, gradients travelling with the block).
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "models/hf_config.h"
#include "models/moe_model.h"
#include "runtime/config.h"
#include "runtime/expert_lora_offload.h"
#include "runtime/plan.h"
#include "runtime/runspec.h"
#include "test_paths.h"

namespace {

using namespace eo;

const MemoryPart& part(const MemoryPlan& p, const std::string& name) {
  for (const auto& m : p.device)
    if (m.name == name) return m;
  throw std::runtime_error("no plan part " + name);
}

TrainConfig tiny(const std::vector<std::string>& sets) {
  std::vector<std::string> all = {"base_model=" + std::string(EO_SOURCE_DIR) + "/fixtures/tiny-qwen3-moe",
                                  "expert_offload=true", "lora_dropout=0",
                                  "lora_target_modules=[q_proj, k_proj, v_proj, o_proj]"};
  all.insert(all.end(), sets.begin(), sets.end());
  return load_config_file(std::string(EO_SOURCE_DIR) + "/configs/tiny-qwen3-moe.yaml", all);
}

// The plan of `cfg` and what the code holds for it: the LoRA added to the loaded tiny model, its
// experts' share taken to the host.
void expect_plan_matches_code(const TrainConfig& cfg) {
  const model::ModelConfig mc = model::load_config(cfg.base_model);
  const RunSpec spec = resolve_run_spec(cfg, mc, Compute::Fp32, /*on_gpu=*/false, 1);
  ASSERT_TRUE(spec.expert_lora_offload);
  const MemoryPlan plan = plan_memory(spec);
  RunSpec kept = spec;
  kept.expert_lora_offload = false;
  const MemoryPlan device_plan = plan_memory(kept);

  model::LoadOptions lo;
  lo.load_in_4bit = true;
  auto m = model::MoeModel::load(cfg.base_model, lo);
  m->add_lora(spec.lora);
  double all_params = 0;
  for (const auto& [n, p] : m->lora_parameters()) all_params += double(p.numel());
  ExpertLoraOffload held(*m, at::kCPU, false, cfg);
  double host_params = 0;
  for (const auto& [n, p] : held.params()) host_params += double(p.numel());
  ASSERT_GT(host_params, 0);

  EXPECT_EQ(plan.expert_lora_params, host_params);
  EXPECT_EQ(plan.host_lora, double(held.host_bytes()));
  EXPECT_EQ(plan.host_lora, host_params * 16);  // master, gradient, exp_avg, exp_avg_sq in fp32
  // Resident: every parameter x 16 bytes; offloaded: the rest x 16 + the working copies.
  EXPECT_EQ(part(device_plan, "lora").bytes, all_params * 16);
  EXPECT_EQ(part(plan, "lora").bytes, (all_params - host_params) * 16 + double(held.device_bytes()));
  EXPECT_EQ(double(held.device_bytes()), kExpertLoraWorkingCopies * double(held.block_params_max()) * 8);
  EXPECT_EQ(double(held.block_params_max()) * double(spec.moe_layers.size()), host_params);
  EXPECT_LT(plan.device_peak, device_plan.device_peak);
  EXPECT_NE(describe_plan(plan, 0).find("host LoRA"), std::string::npos) << describe_plan(plan, 0);
  EXPECT_EQ(describe_plan(device_plan, 0).find("host LoRA"), std::string::npos);
}

TEST(ExpertLoraPlan, FusedParametersFollowTheCode) {
  expect_plan_matches_code(tiny({"lora_target_parameters=[mlp.experts.gate_up_proj, mlp.experts.down_proj]"}));
}

TEST(ExpertLoraPlan, PerExpertModulesFollowTheCode) {
  expect_plan_matches_code(tiny({"lora_target_modules=[q_proj, v_proj, gate_proj, up_proj, down_proj]"}));
}

TEST(ExpertLoraPlan, OffOrNotApplicable) {
  const model::ModelConfig mc = model::load_config(std::string(EO_SOURCE_DIR) + "/fixtures/tiny-qwen3-moe");
  const auto on = [&](const std::vector<std::string>& sets) {
    return resolve_run_spec(tiny(sets), mc, Compute::Fp32, false, 1).expert_lora_offload;
  };
  const std::string fused = "lora_target_parameters=[mlp.experts.gate_up_proj]";
  EXPECT_TRUE(on({fused}));
  EXPECT_FALSE(on({fused, "expert_lora_offload=false"}));
  EXPECT_FALSE(on({fused, "expert_offload=false"}));
  EXPECT_FALSE(on({}));  // attention only: nothing on the experts
  // While it is on, the step's uses cannot replay as CUDA graphs, and the spec says why.
  EXPECT_NE(resolve_run_spec(tiny({fused}), mc, Compute::Bf16, true, 1).graphs_blocked.find("expert_lora_offload"),
            std::string::npos);
}

// The real shapes (configs/models/qwen3-30b-a3b), counted by hand: 48 MoE layers of 128 experts,
// hidden 2048, expert width 768; gate_up_proj's ParamWrapper A [r·E, 2048] B [1536, r·E], down_proj's
// A [r·E, 768] B [2048, r·E]: r·128·(2048 + 1536 + 768 + 2048) per layer.
TEST(ExpertLoraPlan, Qwen3ThirtyBHostLora) {
  const std::string dir = std::string(EO_SOURCE_DIR) + "/configs/models/qwen3-30b-a3b";
  const model::ModelConfig mc = model::load_config(dir);
  for (const int r : {16, 32}) {
    TrainConfig cfg = tiny({"lora_r=" + std::to_string(r), "lora_alpha=32", "sequence_len=2048", "micro_batch_size=1",
                            "gradient_accumulation_steps=8",
                            "lora_target_parameters=[mlp.experts.gate_up_proj, mlp.experts.down_proj]"});
    cfg.base_model = dir;
    const MemoryPlan plan = plan_memory(resolve_run_spec(cfg, mc, Compute::Bf16, true, 1));
    const double params = 48.0 * r * 128 * (2048 + 1536 + 768 + 2048);
    EXPECT_EQ(plan.expert_lora_params, params);
    EXPECT_EQ(plan.host_lora, params * 16);
    EXPECT_NEAR(plan.host_lora / double(1 << 30), r == 16 ? 9.375 : 18.75, 1e-9);
  }
}

}  // namespace

namespace {

// The staging rule the plan counts: at most kExpertLoraWorkingCopies blocks' working copies at once,
// the least recent leaving first and taking its gradient home; a block staged again brings that
// gradient back; flush() leaves every block on its host master.
TEST(ExpertLoraOffload, WorkingCopiesAndGradientsTravelWithTheBlock) {
  const TrainConfig cfg = tiny({"lora_target_parameters=[mlp.experts.gate_up_proj, mlp.experts.down_proj]"});
  model::LoadOptions lo;
  lo.load_in_4bit = true;
  auto m = model::MoeModel::load(cfg.base_model, lo);
  m->add_lora(lora_spec(cfg));
  ExpertLoraOffload held(*m, at::kCPU, false, cfg);
  ASSERT_GE(m->num_layers(), 3);
  auto leaf = [&](int layer) { return m->expert_loras(layer).front()->A(); };
  auto on_device = [&](int layer) { return !held.holds(leaf(layer)); };
  std::vector<at::Tensor> masters;  // unstaged, a block reads its host master
  for (int l = 0; l < m->num_layers(); ++l) masters.push_back(leaf(l));
  auto master = [&](int layer) { return masters.at(static_cast<std::size_t>(layer)); };
  for (int l = 0; l < m->num_layers(); ++l) EXPECT_FALSE(on_device(l)) << l;
  held.stage(0);
  held.stage(1);
  EXPECT_TRUE(on_device(0) && on_device(1));
  EXPECT_TRUE(leaf(0).equal(master(0)) && leaf(0).requires_grad());
  leaf(1).mutable_grad() = at::full_like(leaf(1), 3.0);
  held.stage(1);  // already there: nothing moves
  held.stage(2);  // block 0, the least recent, leaves without a gradient
  EXPECT_FALSE(on_device(0));
  EXPECT_FALSE(master(0).grad().defined());
  held.stage(0);  // block 1 leaves with its gradient
  EXPECT_FALSE(on_device(1));
  ASSERT_TRUE(master(1).grad().defined());
  EXPECT_TRUE(master(1).grad().equal(at::full_like(master(1), 3.0)));
  held.stage(1);  // ... and brings it back
  ASSERT_TRUE(leaf(1).grad().defined());
  EXPECT_TRUE(leaf(1).grad().equal(at::full_like(master(1), 3.0)));
  int staged = 0;
  for (int l = 0; l < m->num_layers(); ++l) staged += on_device(l);
  EXPECT_EQ(staged, kExpertLoraWorkingCopies);
  held.flush();
  for (int l = 0; l < m->num_layers(); ++l) EXPECT_FALSE(on_device(l)) << l;
}

}  // namespace
