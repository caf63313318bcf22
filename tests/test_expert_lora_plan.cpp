// The plan's expert-LoRA terms (expert_lora_offload) follow from the code's own sizes: the host
// state and the device's working copies the plan counts are what ExpertLoraOffload holds on a
// loaded model; the rule between parameters and bytes is expert_lora_bytes, checked by hand; and
// the staging rule those bytes assume (two blocks at most, gradients travelling with the block).
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <map>
#include <set>

#include "models/hf_config.h"
#include "models/moe_model.h"
#include "models/weights.h"
#include "runtime/config.h"
#include "runtime/data/batcher.h"
#include "runtime/expert_lora_offload.h"
#include "runtime/optimizer.h"
#include "runtime/plan.h"
#include "runtime/runspec.h"
#include "runtime/schedule.h"
#include "runtime/step.h"
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
  EXPECT_EQ(double(held.device_bytes()), kExpertLoraWorkingCopies * double(held.block_params_max()) * 16);
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
  // It leaves the step's uses free to replay as CUDA graphs (its working copies keep their
  // addresses), and the plan then counts the graphs' buffers.
  const RunSpec graphed = resolve_run_spec(tiny({fused}), mc, Compute::Bf16, true, 1);
  ASSERT_TRUE(graphed.expert_lora_offload);
  EXPECT_EQ(graphed.graphs_blocked, "");
  const MemoryPlan plan = plan_memory(graphed);
  EXPECT_TRUE(std::any_of(plan.device.begin(), plan.device.end(),
                          [](const MemoryPart& m) { return m.name == "graphs"; }));
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

// The tiny model as training loads it (NF4 base) with cfg's LoRA added.
std::unique_ptr<model::MoeModel> nf4_model_with_lora(const TrainConfig& cfg) {
  model::LoadOptions lo;
  lo.load_in_4bit = true;
  auto m = model::MoeModel::load(cfg.base_model, lo);
  m->add_lora(lora_spec(cfg));
  return m;
}

// The staging rule the plan counts: at most kExpertLoraWorkingCopies blocks' working copies at once,
// the least recent leaving first and taking its gradient home; a block staged again brings that
// gradient back before its backward; flush() leaves every block on its host master.
TEST(ExpertLoraOffload, WorkingCopiesAndGradientsTravelWithTheBlock) {
  const TrainConfig cfg = tiny({"lora_target_parameters=[mlp.experts.gate_up_proj, mlp.experts.down_proj]"});
  auto m = nf4_model_with_lora(cfg);
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
  EXPECT_FALSE(leaf(1).grad().defined());  // the forward has no gradient to carry
  held.before_backward(1);
  ASSERT_TRUE(leaf(1).grad().defined());
  EXPECT_TRUE(leaf(1).grad().equal(at::zeros_like(master(1))));
  at::Tensor g = leaf(1).grad();
  g.add_(3.0);  // as a backward accumulates: in place
  held.stage(1);  // already there: nothing moves
  EXPECT_TRUE(leaf(1).grad().is_same(g));
  held.stage(2);  // block 0, the least recent, leaves without a gradient
  EXPECT_FALSE(on_device(0));
  EXPECT_FALSE(master(0).grad().defined());
  held.stage(0);  // block 1 leaves with its gradient
  EXPECT_FALSE(on_device(1));
  ASSERT_TRUE(master(1).grad().defined());
  EXPECT_TRUE(master(1).grad().equal(at::full_like(master(1), 3.0)));
  held.stage(1);  // ... and brings it back for its next backward
  EXPECT_FALSE(leaf(1).grad().defined());
  held.before_backward(1);
  ASSERT_TRUE(leaf(1).grad().defined());
  EXPECT_TRUE(leaf(1).grad().equal(at::full_like(master(1), 3.0)));
  int staged = 0;
  for (int l = 0; l < m->num_layers(); ++l) staged += on_device(l);
  EXPECT_EQ(staged, kExpertLoraWorkingCopies);
  held.flush();
  for (int l = 0; l < m->num_layers(); ++l) EXPECT_FALSE(on_device(l)) << l;
  EXPECT_TRUE(master(1).grad().equal(at::full_like(master(1), 3.0)));
  // A gradient that a backward left without before_backward() would be lost at eviction: refused.
  held.stage(2);
  m->expert_loras(2).front()->A().mutable_grad() = at::ones_like(master(2));
  EXPECT_THROW(held.flush(), std::exception);
}

