// The compute pieces behind the fast GPU path, checked on the CPU against independent math:
// the chunked language-model loss (float64 reference), synthetic real-shaped models, and the
// memory plan's weight term against the bytes a loaded model really holds.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include <filesystem>
#include <fstream>

#include "models/hf_config.h"
#include "models/linear4bit.h"
#include "models/lm_loss.h"
#include "models/moe_model.h"
#include "runtime/config.h"
#include "runtime/plan.h"

namespace fs = std::filesystem;
using namespace eo;
using namespace eo::model;

namespace {

const std::string kTiny = std::string(EO_SOURCE_DIR) + "/fixtures/tiny-qwen3-moe";

// float64: Σ_valid logsumexp(h W^T) - (h W^T)[target], and its gradient wrt h.
std::pair<double, at::Tensor> reference_ce(const at::Tensor& h, const at::Tensor& w, const at::Tensor& t) {
  at::Tensor h64 = h.detach().to(at::kDouble).requires_grad_(true);
  const at::Tensor logits = at::matmul(h64, w.to(at::kDouble).t());
  const at::Tensor loss = at::cross_entropy_loss(logits, t, {}, at::Reduction::Sum, -100);
  torch::autograd::backward({loss});
  return {loss.item<double>(), h64.grad()};
}

}  // namespace

TEST(ChunkedCrossEntropy, MatchesFloat64ForAnyChunkSize) {
  at::manual_seed(3);
  const std::int64_t N = 37, H = 24, V = 101;
  const at::Tensor w = at::randn({V, H}) * 0.3;
  at::Tensor t = at::randint(0, V, {N}, at::kLong);
  t.index_put_({at::arange(0, N, 5)}, -100);  // some ignored rows
  const at::Tensor h0 = at::randn({N, H});
  const auto [ref_loss, ref_grad] = reference_ce(h0, w, t);
  for (std::int64_t chunk : {1, 4, 16, 37, 0}) {
    at::Tensor h = h0.clone().requires_grad_(true);
    const at::Tensor loss = chunked_linear_cross_entropy(h, w, t, chunk);
    torch::autograd::backward({loss * 0.5});  // a non-unit incoming gradient
    EXPECT_NEAR(loss.item<double>(), ref_loss, 1e-5 * std::abs(ref_loss)) << "chunk " << chunk;
    const double err = (h.grad().to(at::kDouble) - 0.5 * ref_grad).abs().max().item<double>();
    EXPECT_LT(err, 1e-6) << "chunk " << chunk;
  }
}

TEST(ChunkedCrossEntropy, AllIgnoredRowsGiveZeroLossAndGradient) {
  const at::Tensor w = at::randn({11, 8});
  at::Tensor h = at::randn({5, 8}).requires_grad_(true);
  const at::Tensor loss = chunked_linear_cross_entropy(h, w, at::full({5}, -100, at::kLong), 2);
  torch::autograd::backward({loss});
  EXPECT_EQ(loss.item<double>(), 0.0);
  EXPECT_EQ(h.grad().abs().max().item<double>(), 0.0);
}

TEST(ChunkedCrossEntropy, ModelLossSumEqualsFullLogitsLoss) {
  LoadOptions lo;
  auto m = MoeModel::load(kTiny, lo);
  at::manual_seed(5);
  Batch b;
  b.input_ids = at::randint(0, m->config().vocab, {2, 9}, at::kLong);
  b.labels = b.input_ids.clone();
  b.labels.index_put_({0, 3}, -100);
  at::Tensor h = m->embed(b.input_ids);
  const BlockContext ctx = m->context(b, false);
  for (int i = 0; i < m->num_layers(); ++i) h = m->block(i).forward(h, ctx);
  const auto [full, count] = shifted_cross_entropy(m->head(h), b.labels);
  EXPECT_EQ(count, 2 * 8 - 1);
  EXPECT_NEAR(m->loss_sum(h, b.labels).item<double>(), full.item<double>(), 1e-5 * full.item<double>());
}

TEST(SwiGlu, ValueAndGradientsMatchFloat64Autograd) {
  at::manual_seed(9);
  const at::Tensor g0 = at::randn({7, 12}) * 3, u0 = at::randn({7, 12});
  const at::Tensor dh = at::randn({7, 12});
  at::Tensor g = g0.clone().requires_grad_(true), u = u0.clone().requires_grad_(true);
  const at::Tensor h = swiglu(g, u);
  torch::autograd::backward({h}, {dh});
  at::Tensor g64 = g0.to(at::kDouble).requires_grad_(true), u64 = u0.to(at::kDouble).requires_grad_(true);
  const at::Tensor ref = g64 * at::sigmoid(g64) * u64;  // silu written out, not the same kernel
  torch::autograd::backward({ref}, {dh.to(at::kDouble)});
  EXPECT_LT((h.to(at::kDouble) - ref).abs().max().item<double>(), 1e-5);
  EXPECT_LT((g.grad().to(at::kDouble) - g64.grad()).abs().max().item<double>(), 1e-5);
  EXPECT_LT((u.grad().to(at::kDouble) - u64.grad()).abs().max().item<double>(), 1e-5);
}

