// The step as a schedule of block uses (runtime/schedule.h, runtime/step.h) on the bundled tiny
// Qwen3-MoE, CPU fp32.
//
// References, independent of the runner: the schedule's lists are written out by hand; the
// gradients of a step are compared with plain autograd through the whole model (every block of
// every micro-batch in one graph, one backward per micro-batch), which knows nothing of schedules,
// leaf boundaries, recomputation or staging. Between the runner's own variants (layer-major or
// micro-batch-major, checkpointed or not, offloaded or resident, inputs parked on the host or not)
// the per-(block, micro-batch) work is the same, so those must agree bitwise.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <map>
#include <string>
#include <vector>

#include "models/linear4bit.h"
#include "models/moe_model.h"
#include "offload/activations.h"
#include "offload/engine.h"
#include "runtime/data/batcher.h"
#include "runtime/schedule.h"
#include "runtime/progress.h"
#include "runtime/step.h"
#include "tests/test_paths.h"

using namespace eo;

namespace {

const std::string kModel = std::string(EO_SOURCE_DIR) + "/fixtures/tiny-qwen3-moe";
constexpr int kBlocks = 4, kExperts = 8;

TEST(Schedule, LayerMajorAndMicroBatchMajorLists) {
  EXPECT_EQ(make_step_schedule(3, 2, StepOrder::LayerMajor).describe(),
            "F0:0 F0:1 F1:0 F1:1 F2:0 F2:1 L0 L1 B2:0 B2:1 B1:0 B1:1 B0:0 B0:1");
  EXPECT_EQ(make_step_schedule(3, 2, StepOrder::MicroBatchMajor).describe(),
            "F0:0 F1:0 F2:0 L0 B2:0 B1:0 B0:0 F0:1 F1:1 F2:1 L1 B2:1 B1:1 B0:1");
  // Blocks 0 and 2 are MoE. Layer-major: each staged once per direction; the top block's forward
  // and backward are one run of uses (the loss stages nothing). Micro-batch-major: once per
  // micro-batch and direction, block 0 shared across the turn between micro-batches.
  const std::vector<bool> moe{true, false, true};
  EXPECT_EQ(make_step_schedule(3, 2, StepOrder::LayerMajor).staging_order(moe), (std::vector<int>{0, 2, 0}));
  EXPECT_EQ(make_step_schedule(3, 2, StepOrder::MicroBatchMajor).staging_order(moe), (std::vector<int>{0, 2, 0, 2, 0}));
  EXPECT_EQ(make_step_schedule(3, 4, StepOrder::LayerMajor).staging_order(moe), (std::vector<int>{0, 2, 0}));
  // The last backward use of block b: where its gradients are final (DDP launches its buckets).
  const StepSchedule lm = make_step_schedule(3, 2, StepOrder::LayerMajor);
  EXPECT_EQ(lm.last_backward_use(), (std::vector<std::size_t>{13, 11, 9}));
  const StepSchedule mm = make_step_schedule(3, 2, StepOrder::MicroBatchMajor);
  EXPECT_EQ(mm.last_backward_use(), (std::vector<std::size_t>{13, 12, 11}));
  EXPECT_THROW(make_step_schedule(0, 1, StepOrder::LayerMajor), std::exception);
}

std::vector<data::MicroBatch> make_micro(int g, std::int64_t rows, std::int64_t len, bool packed) {
  at::manual_seed(123);
  std::vector<data::MicroBatch> out;
  for (int m = 0; m < g; ++m) {
    data::MicroBatch mb;
    mb.input_ids = at::randint(3, 256, {rows, len}, at::kLong);
    mb.labels = mb.input_ids.clone();
    mb.labels.select(1, 0).fill_(-100);
    mb.position_ids = at::arange(len, at::kLong).expand({rows, len}).contiguous();
    mb.segment_ids = at::zeros({rows, len}, at::kInt);
    if (packed) {  // two documents in row 0: the second restarts positions
      mb.segment_ids.select(0, 0).narrow(0, len / 2, len - len / 2).fill_(1);
      mb.position_ids.select(0, 0).narrow(0, len / 2, len - len / 2).copy_(at::arange(len - len / 2, at::kLong));
    }
    mb.num_target_tokens = (mb.labels.narrow(1, 1, len - 1) != -100).sum().item<std::int64_t>();
    out.push_back(mb);
  }
  return out;
}

struct Variant {
  bool expert_lora = true;
  double dropout = 0.0;
  bool offload = false;
  int depth = 0;  // 0: synchronous (one slot)
  int r = 4;      // 8: the grouped expert LoRA's smallest rank
};

std::unique_ptr<model::MoeModel> make_model(const Variant& s) {
  model::LoadOptions lo;
  lo.load_in_4bit = true;
  lo.experts_on_host = s.offload;
  auto m = model::MoeModel::load(kModel, lo);
  if (s.offload) {
    auto* resident = dynamic_cast<model::ResidentWeights*>(&m->weight_provider());
    offload::OffloadOptions oo;
    oo.prefetch = s.depth > 0;
    oo.prefetch_depth = std::max(1, s.depth);
    m->set_weight_provider(std::make_shared<offload::ExpertOffloader>(std::move(resident->bank()), oo));
  }
  model::LoraSpec spec;
  spec.r = s.r;
  spec.alpha = 2.0 * s.r;
  spec.dropout = s.dropout;
  spec.targets = {"q_proj", "k_proj", "v_proj", "o_proj"};
  if (s.expert_lora) spec.targets.insert(spec.targets.end(), {"gate_proj", "up_proj", "down_proj"});
  spec.seed = 7;
  m->add_lora(spec);
  // LoRA B is zero at init, which would hide every mistake in the A gradients: give it values.
  at::manual_seed(5);
  at::NoGradGuard ng;
  for (auto& [name, p] : m->lora_parameters())
    if (name.find("lora_B") != std::string::npos) p.copy_(at::randn(p.sizes()) * 0.05);
  return m;
}

using Grads = std::map<std::string, at::Tensor>;

Grads grads_of(model::MoeModel& m) {
  Grads out;
  for (auto& [name, p] : m.lora_parameters()) out[name] = p.grad().defined() ? p.grad().clone() : at::zeros_like(p);
  return out;
}

double total_tokens(const std::vector<data::MicroBatch>& micro) {
  double n = 0;
  for (const auto& mb : micro) n += double(mb.num_target_tokens);
  return n;
}

struct RunOut {
  Grads grads;
  double ce = 0, aux = 0;
  std::int64_t stage_calls = 0;
};

RunOut run_step(const Variant& s, StepOptions o, const std::vector<data::MicroBatch>& micro, int steps = 1) {
  auto m = make_model(s);
  StepRunner runner(*m, o, static_cast<int>(micro.size()), nullptr);
  RunOut out;
  at::manual_seed(99);  // the step seed is drawn from the global generator
  for (int k = 0; k < steps; ++k) {
    for (auto& [n, p] : m->lora_parameters()) p.mutable_grad() = at::Tensor();
    const StepLosses l = runner.run(micro, total_tokens(micro));
    out.ce = l.ce_sum.item<double>();
    out.aux = l.aux_sum.defined() ? l.aux_sum.item<double>() : 0;
  }
  out.grads = grads_of(*m);
  out.stage_calls = m->weight_provider().total_stage_count();
  return out;
}

// Plain autograd through the whole model, one graph per micro-batch.
RunOut reference_step(const Variant& s, const std::vector<data::MicroBatch>& micro, bool aux, double aux_coef) {
  auto m = make_model(s);
  const double global = total_tokens(micro);
  RunOut out;
  for (const auto& mb : micro) {
    model::Batch b;
    b.input_ids = mb.input_ids;
    b.positions = mb.position_ids;
    b.segment_ids = mb.segment_ids.to(at::kLong);
    std::vector<at::Tensor> router;
    model::BlockContext ctx = m->context(b, true);
    if (aux) ctx.router_logits = &router;
    at::Tensor h = m->embed(mb.input_ids);
    for (int i = 0; i < m->num_layers(); ++i) h = m->block(i).forward(h, ctx);
    const at::Tensor ce = m->loss_sum(h, mb.labels);
    at::Tensor loss = ce / global;
    if (aux) {
      const at::Tensor a = model::load_balancing_loss(router, kExperts, 2, at::Tensor());
      loss = loss + a * aux_coef;
      out.aux += a.item<double>();
    }
    loss.backward();
    out.ce += ce.item<double>();
  }
  out.grads = grads_of(*m);
  return out;
}

void expect_bitwise(const Grads& a, const Grads& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  int differing = 0;
  for (const auto& [name, g] : a) {
    ASSERT_TRUE(b.count(name)) << what << ": " << name;
    if (!at::equal(g, b.at(name)) && differing++ < 3)
      ADD_FAILURE() << what << ": " << name << " differs, max |diff| " << (g - b.at(name)).abs().max().item<double>();
  }
  EXPECT_EQ(differing, 0) << what;
}

void expect_close(const Grads& a, const Grads& ref, double rtol, const std::string& what) {
  ASSERT_EQ(a.size(), ref.size()) << what;
  double nonzero = 0;
  for (const auto& [name, g] : ref) {
    const double scale = g.abs().max().item<double>();
    nonzero += scale;
    const double err = (a.at(name) - g).abs().max().item<double>();
    EXPECT_LE(err, rtol * scale + 1e-9) << what << ": " << name << " (max |ref| " << scale << ")";
  }
  EXPECT_GT(nonzero, 0) << what << ": the reference gradients are all zero; the test would prove nothing";
}

}  // namespace