// The update a step records runs block by block as each block is next staged, and is the resident
// Optimizer's, bit for bit: before a block's stage() its host master is the old one, its working
// copy afterwards the updated one; the state check brings in the rest, after which masters and
// optimizer state (under Optimizer::state's names) equal an Optimizer's over the same gradients. An
// update that leaves NaN in the state is reported by its check.
TEST(ExpertLoraOffload, EachBlocksUpdateRunsWhenItIsNextStagedAsTheResidentOptimizers) {
  const TrainConfig cfg = tiny({"lora_target_parameters=[mlp.experts.gate_up_proj, mlp.experts.down_proj]",
                                "weight_decay=0.1", "max_grad_norm=0.5"});
  auto m = nf4_model_with_lora(cfg);
  ExpertLoraOffload held(*m, at::kCPU, false, cfg);
  const int n = m->num_layers();
  ASSERT_GE(n, 2);
  NamedTensors copies;  // the resident optimizer's parameters: the masters as they start
  for (const auto& [name, t] : held.params()) copies.emplace_back(name, t.clone());
  Optimizer resident(copies, cfg);
  const auto leaves = [&](int layer) {
    std::vector<at::Tensor> out;
    for (const auto& l : m->expert_loras(layer))
      for (const at::Tensor* t : {&l->A(), &l->B()}) out.push_back(*t);
    return out;
  };
  const auto backward = [&](bool with_nan) {  // one step's gradients, the same on both sides
    for (int l = 0; l < n; ++l) {  // each block's gradient home, as a backward leaves it
      held.stage(l);
      held.before_backward(l);
    }
    held.flush();
    at::manual_seed(7);
    std::size_t k = 0;
    for (const auto& [name, master] : held.params()) {
      at::Tensor g = at::randn(master.sizes());
      if (with_nan && k == 0) g.fill_(NAN);
      master.grad().copy_(g);
      copies[k++].second.mutable_grad() = g.clone();
    }
  };
  const at::Tensor skip = at::zeros({}), divisor = at::full({}, 1.5f);
  double bytes = 0, bytes0 = 0;  // every leaf's fp32 bytes, block 0's
  for (const auto& [name, t] : held.params()) bytes += double(t.nbytes());
  for (const at::Tensor& leaf : leaves(0)) bytes0 += double(leaf.nbytes());
  const double counters0 = 4.0 * double(leaves(0).size());
  EXPECT_EQ(held.take_step_stats().h2d_bytes, 0);
  backward(false);
  // The first step: masters up, gradients home.
  const auto first_step = held.take_step_stats();
  EXPECT_EQ(double(first_step.h2d_bytes), bytes);
  EXPECT_EQ(double(first_step.d2h_bytes), bytes);
  std::vector<at::Tensor> before;
  std::vector<std::size_t> first;  // layer 0's leaves, in leaves(0)'s order, by their index in params()
  for (const at::Tensor& leaf : leaves(0))
    for (std::size_t k = 0; k < held.params().size(); ++k)
      if (leaf.is_same(held.params()[k].second)) first.push_back(k);
  for (const auto& [name, master] : held.params()) before.push_back(master.clone());
  ASSERT_EQ(first.size(), leaves(0).size());
  const auto check = held.step(1e-2, skip, divisor);
  resident.step(1e-2, skip, divisor);
  for (std::size_t k = 0; k < before.size(); ++k) EXPECT_TRUE(held.params()[k].second.equal(before[k])) << k << ": not deferred";
  held.stage(0);
  // Block 0's update: master, both moments, gradient and counters up; master, moments, counters home.
  const auto update0 = held.take_step_stats();
  EXPECT_EQ(double(update0.h2d_bytes), 4 * bytes0 + counters0);
  EXPECT_EQ(double(update0.d2h_bytes), 3 * bytes0 + counters0);
  const std::vector<at::Tensor> staged = leaves(0);
  for (std::size_t j = 0; j < first.size(); ++j) {
    const std::size_t k = first[j];
    EXPECT_TRUE(staged[j].equal(copies[k].second)) << held.params()[k].first << ": not the updated value";
    EXPECT_FALSE(before[k].equal(copies[k].second));
  }
  for (const at::Tensor& leaf : leaves(n - 1)) EXPECT_TRUE(held.holds(leaf)) << "a later block moved before its stage()";
  held.flush();
  EXPECT_EQ(check(), 0);
  for (std::size_t k = 0; k < copies.size(); ++k)
    EXPECT_TRUE(held.params()[k].second.equal(copies[k].second)) << held.params()[k].first;
  std::map<std::string, at::Tensor> ours;
  for (auto& [name, t] : held.optimizer_state()) ours[name] = t;
  const NamedTensors theirs = resident.state();
  ASSERT_EQ(ours.size(), theirs.size());
  for (const auto& [name, t] : theirs) {
    ASSERT_TRUE(ours.count(name)) << name;
    EXPECT_TRUE(ours[name].equal(t)) << name;
  }
  backward(true);
  EXPECT_EQ(held.step(1e-2, skip, divisor)(), 1) << "a NaN gradient's update went unreported";
}

