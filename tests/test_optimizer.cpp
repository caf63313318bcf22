// The optimizer step against independent references: torch's own AdamW (libtorch's
// torch::optim::AdamW, the implementation this one replaced), float64 gradient norms, and
// transformers' get_scheduler (tests/ref/lr_schedule_ref.py).
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/optim/adamw.h>

#include <cstdio>
#include <limits>
#include <map>
#include <sstream>

#include "models/lora.h"
#include "runtime/config.h"
#include "runtime/loss_scale.h"
#include "runtime/optimizer.h"
#include "tests/grad_scaler_rule.h"
#include "tests/test_paths.h"

using namespace eo;

namespace {

NamedTensors make_params(std::uint64_t seed) {
  at::manual_seed(seed);
  NamedTensors p;
  p.emplace_back("m.layers.0.self_attn.q_proj.lora_A.weight", at::randn({7, 5}));
  p.emplace_back("m.layers.0.input_layernorm.weight", at::randn({6}));  // "norm": no decay
  p.emplace_back("m.layers.0.mlp.experts.up_proj.lora_B.stacked", at::randn({3, 4, 8}));
  p.emplace_back("m.layers.1.self_attn.o_proj.bias", at::randn({5}));  // "bias": no decay
  for (auto& [n, t] : p) t.requires_grad_(true);
  return p;
}

NamedTensors clone_params(const NamedTensors& src) {
  NamedTensors out;
  for (const auto& [n, t] : src) out.emplace_back(n, t.detach().clone().requires_grad_(true));
  return out;
}

// The same gradients on both sides; parameter `skip` gets none at this step.
void set_grads(const std::vector<NamedTensors*>& sides, int step, int skip) {
  at::manual_seed(1000 + step);
  for (std::size_t i = 0; i < sides[0]->size(); ++i) {
    const at::Tensor g = at::randn_like((*sides[0])[i].second) * (0.1 + step);
    for (auto* s : sides) (*s)[i].second.mutable_grad() = static_cast<int>(i) == skip ? at::Tensor() : g.clone();
  }
}

double max_rel(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>() / b.abs().max().item<double>();
}

TrainConfig adam_config() {
  TrainConfig cfg;
  cfg.learning_rate = 1e-2;
  cfg.weight_decay = 0.1;
  cfg.adam_beta1 = 0.9;
  cfg.adam_beta2 = 0.95;
  cfg.adam_epsilon = 1e-8;
  return cfg;
}

}  // namespace

// The fused multi-tensor AdamW follows torch's AdamW over several steps with a changing lr, two
// decay groups and a parameter without a gradient (skipped by both). Not bitwise: the fused
// kernel rounds p·(1 - lr·wd) and the moment updates in another order; the difference stays at a
// few ulps of fp32 (2e-6 relative after 8 steps, where one lr·wd or moment rounding is ~6e-8).
TEST(Optimizer, FusedAdamWFollowsTorchAdamW) {
  const TrainConfig cfg = adam_config();
  NamedTensors mine = make_params(1), theirs = clone_params(mine);
  Optimizer opt(mine, cfg);
  std::vector<at::Tensor> decay, plain;
  for (const auto& [n, t] : theirs)
    (n.find("norm") != std::string::npos || n.find("bias") != std::string::npos ? plain : decay).push_back(t);
  auto o = torch::optim::AdamWOptions(cfg.learning_rate).betas({cfg.adam_beta1, cfg.adam_beta2}).eps(cfg.adam_epsilon).weight_decay(cfg.weight_decay);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(o));
  auto o2 = std::make_unique<torch::optim::AdamWOptions>(o);
  o2->weight_decay(0.0);
  groups.emplace_back(plain, std::move(o2));
  torch::optim::AdamW ref(groups, o);
  const at::Tensor untouched = mine[1].second.detach().clone();
  for (int step = 0; step < 8; ++step) {
    const double lr = cfg.learning_rate * (1.0 - step / 10.0);
    set_grads({&mine, &theirs}, step, step == 0 ? 1 : (step == 3 ? 2 : -1));
    opt.step(lr);
    for (auto& g : ref.param_groups()) static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr);
    ref.step();
    if (step == 0) EXPECT_TRUE(mine[1].second.equal(untouched)) << "no gradient: no step, no decay";
    for (std::size_t i = 0; i < mine.size(); ++i)
      EXPECT_LT(max_rel(mine[i].second, theirs[i].second), 2e-6) << mine[i].first << " after step " << step;
  }
  // The moments too, and the step counts (the skipped parameters are one step behind).
  std::map<std::string, at::Tensor> st;
  for (const auto& [n, t] : opt.state()) st[n] = t;
  for (std::size_t i = 0; i < mine.size(); ++i) {
    const auto& s = static_cast<torch::optim::AdamWParamState&>(*ref.state().at(theirs[i].second.unsafeGetTensorImpl()));
    EXPECT_LT(max_rel(st.at(mine[i].first + ".exp_avg"), s.exp_avg()), 2e-6) << mine[i].first;
    EXPECT_LT(max_rel(st.at(mine[i].first + ".exp_avg_sq"), s.exp_avg_sq()), 2e-6) << mine[i].first;
    EXPECT_EQ(st.at(mine[i].first + ".step").item<double>(), double(s.step())) << mine[i].first;
  }
  // And zero_grad drops the gradients.
  opt.zero_grad();
  for (const auto& [n, t] : mine) EXPECT_FALSE(t.grad().defined()) << n;
}