// The runner's step equals plain autograd through the whole model (no dropout: the reference
// draws its masks differently), packed rows included, with and without the router aux loss.
TEST(Step, GradientsEqualPlainAutogradThroughTheModel) {
  for (bool aux : {false, true}) {
    const auto micro = make_micro(2, 2, 16, /*packed=*/true);
    Variant s;
    StepOptions o;
    o.aux_loss = aux;
    o.aux_coef = 0.01;
    const RunOut ref = reference_step(s, micro, aux, o.aux_coef);
    for (bool ckpt : {true, false}) {
      o.checkpointing = ckpt;
      const RunOut got = run_step(s, o, micro);
      const std::string what = std::string(aux ? "aux" : "no aux") + (ckpt ? ", checkpointed" : ", plain");
      EXPECT_NEAR(got.ce, ref.ce, 1e-4 * ref.ce) << what;
      if (aux) EXPECT_NEAR(got.aux, ref.aux, 1e-5 * ref.aux) << what;
      expect_close(got.grads, ref.grads, 1e-4, what);
    }
  }
}

// The GPU's grouped expert path, run on fp32 CPU tensors (model::set_grouped_gemm_on_cpu): the
// runner's checkpointed layer-major step over two micro-batches (the recompute, the expert LoRA's
// deltas in SwiGLU and the combine, its gradients added into the masters' .grad in place across
// micro-batches) against plain autograd through the per-expert loop.
TEST(Step, TheGroupedPathOnTheCpuEqualsPlainAutogradThroughTheLoop) {
  const auto micro = make_micro(2, 2, 16, /*packed=*/true);
  Variant s;
  s.r = 8;
  const RunOut ref = reference_step(s, micro, false, 0);
  StepOptions o;
  o.order = StepOrder::LayerMajor;
  const std::int64_t banks_before = model::grouped_bank_dequantisations();
  model::set_grouped_gemm_on_cpu(true);
  const RunOut got = run_step(s, o, micro);
  model::set_grouped_gemm_on_cpu(false);
  EXPECT_GT(model::grouped_bank_dequantisations(), banks_before) << "the grouped path did not run";
  EXPECT_NEAR(got.ce, ref.ce, 1e-4 * ref.ce);
  expect_close(got.grads, ref.grads, 1e-4, "grouped on the CPU vs the loop");
}