// On one rank the step's norm is the device's: each leaf's norm taken as its gradient leaves the
// slot, the last time in the step being its whole gradient (a block taken home and brought back
// adds to it), combined in the model's order as grad_norm_on_device combines the same gradients.
TEST(ExpertLoraOffload, OneRanksNormIsTakenAsTheGradientsLeave) {
  const TrainConfig cfg = tiny({"lora_target_parameters=[mlp.experts.gate_up_proj, mlp.experts.down_proj]"});
  auto m = nf4_model_with_lora(cfg);
  ExpertLoraOffload held(*m, at::kCPU, false, cfg, /*ranks=*/1);
  ASSERT_TRUE(held.norms_on_device());
  const int n = m->num_layers();
  at::manual_seed(3);
  const auto backward = [&](int l) {
    held.stage(l);
    held.before_backward(l);
    for (const auto& e : m->expert_loras(l))
      for (const at::Tensor* t : {&e->A(), &e->B()}) t->grad().add_(at::randn(t->sizes()));
  };
  for (int l = n - 1; l >= 0; --l) backward(l);
  backward(n - 1);  // block n-1 left with part of its gradient and brings it back
  held.flush();
  std::vector<at::Tensor> masters;
  for (const auto& [name, t] : held.params()) masters.push_back(t);
  const at::Tensor ours = held.grad_norm(held.params(), {});
  EXPECT_TRUE(ours.equal(grad_norm_on_device(masters))) << ours.item<double>() << " vs "
                                                        << grad_norm_on_device(masters).item<double>();
  ExpertLoraOffload across(*nf4_model_with_lora(cfg), at::kCPU, false, cfg, /*ranks=*/2);
  EXPECT_FALSE(across.norms_on_device());
}