// state() / load_state(): a run resumed from the saved state continues bitwise like the original.
TEST(Optimizer, ResumedStateContinuesBitwise) {
  const TrainConfig cfg = adam_config();
  NamedTensors a = make_params(2);
  Optimizer oa(a, cfg);
  for (int step = 0; step < 3; ++step) {
    set_grads({&a}, step, step == 1 ? 0 : -1);
    oa.step(1e-2);
  }
  NamedTensors b = clone_params(a);
  Optimizer ob(b, cfg);
  std::map<std::string, at::Tensor> saved;
  for (const auto& [n, t] : oa.state()) saved[n] = t.clone();
  ob.load_state(saved);
  for (int step = 3; step < 6; ++step) {
    set_grads({&a, &b}, step, -1);
    oa.step(1e-2);
    ob.step(1e-2);
  }
  for (std::size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(a[i].second.equal(b[i].second)) << a[i].first;
}

// A step decided on the device: skip = 1 leaves parameters, moments and step counts bitwise as
// they were (even with NaN gradients); skip = 0 is a plain step, bitwise: the optimizer that saw
// two skipped steps ends bitwise equal to a twin that never saw them.
TEST(Optimizer, DeviceDecidedSkipChangesNothingAndZeroIsAPlainStep) {
  const TrainConfig cfg = adam_config();
  NamedTensors a = make_params(4), b = clone_params(a);
  Optimizer oa(a, cfg), ob(b, cfg);
  auto snapshot = [](const NamedTensors& p, const Optimizer& o) {
    std::vector<at::Tensor> out;
    for (const auto& [n, t] : p) out.push_back(t.detach().clone());
    for (const auto& [n, t] : o.state()) out.push_back(t.clone());
    return out;
  };
  const at::Tensor skip = at::ones({}, at::kFloat), go = at::zeros({}, at::kFloat);
  for (int step = 0; step < 5; ++step) {
    set_grads({&a, &b}, step, -1);
    if (step == 2 || step == 3) {
      // b sees a non-finite step: NaN gradients, skipped on the device; a sees nothing.
      for (auto& [n, t] : b) t.mutable_grad().fill_(std::numeric_limits<float>::quiet_NaN());
      const auto before = snapshot(b, ob);
      ob.step(1e-2, skip);
      const auto after = snapshot(b, ob);
      ASSERT_EQ(before.size(), after.size());
      for (std::size_t i = 0; i < before.size(); ++i)
        EXPECT_TRUE(before[i].equal(after[i])) << "a skipped step changed tensor " << i << " at step " << step;
      continue;
    }
    oa.step(1e-2);
    ob.step(1e-2, go);
  }
  for (std::size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(a[i].second.equal(b[i].second)) << a[i].first;
  const auto sa = oa.state(), sb = ob.state();
  ASSERT_EQ(sa.size(), sb.size());
  for (std::size_t i = 0; i < sa.size(); ++i) EXPECT_TRUE(sa[i].second.equal(sb[i].second)) << sa[i].first;
  for (const auto& [n, t] : sb)
    if (n.size() > 5 && n.compare(n.size() - 5, 5, ".step") == 0) EXPECT_EQ(t.item<double>(), 3.0) << n << ": 3 applied steps";
}

// The trainer's stop (issue #32 item 6): state_nonfinite is 1 when any parameter or either AdamW
// moment holds a NaN or an Inf, each poisoned in turn after a healthy step, and 0 otherwise. A
// NaN moment is checked itself: it reaches the parameters only at the next update, after a save.
TEST(Optimizer, StateNonfiniteSeesEveryParameterAndEveryMoment) {
  const TrainConfig cfg = adam_config();
  const float bad[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                       -std::numeric_limits<float>::infinity()};
  {
    NamedTensors p = make_params(6);
    Optimizer o(p, cfg);
    EXPECT_EQ(o.state_nonfinite().item<double>(), 0.0) << "before any step";
    at::NoGradGuard ng;
    p[2].second.view(-1).narrow(0, 5, 1).fill_(bad[0]);
    EXPECT_EQ(o.state_nonfinite().item<double>(), 1.0) << "a NaN parameter before any step";
  }
  for (const char* which : {"param", ".exp_avg", ".exp_avg_sq"})
    for (const float v : bad)
      for (std::size_t i : {std::size_t{0}, std::size_t{3}}) {
        NamedTensors p = make_params(7);
        Optimizer o(p, cfg);
        set_grads({&p}, 0, -1);
        o.step(1e-2);
        ASSERT_EQ(o.state_nonfinite().item<double>(), 0.0) << "a healthy step";
        at::Tensor target;
        if (std::string(which) == "param") {
          target = p[i].second;
        } else {
          for (const auto& [n, t] : o.state())
            if (n == p[i].first + which) target = t;  // state() hands out the optimizer's own tensors
        }
        ASSERT_TRUE(target.defined()) << p[i].first << which;
        at::NoGradGuard ng;
        target.view(-1).narrow(0, target.numel() - 1, 1).fill_(v);
        EXPECT_EQ(o.state_nonfinite().item<double>(), 1.0) << v << " in " << p[i].first << " " << which << " unnoticed";
      }
}

// Clipping inside AdamW's read (clip_divisor as the fused kernel's grad_scale) against clipping
// the gradients first (clip_grad_norm_on_device, torch's clip_grad_norm_): the same parameters
// and moments to fp32 rounding (g / (1/c) against g · c, one ulp of the gradient), bitwise where
// no clipping applies (divisor 1), and a non-finite norm clips nothing.
TEST(Optimizer, ClippingInsideTheStepEqualsClippingTheGradientsFirst) {
  const TrainConfig cfg = adam_config();
  for (const double max_norm : {0.5, 1e9}) {
    SCOPED_TRACE("max_norm " + std::to_string(max_norm));
    NamedTensors a = make_params(5), b = clone_params(a);
    Optimizer oa(a, cfg), ob(b, cfg);
    std::vector<at::Tensor> pa, pb;
    for (auto& [n, t] : a) pa.push_back(t);
    for (auto& [n, t] : b) pb.push_back(t);
    for (int step = 0; step < 4; ++step) {
      set_grads({&a, &b}, step, step == 2 ? 1 : -1);
      const at::Tensor norm_a = clip_grad_norm_on_device(pa, max_norm);
      oa.step(1e-2);
      const at::Tensor norm_b = grad_norm_on_device(pb);
      EXPECT_TRUE(norm_a.equal(norm_b));
      const at::Tensor divisor = clip_divisor(norm_b, max_norm);
      EXPECT_EQ(divisor.scalar_type(), at::kFloat);
      if (max_norm > 1e8) EXPECT_EQ(divisor.item<double>(), 1.0);
      else EXPECT_GT(divisor.item<double>(), 1.0) << "these gradients exceed 0.5";
      ob.step(1e-2, at::Tensor(), divisor);
    }
    const auto sa = oa.state(), sb = ob.state();
    ASSERT_EQ(sa.size(), sb.size());
    for (std::size_t i = 0; i < a.size(); ++i) {
      if (max_norm > 1e8) EXPECT_TRUE(a[i].second.equal(b[i].second)) << a[i].first;
      else EXPECT_LT(max_rel(b[i].second.detach(), a[i].second.detach()), 2e-6) << a[i].first;
    }
    for (std::size_t i = 0; i < sa.size(); ++i) {
      if (max_norm > 1e8) EXPECT_TRUE(sa[i].second.equal(sb[i].second)) << sa[i].first;
      else EXPECT_LT(max_rel(sb[i].second, sa[i].second), 2e-6) << sa[i].first;
    }
  }
  const at::Tensor inf = at::full({}, std::numeric_limits<double>::infinity(), at::kDouble);
  EXPECT_EQ(clip_divisor(inf, 1.0).item<double>(), 1.0);
  EXPECT_EQ(clip_divisor(at::full({}, 3.0, at::kDouble), 0.0).item<double>(), 1.0) << "max_grad_norm 0: no clipping";
  EXPECT_NEAR(clip_divisor(at::full({}, 4.0, at::kDouble), 2.0).item<double>(), (4.0 + 1e-6) / 2.0, 1e-6);
}

// A checkpoint written before expert LoRA was stacked names the optimizer state per expert; it
// is stacked on load (the same values, the step of the experts).
TEST(Optimizer, LoadsPerExpertStateOfOlderCheckpoints) {
  const TrainConfig cfg = adam_config();
  NamedTensors a = make_params(3);
  Optimizer oa(a, cfg);
  for (int step = 0; step < 2; ++step) {
    set_grads({&a}, step, -1);
    oa.step(1e-2);
  }
  // The old form: every state tensor of the stacked parameter as its per-expert slices.
  std::map<std::string, at::Tensor> old;
  for (const char* sfx : {".exp_avg", ".exp_avg_sq", ".step"})
    for (const auto& [n, t] : oa.state()) {
      const std::string s = sfx;
      if (n.size() <= s.size() || n.compare(n.size() - s.size(), s.size(), s) != 0) continue;
      const std::string base = n.substr(0, n.size() - s.size());
      if (base.find(".stacked") == std::string::npos) {
        old[n] = t;
        continue;
      }
      const at::Tensor stacked = s == ".step" ? t.expand({3, 1}) : t;  // one step per expert
      for (const auto& [pn, pt] : model::peft_lora_tensors({{base, stacked}})) old[pn + s] = pt.clone();
    }
  ASSERT_TRUE(old.count("m.layers.0.mlp.experts.2.up_proj.lora_B.weight.exp_avg"));
  NamedTensors b = clone_params(a);
  Optimizer ob(b, cfg);
  ob.load_state(old);
  const auto sa = oa.state(), sb = ob.state();
  ASSERT_EQ(sa.size(), sb.size());
  for (std::size_t i = 0; i < sa.size(); ++i) {
    EXPECT_EQ(sa[i].first, sb[i].first);
    EXPECT_TRUE(sa[i].second.equal(sb[i].second)) << sa[i].first;
  }
}

// Gradient clipping: the norm of ~1k tensors equals float64 over every element (1e-6 relative;
// per-tensor fp32 norms, combined in fp64), clipping scales every gradient by exactly
// max_norm / (norm + 1e-6) in fp32, and a norm under max_norm leaves the gradients untouched.
TEST(ClipGradNorm, EqualsFloat64NormAndScalesLikeTorch) {
  at::manual_seed(7);
  std::vector<at::Tensor> params;
  for (int i = 0; i < 1000; ++i) {
    at::Tensor p = at::zeros({1 + (i * 37) % 300, 1 + i % 7}).requires_grad_(true);
    if (i % 13 != 5) p.mutable_grad() = at::randn_like(p) * (1.0 + i % 5);  // some without a gradient
    params.push_back(p);
  }
  double sq = 0;
  std::vector<at::Tensor> before;
  for (const auto& p : params) {
    before.push_back(p.grad().defined() ? p.grad().clone() : at::Tensor());
    if (p.grad().defined()) sq += p.grad().to(at::kDouble).pow(2).sum().item<double>();
  }
  const double want = std::sqrt(sq);
  const double big = clip_grad_norm(params, 1e9);
  EXPECT_NEAR(big, want, 1e-6 * want);
  for (std::size_t i = 0; i < params.size(); ++i)
    if (before[i].defined()) EXPECT_TRUE(params[i].grad().equal(before[i])) << "no clipping below max_norm";
  const double norm = clip_grad_norm(params, 1.0);
  EXPECT_EQ(norm, big);
  const double coef = 1.0 / (norm + 1e-6);
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (!before[i].defined()) {
      EXPECT_FALSE(params[i].grad().defined());
      continue;
    }
    EXPECT_TRUE(params[i].grad().equal(before[i] * coef)) << "tensor " << i;
  }
  EXPECT_EQ(clip_grad_norm({at::zeros({3}).requires_grad_(true)}, 1.0), 0.0) << "no gradient at all";
}

// lr_multiplier against transformers' get_scheduler, every schedule, with and without warm-up.
TEST(LrSchedule, MatchesTransformersGetScheduler) {
  const std::string cmd = std::string(EO_PYTHON) + " " + EO_SOURCE_DIR + "/tests/ref/lr_schedule_ref.py 3:10 0:7 4:4 2>/dev/null";
  FILE* f = popen(cmd.c_str(), "r");
  ASSERT_NE(f, nullptr);
  std::string text;
  char buf[4096];
  while (std::size_t n = fread(buf, 1, sizeof buf, f)) text.append(buf, n);
  ASSERT_EQ(pclose(f), 0) << cmd << "\n" << text;
  std::istringstream in(text);
  std::string name;
  std::int64_t warmup = 0, total = 0, step = 0;
  double want = 0;
  int lines = 0;
  while (in >> warmup >> total >> name >> step >> want) {
    ++lines;
    EXPECT_NEAR(lr_multiplier(name, step, warmup, total), want, 1e-12)
        << name << " step " << step << " warmup " << warmup << " total " << total;
  }
  EXPECT_EQ(lines, 4 * (12 + 9 + 6)) << text;
  // The facts behind it: constant ignores warm-up; constant_with_warmup starts at 0.
  EXPECT_EQ(lr_multiplier("constant", 0, 5, 10), 1.0);
  EXPECT_EQ(lr_multiplier("constant_with_warmup", 0, 5, 10), 0.0);
}

namespace {

// What the LossScaler multiplies each step's loss by, for one overflow flag per step.
std::vector<double> scaler_scales(const std::string& flags, std::int64_t interval, eo::LossScaler& s) {
  std::vector<double> used;
  for (char f : flags) {
    used.push_back(s.scale().item<double>());
    s.update(at::full({}, f == '1' ? 1.0 : 0.0, at::kFloat));
  }
  return used;
}
}  // namespace

// fp16's loss scale: its decisions (back off, grow) step by step are torch.amp.GradScaler's,
// checked against GradScaler itself (tests/ref/grad_scaler_ref.py) and against the rule in float64;
// the state a checkpoint keeps continues the sequence exactly.
TEST(LossScaler, MatchesTorchGradScaler) {
  std::string long_flags(4100, '0');
  long_flags[4] = long_flags[5] = long_flags[2500] = '1';  // growth after 2000 clean steps, twice
  const std::vector<std::pair<std::int64_t, std::string>> cases = {
      {3, "0110001000000100000011111000"}, {1, "0001101"}, {2000, long_flags}};
  for (const auto& [interval, flags] : cases) {
    const std::string cmd = std::string(EO_PYTHON) + " " + EO_SOURCE_DIR + "/tests/ref/grad_scaler_ref.py " +
                            std::to_string(interval) + " " + flags + " 2>&1";
    FILE* f = popen(cmd.c_str(), "r");
    ASSERT_NE(f, nullptr);
    std::string text;
    char buf[4096];
    while (std::size_t n = fread(buf, 1, sizeof buf, f)) text.append(buf, n);
    ASSERT_EQ(pclose(f), 0) << cmd.substr(0, 200) << "\n" << text.substr(0, 2000);
    std::istringstream in(text);
    std::vector<double> torch_used;
    std::string word;
    double torch_final = 0;
    std::int64_t torch_tracker = -1;
    while (in >> word) {
      if (word == "final") {
        in >> torch_final >> torch_tracker;
        break;
      }
      double s = 0;
      in >> s;
      torch_used.push_back(s);
    }
    double ref_final = 0;
    std::int64_t ref_tracker = 0;
    const std::vector<double> ref = eo::testing::grad_scaler_scales(flags, interval, &ref_final, &ref_tracker);
    eo::LossScaler scaler(true, at::kCPU, interval);
    const std::vector<double> got = scaler_scales(flags, interval, scaler);
    ASSERT_EQ(torch_used.size(), flags.size()) << text.substr(0, 2000);
    for (std::size_t i = 0; i < flags.size(); ++i) {
      ASSERT_EQ(got[i], torch_used[i]) << "interval " << interval << " step " << i + 1;
      ASSERT_EQ(got[i], ref[i]) << "interval " << interval << " step " << i + 1;
    }
    const nlohmann::json st = scaler.state();
    EXPECT_EQ(st.at("loss_scale").get<double>(), torch_final);
    EXPECT_EQ(st.at("loss_scale_growth_tracker").get<std::int64_t>(), torch_tracker);
    EXPECT_EQ(torch_final, ref_final);
    EXPECT_EQ(torch_tracker, ref_tracker);
  }
  // Resume: a scaler restored from the state continues as the one that wrote it; disabled, it has
  // no scale and no state.
  eo::LossScaler a(true, at::kCPU, 3), b(true, at::kCPU, 3);
  scaler_scales("0100", 3, a);
  b.load_state(a.state());
  EXPECT_EQ(scaler_scales("00001", 3, a), scaler_scales("00001", 3, b));
  EXPECT_EQ(a.state(), b.state());
  const eo::LossScaler off(false, at::kCPU, 3);
  EXPECT_FALSE(off.enabled());
  EXPECT_TRUE(off.state().empty());
}