// Layer-major and micro-batch-major orders, checkpointed or not, give bitwise the same gradients
// for g = 1, 2, 4, with LoRA dropout (each (block, micro-batch) draws its own masks) and expert LoRA.
TEST(Step, EveryOrderIsBitwiseTheSame) {
  for (int g : {1, 2, 4}) {
    const auto micro = make_micro(g, 2, 16, /*packed=*/false);
    Variant s;
    s.dropout = 0.2;
    StepOptions o;
    o.random_blocks = true;
    o.order = StepOrder::MicroBatchMajor;
    const RunOut base = run_step(s, o, micro, 2);
    o.order = StepOrder::LayerMajor;
    const RunOut layer = run_step(s, o, micro, 2);
    o.checkpointing = false;
    const RunOut plain = run_step(s, o, micro, 2);
    const std::string tag = "g=" + std::to_string(g);
    expect_bitwise(layer.grads, base.grads, tag + " layer-major vs micro-batch-major");
    expect_bitwise(plain.grads, base.grads, tag + " no checkpointing vs checkpointed");
    EXPECT_EQ(layer.ce, base.ce) << tag;
  }
}

// Dropout really is applied and really is replayed: a different step seed changes the gradients,
// while recompute vs kept graph (above) does not.
TEST(Step, DropoutMasksDependOnTheStepSeed) {
  const auto micro = make_micro(2, 2, 16, false);
  Variant s;
  s.dropout = 0.2;
  StepOptions o;
  o.random_blocks = true;
  const RunOut a = run_step(s, o, micro, 1);
  auto m = make_model(s);
  StepRunner runner(*m, o, 2, nullptr);
  at::manual_seed(100);  // another step seed
  runner.run(micro, total_tokens(micro));
  const Grads b = grads_of(*m);
  int differing = 0;
  for (const auto& [name, g] : a.grads) differing += at::equal(g, b.at(name)) ? 0 : 1;
  EXPECT_GT(differing, 0);
}