// A step that fails midway (a fault, a device error) leaves blocks staged and the update of the
// step before partly applied; the trainer still reports that step (OneStepBehind), whose check must
// then answer without throwing. The next step's flush() and apply_update() finish it.
TEST(ExpertLoraOffload, AStepFailingMidwayStillLetsTheStepBeforeBeReported) {
  const TrainConfig cfg = tiny({"lora_target_parameters=[mlp.experts.gate_up_proj, mlp.experts.down_proj]"});
  auto m = nf4_model_with_lora(cfg);
  ExpertLoraOffload held(*m, at::kCPU, false, cfg);
  ASSERT_GE(m->num_layers(), 2);
  for (int l = 0; l < m->num_layers(); ++l) {
    held.stage(l);
    held.before_backward(l);
    m->expert_loras(l).front()->A().grad().fill_(1.0);
  }
  held.flush();
  const auto check = held.step(1e-2, at::zeros({}), at::ones({}));
  held.stage(0);  // the next step's first block, then the failure
  double flag = -1;
  EXPECT_NO_THROW(flag = check());
  EXPECT_EQ(flag, 0);
  held.flush();
  EXPECT_NO_THROW(held.apply_update());
  EXPECT_FALSE(held.optimizer_state().empty());
}

// The experts' provider under the LoRA's wrapper: one placement for every staged block.
class StubExperts : public model::WeightProvider {
 public:
  const QuantizedWeight& expert_weight(int, int, model::ExpertMatrix) override { throw std::runtime_error("unused"); }
  std::int64_t placement(int) override { return 1; }

 protected:
  void stage_block(int) override {}
};