TEST(SyntheticWeights, RealShapesFromConfigAloneSeededAndScaled) {
  // A folder with only config.json: the loader must not look for safetensors.
  const fs::path dir = fs::temp_directory_path() / "eo-synthetic-test";
  fs::remove_all(dir);
  fs::create_directories(dir);
  fs::copy_file(kTiny + "/config.json", dir / "config.json");
  LoadOptions lo;
  lo.load_in_4bit = true;
  lo.random_seed = 7;
  auto a = MoeModel::load(dir.string(), lo);
  auto b = MoeModel::load(dir.string(), lo);
  const ModelConfig& c = a->config();
  Batch batch;
  batch.input_ids = at::randint(0, c.vocab, {1, 12}, at::kLong);
  batch.labels = batch.input_ids.clone();
  const auto oa = a->forward(batch), ob = b->forward(batch);
  EXPECT_TRUE(at::equal(oa.logits, ob.logits)) << "same seed, same model";
  EXPECT_TRUE(std::isfinite(oa.loss_sum.item<double>()));
  lo.random_seed = 8;
  auto other = MoeModel::load(dir.string(), lo);
  EXPECT_FALSE(at::equal(other->forward(batch).logits, oa.logits)) << "another seed, another model";
  // The experts' dequantised weights have the config's initializer_range as standard deviation.
  const auto& q = a->weight_provider().expert_weight(0, 0, ExpertMatrix::Gate);
  const double sd = nf4::dequantize(q, at::kFloat).std().item<double>();
  EXPECT_NEAR(sd, c.initializer_range, 0.15 * c.initializer_range);
  fs::remove_all(dir);
}

TEST(MemoryPlan, WeightAndExpertTermsEqualTheLoadedModelsBytes) {
  TrainConfig cfg;
  cfg.base_model = kTiny;
  cfg.load_in_4bit = true;
  cfg.adapter = "qlora";
  cfg.bnb_4bit_blocksize = 64;
  const ModelConfig mc = load_config(kTiny);
  const MemoryPlan plan = plan_memory(cfg, mc, /*bf16=*/false, 1);
  LoadOptions lo;
  lo.load_in_4bit = true;
  auto m = MoeModel::load(kTiny, lo);
  // Count what the model holds independently: every expert's packed bytes and absmax.
  double experts = 0;
  int moe_layers = 0;
  for (int l = 0; l < m->num_layers(); ++l)
    if (m->block(l).is_moe() && ++moe_layers)
      for (int e = 0; e < mc.experts; ++e)
        for (auto mx : {ExpertMatrix::Gate, ExpertMatrix::Up, ExpertMatrix::Down}) {
          const auto& q = m->weight_provider().expert_weight(l, e, mx);
          experts += double(q.packed.nbytes() + q.absmax.nbytes());
        }
  double part_experts = 0;
  for (const auto& p : plan.device)
    if (p.name == "experts") part_experts = p.bytes;
  EXPECT_EQ(part_experts, experts);
  // The offload slot: the engine's arena aligns each tensor to 256 bytes, so a block is at least
  // the sum of its tensors and at most 2 x 255 bytes more per matrix.
  const double per_block = experts / moe_layers;
  EXPECT_GE(plan.block_bytes, per_block);
  EXPECT_LE(plan.block_bytes, per_block + double(mc.experts) * 3 * 2 * 255);
  EXPECT_GT(plan.device_peak, plan.device[0].bytes + part_experts);
}

TEST(MemoryPlan, OffloadMovesExpertsToPinnedHostAndActivationsGrowWithTokens) {
  TrainConfig cfg;
  cfg.base_model = kTiny;
  cfg.load_in_4bit = true;
  cfg.adapter = "qlora";
  const ModelConfig mc = load_config(kTiny);
  const MemoryPlan resident = plan_memory(cfg, mc, true, 1);
  cfg.expert_offload = true;
  const MemoryPlan off = plan_memory(cfg, mc, true, 4);
  EXPECT_EQ(resident.host_pinned, 0);
  EXPECT_EQ(off.host_pinned, resident.expert_bytes);
  EXPECT_LT(off.device_peak, resident.device_peak);
  EXPECT_NE(describe_plan(off, 0).find("4 rank(s) on a node"), std::string::npos);
  cfg.micro_batch_size = 8;
  EXPECT_GT(plan_memory(cfg, mc, true, 1).device_peak, off.device_peak);
}