// Offloaded experts (one slot, prefetch depth 1 and 2) and host-parked block inputs give bitwise
// the resident result; each block is staged once per direction per step, whatever g is.
TEST(Step, OffloadAndActivationOffloadingAreBitwiseResident) {
  const int g = 4;
  const auto micro = make_micro(g, 2, 16, false);
  Variant s;
  s.dropout = 0.1;
  StepOptions o;
  o.random_blocks = true;
  const RunOut resident = run_step(s, o, micro, 2);
  for (int depth : {0, 1, 2}) {
    Variant so = s;
    so.offload = true;
    so.depth = depth;
    const RunOut off = run_step(so, o, micro, 2);
    expect_bitwise(off.grads, resident.grads, "offload depth " + std::to_string(depth));
    // Stagings: forward 0..3 and backward 2..0 (block 3's forward and backward are one run).
    EXPECT_EQ(off.stage_calls, 2 * (2 * kBlocks - 1)) << "depth " << depth;
  }
  StepOptions parked = o;
  parked.activation_offloading = true;
  expect_bitwise(run_step(s, parked, micro, 2).grads, resident.grads, "activation offloading");
}

// The copies one step makes: with the layer-major order each block crosses once per direction
// (the top block and, across steps, block 0 stay in a slot), independent of g.
TEST(Step, CopiesPerStepDoNotGrowWithAccumulation) {
  for (int g : {1, 4}) {
    const auto micro = make_micro(g, 1, 8, false);
    for (int depth : {0, 1}) {
      Variant s;
      s.offload = true;
      s.depth = depth;
      auto m = make_model(s);
      StepRunner runner(*m, StepOptions{}, g, nullptr);
      auto& off = dynamic_cast<offload::ExpertOffloader&>(m->weight_provider());
      std::vector<offload::OffloadStats> st;
      for (int k = 0; k < 3; ++k) {
        runner.run(micro, total_tokens(micro));
        st.push_back(off.take_step_stats());
      }
      const std::string tag = "g=" + std::to_string(g) + " depth " + std::to_string(depth);
      // One slot: 2N-1 copies in the first step (block N-1 is reused at the turn), then 2N-2 (block 0
      // is still there when the next step starts). Two slots keep one more block at each turn.
      EXPECT_EQ(st[0].copies, depth == 0 ? 2 * kBlocks - 1 : 2 * kBlocks - 2) << tag;
      EXPECT_EQ(st[1].copies, depth == 0 ? 2 * kBlocks - 2 : 2 * kBlocks - 4) << tag;
      EXPECT_EQ(st[2].copies, st[1].copies) << tag;
      EXPECT_LE(st[1].copied_bytes, 2 * off.home_bytes()) << tag;
    }
  }
}