// What a CUDA graph of a use captured must hold at its next replay: every stint of a block reads
// its working copies and adds into their gradients at the addresses of the step before, and the
// placement token (the graph's key) is equal exactly where those addresses are. Three steps of
// the step runner's schedule (runtime/schedule.h, g = 2), staged as StepRunner stages them, every
// leaf of every stint kept alive (so fresh allocations could never land on an old address), the
// masters changed between steps as an update would: each stint reads the current masters, each
// backward finds the gradient of the block's earlier backward uses of the step (micro-batch-
// major: taken home and brought back), and the step's gradient comes home whole. `scheduled`: the
// staging order handed over first, so each stage() also copies the next block ahead (then it is
// in a slot before its own stage(); without a schedule, only where it never left).
void expect_stable_working_copies(StepOrder order, bool scheduled) {
  const TrainConfig cfg = tiny({"lora_target_parameters=[mlp.experts.gate_up_proj, mlp.experts.down_proj]"});
  auto m = nf4_model_with_lora(cfg);
  ExpertLoraOffload held(*m, at::kCPU, false, cfg);
  const auto provider = held.wrap(std::make_shared<StubExperts>());
  const int n = m->num_layers(), g = 2;
  ASSERT_GE(n, 3);
  const StepSchedule schedule = make_step_schedule(n, g, order);
  const std::vector<int> staging = schedule.staging_order(std::vector<bool>(static_cast<std::size_t>(n), true));
  if (scheduled) provider->set_schedule(staging);

  struct Use {
    std::int64_t placement = 0;
    std::vector<const void*> values, grads;
  };
  std::vector<std::map<std::string, Use>> steps;
  std::vector<at::Tensor> kept;
  std::vector<std::vector<at::Tensor>> masters(static_cast<std::size_t>(n));  // the step's, by layer
  std::vector<int> backwards(static_cast<std::size_t>(n));                  // the step's so far, by layer
  auto record = [&](std::map<std::string, Use>& uses, const std::string& key, int layer, bool backward) {
    Use u;
    u.placement = provider->placement(layer);
    std::size_t k = 0;
    for (const auto& l : m->expert_loras(layer))
      for (const at::Tensor* t : {&l->A(), &l->B()}) {
        EXPECT_FALSE(held.holds(*t)) << key << ": reads its host master";
        EXPECT_TRUE(t->equal(masters[layer].at(k++))) << key << ": not this step's master";
        u.values.push_back(t->data_ptr());
        kept.push_back(*t);
        if (backward) {
          ASSERT_TRUE(t->grad().defined()) << key;
          EXPECT_TRUE(t->grad().equal(at::full_like(*t, backwards[layer])))
              << key << ": not the step's gradient so far";
          u.grads.push_back(t->grad().data_ptr());
          kept.push_back(t->grad());
          t->grad().add_(1.0);  // the backward, in place
        }
      }
    if (backward) ++backwards[layer];
    uses[key] = u;
  };
  for (int step = 0; step < 3; ++step) {
    std::map<std::string, Use> uses;
    for (int l = 0; l < n; ++l) {  // unstaged, the leaves are the masters
      masters[l].clear();
      for (const auto& e : m->expert_loras(l))
        for (const at::Tensor* t : {&e->A(), &e->B()}) masters[l].push_back(t->clone());
      backwards[l] = 0;
    }
    int last = -1;
    std::size_t position = 0;  // in `staging`
    for (const BlockUse& u : schedule.uses) {
      if (u.kind == BlockUse::Kind::Loss) continue;
      const std::string key = std::string(u.kind == BlockUse::Kind::Forward ? "F" : "B") + std::to_string(u.block) +
                              ":" + std::to_string(u.micro);
      if (u.block != last) {  // as StepRunner::run stages
        last = u.block;
        provider->stage(u.block);
        ++position;
        // Unscheduled, the slots hold this block and the one staged before it.
        const int before = position >= 2 ? staging[position - 2] : -1;
        if (position < staging.size()) {
          const int next = staging[position];
          EXPECT_EQ(held.slot_of(next) >= 0, scheduled || next == before)
              << key << ": block " << next << " copied ahead";
        }
      }
      if (u.kind == BlockUse::Kind::Backward) provider->before_backward(u.block);
      record(uses, key, u.block, u.kind == BlockUse::Kind::Backward);
    }
    held.flush();
    at::NoGradGuard ng;
    for (const auto& [name, master] : held.params()) {
      ASSERT_TRUE(master.grad().defined()) << name;
      EXPECT_TRUE(master.grad().equal(at::full_like(master, g))) << name << ": step " << step;
      master.mutable_grad() = at::Tensor();  // the update drops them
      master.add_(0.5);                      // ... and moves the masters
    }
    steps.push_back(std::move(uses));
  }
  std::set<const void*> slots;  // the first leaf's address of every use
  for (int step = 1; step < 3; ++step)
    for (const auto& [key, u] : steps[0]) {
      const Use& v = steps[step].at(key);
      EXPECT_EQ(v.placement, u.placement) << key << " at step " << step;
      EXPECT_EQ(v.values, u.values) << key << " at step " << step << ": its working copies moved";
      EXPECT_EQ(v.grads, u.grads) << key << " at step " << step << ": its gradients moved";
    }
  for (const auto& [key, u] : steps[0]) slots.insert(u.values.front());
  EXPECT_EQ(slots.size(), std::size_t(kExpertLoraWorkingCopies));
  // Equal tokens exactly where the addresses are equal (a graph keyed by the token replays on its
  // addresses), for every pair of uses of a block.
  for (const auto& [k1, u1] : steps[0])
    for (const auto& [k2, u2] : steps[0])
      if (k1.substr(1, k1.find(':')) == k2.substr(1, k2.find(':')))
        EXPECT_EQ(u1.placement == u2.placement, u1.values == u2.values) << k1 << " " << k2;
  // Neighbours take different slots, so the forward/backward turn copies nothing.
  EXPECT_NE(steps[0].at("F0:0").values.front(), steps[0].at("F1:0").values.front());
}

TEST(ExpertLoraOffload, WorkingCopiesKeepTheirAddressesStepAfterStep) {
  expect_stable_working_copies(StepOrder::LayerMajor, false);
  expect_stable_working_copies(StepOrder::MicroBatchMajor, false);
}

TEST(ExpertLoraOffload, CopiedAheadAlongTheScheduleAtTheSameAddresses) {
  expect_stable_working_copies(StepOrder::LayerMajor, true);
  expect_stable_working_copies(StepOrder::MicroBatchMajor, true);
}

// The experts of an end-to-end run (the model's own, resident), and at each stage() of a block
// whether its LoRA was in a slot already: the wrapper stages the experts first, then the LoRA.
class StagingRecorder : public model::WeightProvider {
 public:
  StagingRecorder(model::ResidentWeights::Bank bank, const ExpertLoraOffload& lora)
      : experts_(std::move(bank)), lora_(lora) {}
  const QuantizedWeight& expert_weight(int layer, int expert, model::ExpertMatrix m) override {
    return experts_.expert_weight(layer, expert, m);
  }
  std::vector<std::pair<int, bool>> stagings;  // (layer, its LoRA already in a slot)

 protected:
  void stage_block(int layer) override { stagings.emplace_back(layer, lora_.slot_of(layer) >= 0); }

 private:
  model::ResidentWeights experts_;
  const ExpertLoraOffload& lora_;
};

// Through the step runner, which hands over its schedule as the trainer's does: every stage() of
// a step but its first finds the block's LoRA in a slot already (copied ahead while the block
// before computed), layer- and micro-batch-major, and flush() then brings every gradient home.
TEST(ExpertLoraOffload, TheStepRunnersScheduleCopiesEveryBlockAhead) {
  const TrainConfig cfg = tiny({"lora_target_parameters=[mlp.experts.gate_up_proj, mlp.experts.down_proj]"});
  auto m = nf4_model_with_lora(cfg);
  {  // B is zero at init, which would leave every A without a gradient
    at::manual_seed(5);
    at::NoGradGuard ng;
    for (auto& [name, p] : m->lora_parameters())
      if (name.find("lora_B") != std::string::npos) p.copy_(at::randn(p.sizes()) * 0.05);
  }
  ExpertLoraOffload held(*m, at::kCPU, false, cfg);
  auto* resident = dynamic_cast<model::ResidentWeights*>(&m->weight_provider());
  ASSERT_NE(resident, nullptr);
  const auto recorder = std::make_shared<StagingRecorder>(std::move(resident->bank()), held);
  m->set_weight_provider(held.wrap(recorder));
  at::manual_seed(3);
  std::vector<data::MicroBatch> micro(2);
  double tokens = 0;
  for (auto& mb : micro) {
    mb.input_ids = at::randint(3, m->config().vocab, {2, 16}, at::kLong);
    mb.labels = mb.input_ids.clone();
    mb.position_ids = at::arange(16, at::kLong).expand({2, 16}).contiguous();
    mb.segment_ids = at::zeros({2, 16}, at::kInt);
    tokens += double(mb.num_target_tokens = 2 * 15);
  }
  for (const StepOrder order : {StepOrder::LayerMajor, StepOrder::MicroBatchMajor}) {
    StepOptions o;
    o.order = order;
    StepRunner runner(*m, o, static_cast<int>(micro.size()), nullptr);
    for (int step = 0; step < 2; ++step) {
      const std::string what = std::string(order == StepOrder::LayerMajor ? "layer" : "micro-batch") +
                               "-major step " + std::to_string(step);
      recorder->stagings.clear();
      runner.run(micro, tokens);
      held.flush();
      ASSERT_GE(recorder->stagings.size(), std::size_t(2 * m->num_layers() - 1)) << what;
      EXPECT_FALSE(recorder->stagings.front().second) << what << ": the slots start free";
      for (std::size_t k = 1; k < recorder->stagings.size(); ++k)
        EXPECT_TRUE(recorder->stagings[k].second)
            << what << ", stage " << k << " (layer " << recorder->stagings[k].first << "): not copied ahead";
      at::NoGradGuard ng;
      for (const auto& [name, master] : held.params()) {
        ASSERT_TRUE(master.grad().defined()) << what << ": " << name;
        EXPECT_GT(master.grad().abs().sum().item<double>(), 0) << what << ": " << name;
        master.mutable_grad() = at::Tensor();  // as the update drops them
      }
    }
  }
}

}  // namespace