// A stage() out of the handed-over order is refused: nothing is inferred from call patterns.
TEST(Step, OffloaderRefusesAStageOutOfSchedule) {
  Variant s;
  s.offload = true;
  s.depth = 1;
  auto m = make_model(s);
  m->weight_provider().set_schedule({0, 1, 2, 3, 2, 1, 0});
  m->weight_provider().stage(0);
  EXPECT_THROW(m->weight_provider().stage(2), std::exception);
}

// Parked inputs come back bitwise, prefetched or not, and leave the store when taken.
TEST(ActivationStore, HostRoundTripAndBookkeeping) {
  offload::ActivationStore store(at::kCPU, /*to_host=*/true);
  const at::Tensor a = at::randn({2, 3, 4}), b = at::randn({2, 3, 4});
  store.put(1, 0, a);
  store.put(1, 1, b);
  EXPECT_EQ(store.device_bytes(), 0);
  EXPECT_EQ(store.host_bytes(), 2 * a.numel() * 4);
  store.prefetch(1);
  EXPECT_EQ(store.device_bytes(), 2 * a.numel() * 4);
  EXPECT_TRUE(at::equal(store.take(1, 0), a));
  store.put(0, 0, a * 2);  // reuses the freed host buffer
  EXPECT_EQ(store.host_bytes(), 2 * a.numel() * 4);
  EXPECT_TRUE(at::equal(store.take(1, 1), b));
  EXPECT_TRUE(at::equal(store.take(0, 0), a * 2));  // not prefetched: brought back on demand
  EXPECT_THROW(store.take(0, 0), std::exception);
}

// The ETA is the mean time of the last steps (16 by default) times the steps left, so one slow
// step (an evaluation's neighbour, a host hiccup) moves it by 1/16th of its excess, not all of it.
TEST(StepProgress, EtaIsTheMeanOfTheLastStepsTimesTheStepsLeft) {
  eo::EtaWindow w(4);
  EXPECT_EQ(w.seconds_left(10), 0) << "no step yet";
  w.add(1.0);
  EXPECT_DOUBLE_EQ(w.seconds_left(10), 10.0);
  w.add(3.0);
  EXPECT_DOUBLE_EQ(w.seconds_left(10), 20.0);  // mean 2 s
  for (double t : {2.0, 2.0, 2.0, 2.0}) w.add(t);  // the first two fall out of the window of 4
  EXPECT_DOUBLE_EQ(w.seconds_left(5), 10.0);
  w.add(10.0);  // one slow step: mean (2 + 2 + 2 + 10) / 4 = 4
  EXPECT_DOUBLE_EQ(w.seconds_left(5), 20.0);
  EXPECT_EQ(w.seconds_left(0), 0) << "nothing left";
  eo::EtaWindow standard;
  for (int i = 0; i < 15; ++i) standard.add(1.0);
  standard.add(17.0);  // 16 steps: (15 + 17) / 16 = 2 s
  EXPECT_DOUBLE_EQ(standard.seconds_left(100), 200.0);
  EXPECT_EQ(eo::clock_time(3725), "1:02:05");
  EXPECT_EQ(eo::clock_time(65), "1:05");
}
