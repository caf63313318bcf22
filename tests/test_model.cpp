// The MoE decoder against independent references: transformers (logits, loss, aux loss,
// `eo-ddp score`), peft (LoRA logits and gradients), bitsandbytes (NF4 model), for qwen3_moe,
// olmoe, mixtral and qwen2_moe. Reference outputs come from tests/ref/model_ref.py, generated
// into the build folder by the CTest fixture in tests/model.cmake (or on first use, under a lock).
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "tests/ref_support.h"
#include "models/hf_config.h"
#include "models/linear4bit.h"
#include "models/moe_model.h"
#include "models/safetensors.h"
#include "runtime/data/jsonl.h"

namespace fs = std::filesystem;
using namespace eo;
using namespace eo::model;

namespace {

using eo::testing::rel_err;
using eo::testing::sh;

std::string ref_dir(const std::string& arch) { return eo::testing::python_fixture("model_ref.py", "model_ref", arch); }

struct Ref {
  std::shared_ptr<st::File> file;
  at::Tensor operator[](const std::string& name) const {
    EXPECT_NE(file->find(name), nullptr) << name;
    return file->load(name);
  }
};
Ref load_ref(const std::string& dir) { return {st::File::open(dir + "/ref.safetensors")}; }

Batch ref_batch(const Ref& r) {
  Batch b;
  b.input_ids = r["input_ids"];
  b.labels = r["labels"];
  return b;
}

class Parity : public ::testing::TestWithParam<std::string> {};

TEST_P(Parity, LogitsLossAndAuxMatchTransformers) {
  const std::string dir = ref_dir(GetParam());
  const Ref r = load_ref(dir);
  c10::NoGradGuard no_grad;
  for (const char* variant : {"model", "model_fused"}) {
    SCOPED_TRACE(variant);
    auto m = MoeModel::load(dir + "/" + variant, LoadOptions{});
    const auto out = m->forward(ref_batch(r), ForwardOptions{false, true});
    EXPECT_LT(rel_err(out.logits, r["logits"]), 1e-4);
    const double loss = out.loss_sum.item<double>() / out.tokens;
    EXPECT_NEAR(loss, r["loss"].item<double>(), 1e-5 * r["loss"].item<double>());
    EXPECT_NEAR(out.aux_loss.item<double>(), r["aux_loss"].item<double>(), 1e-5 * r["aux_loss"].item<double>());
    const double with_aux = loss + m->config().router_aux_loss_coef * out.aux_loss.item<double>();
    EXPECT_NEAR(with_aux, r["loss_with_aux"].item<double>(), 1e-5 * with_aux);
    // Every MoE block staged exactly once per forward.
    for (int i = 0; i < m->num_layers(); ++i)
      EXPECT_EQ(m->weight_provider().stage_count(i), m->config().is_moe_layer(i) ? 1 : 0) << "layer " << i;
  }
}

TEST_P(Parity, LoraLogitsAndGradientsMatchPeft) {
  const std::string dir = ref_dir(GetParam());
  const Ref r = load_ref(dir);
  auto m = MoeModel::load(dir + "/model", LoadOptions{});
  m->load_adapter(dir + "/adapter");
  const auto out = m->forward(ref_batch(r));
  EXPECT_LT(rel_err(out.logits, r["logits_lora"]), 1e-4);
  const at::Tensor loss = out.loss_sum / static_cast<double>(out.tokens);
  EXPECT_NEAR(loss.item<double>(), r["loss_lora"].item<double>(), 1e-5 * r["loss_lora"].item<double>());
  loss.backward();
  // peft's per-expert view of the parameters and of their gradients (stacked experts sliced).
  NamedLora stacked = m->lora_parameters(), stacked_grads;
  for (const auto& [name, p] : stacked) stacked_grads.emplace_back(name, p.grad().defined() ? p.grad() : at::zeros_like(p));
  for (const auto& [name, p] : stacked) EXPECT_EQ(p.scalar_type(), at::kFloat) << name;
  const auto params = peft_lora_tensors(stacked);
  const auto grads = peft_lora_tensors(stacked_grads);
  std::size_t n_ref = 0;
  for (const auto& t : r.file->tensors()) n_ref += t.name.rfind("grad.", 0) == 0;
  EXPECT_EQ(params.size(), n_ref) << "every LoRA tensor of the reference has a counterpart, and no more";
  std::size_t experts_with_grad = 0;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const auto& [name, p] = params[i];
    SCOPED_TRACE(name);
    ASSERT_EQ(grads[i].first, name);
    const at::Tensor want = r["grad." + name];
    const at::Tensor& got = grads[i].second;
    if (got.abs().max().item<double>() == 0.0) {  // an expert that received no token: peft's gradient is zero too
      EXPECT_EQ(want.abs().max().item<double>(), 0.0);
      continue;
    }
    experts_with_grad += name.find(".experts.") != std::string::npos;
    EXPECT_LT(rel_err(got, want), 1e-4);
    EXPECT_EQ(p.sizes(), want.sizes());
  }
  EXPECT_GT(experts_with_grad, 0u);
}

// lora_target_parameters: peft's own ParamWrapper adapter (fused gate_up_proj / down_proj,
// made and saved by peft in model_ref.py) loads, and gives peft's logits, loss and gradients.
TEST_P(Parity, FusedExpertLoraMatchesPeftParamWrapper) {
  const std::string dir = ref_dir(GetParam());
  const Ref r = load_ref(dir);
  auto m = MoeModel::load(dir + "/model", LoadOptions{});
  m->load_adapter(dir + "/adapter_params");
  EXPECT_EQ(m->lora_spec().target_parameters, (std::vector<std::string>{kGateUpParam, kDownParam}));
  const auto out = m->forward(ref_batch(r));
  EXPECT_LT(rel_err(out.logits, r["logits_params"]), 1e-4);
  const at::Tensor loss = out.loss_sum / static_cast<double>(out.tokens);
  EXPECT_NEAR(loss.item<double>(), r["loss_params"].item<double>(), 1e-5 * r["loss_params"].item<double>());
  loss.backward();
  NamedLora trained = m->lora_parameters(), trained_grads;
  for (const auto& [name, p] : trained) trained_grads.emplace_back(name, p.grad().defined() ? p.grad() : at::zeros_like(p));
  const auto params = peft_lora_tensors(trained), grads = peft_lora_tensors(trained_grads);
  std::size_t n_ref = 0;
  for (const auto& t : r.file->tensors()) n_ref += t.name.rfind("grad_params.", 0) == 0;
  EXPECT_EQ(params.size(), n_ref) << "every LoRA tensor of peft's model has a counterpart, and no more";
  std::size_t fused = 0;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const auto& [name, p] = params[i];
    SCOPED_TRACE(name);
    ASSERT_EQ(grads[i].first, name);
    const at::Tensor want = r["grad_params." + name];
    EXPECT_EQ(p.sizes(), want.sizes());
    fused += name.find(".experts.") != std::string::npos;
    EXPECT_LT(rel_err(grads[i].second, want), 1e-4);
  }
  EXPECT_GT(fused, 0u);
}

TEST_P(Parity, Nf4ModelMatchesBitsandbytesDequantisedTransformers) {
  const std::string dir = ref_dir(GetParam());
  const Ref r = load_ref(dir);
  c10::NoGradGuard no_grad;
  LoadOptions lo;
  lo.load_in_4bit = true;
  auto m = MoeModel::load(dir + "/model", lo);
  const auto out = m->forward(ref_batch(r));
  EXPECT_LT(rel_err(out.logits, r["logits_nf4"]), 1e-4);
  EXPECT_GT(rel_err(out.logits, r["logits"]), 1e-3) << "quantisation must change the logits at all";
}

TEST_P(Parity, ScoreCommandMatchesTransformersLoss) {
  const std::string dir = ref_dir(GetParam());
  const Ref r = load_ref(dir);
  const std::string bin = std::string(EO_BINARY_DIR) + "/eo-ddp score --json --data " + dir + "/data.jsonl --model " + dir + "/model";
  for (bool adapter : {false, true}) {
    std::string text;
    ASSERT_EQ(sh(bin + (adapter ? " --adapter " + dir + "/adapter" : "") + " 2>/dev/null", &text), 0) << text;
    const auto j = nlohmann::json::parse(text.substr(text.find('{')));
    const double want = r[adapter ? "score_loss_adapter" : "score_loss"].item<double>();
    EXPECT_NEAR(j.at("loss").get<double>(), want, 1e-5 * want) << text;
    EXPECT_EQ(j.at("tokens").get<std::int64_t>(), r["score_tokens"].item<std::int64_t>());
  }
}

INSTANTIATE_TEST_SUITE_P(Arch, Parity, ::testing::Values("qwen3_moe", "olmoe", "mixtral", "qwen2_moe"));

// ---------------------------------------------------------------------------------------------
// Unit tests (no reference needed beyond float math).

TEST(HfConfig, ParsesQwen3AndLayerKinds) {
  const auto j = nlohmann::json::parse(R"({"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 4,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 1000, "num_experts": 8,
    "num_experts_per_tok": 2, "moe_intermediate_size": 64, "intermediate_size": 96, "mlp_only_layers": [0],
    "decoder_sparse_step": 2, "norm_topk_prob": true, "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}})");
  const ModelConfig c = parse_config(j, "cfg.json");
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.rope_theta, 1e6);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_EQ(c.qk_norm, QkNorm::PerHead);
  EXPECT_FALSE(c.is_moe_layer(0));
  EXPECT_TRUE(c.is_moe_layer(1));
  EXPECT_FALSE(c.is_moe_layer(2));
  EXPECT_TRUE(c.is_moe_layer(3));
}

TEST(HfConfig, ErrorsNameTheFieldAndFile) {
  auto msg = [](const std::string& text) -> std::string {
    try {
      parse_config(nlohmann::json::parse(text), "dir/config.json");
    } catch (const UsageError& e) {
      return e.what();
    }
    return "";
  };
  const std::string unknown = msg(R"({"model_type": "llama"})");
  EXPECT_NE(unknown.find("qwen3_moe, olmoe, mixtral, qwen2_moe"), std::string::npos) << unknown;
  const std::string missing = msg(R"({"model_type": "mixtral", "num_hidden_layers": 2})");
  EXPECT_NE(missing.find("hidden_size"), std::string::npos) << missing;
  EXPECT_NE(missing.find("dir/config.json"), std::string::npos) << missing;
  const std::string typed = msg(R"({"model_type": "mixtral", "hidden_size": "64"})");
  EXPECT_NE(typed.find("'hidden_size' must be an integer"), std::string::npos) << typed;
}

// A provider whose bytes can be swapped, as the offload engine reuses slots.
class SwappableProvider : public WeightProvider {
 public:
  nf4::QuantizedWeight w;
  const nf4::QuantizedWeight& expert_weight(int, int, ExpertMatrix) override { return w; }

 protected:
  void stage_block(int) override {}
};

TEST(Linear4bit, BackwardUsesTheBytesCurrentAtBackwardTimeAndHoldsNoReference) {
  at::manual_seed(0);
  const at::Tensor w1 = at::randn({24, 16}), w2 = at::randn({24, 16});
  SwappableProvider prov;
  prov.w = nf4::quantize(w1);
  const nf4::QuantizedWeight q2 = nf4::quantize(w2);
  const at::Tensor x = at::randn({5, 16}).set_requires_grad(true);
  const auto storage_refs = prov.w.packed.storage().use_count();
  const auto absmax_refs = prov.w.absmax.storage().use_count();
  prov.stage(3);
  const at::Tensor y = linear4bit(x, WeightHandle{&prov, 3, 1, ExpertMatrix::Up, nullptr});
  EXPECT_EQ(prov.w.packed.storage().use_count(), storage_refs) << "the autograd node must not hold the packed bytes";
  EXPECT_EQ(prov.w.absmax.storage().use_count(), absmax_refs);
  // Forward used the first bytes (float reference: x · dequant(W1)^T).
  const at::Tensor w1_deq = nf4::dequantize(prov.w, at::kFloat);
  EXPECT_LT(rel_err(y, at::matmul(x.detach(), w1_deq.t())), 1e-6);
  // The "offloader" reuses the slot: overwrite the bytes in place, then run backward.
  prov.w.packed.copy_(q2.packed);
  prov.w.absmax.copy_(q2.absmax);
  const at::Tensor dy = at::randn({5, 24});
  y.backward(dy);
  const at::Tensor want = at::matmul(dy, nf4::dequantize(q2, at::kFloat));
  EXPECT_LT(rel_err(x.grad(), want), 1e-6);
  EXPECT_GT(rel_err(x.grad(), at::matmul(dy, w1_deq)), 1e-2);
  EXPECT_EQ(prov.stage_count(3), 1);
  EXPECT_EQ(prov.total_stage_count(), 1);
}

TEST(LoraInit, MatchesPeftKaimingUniformAndZeroB) {
  LoraSpec s;
  s.r = 8;
  s.alpha = 16;
  LoraAdapter a(400, 30, s, 42, at::kCPU), b(400, 30, s, 42, at::kCPU), c(400, 30, s, 43, at::kCPU);
  const double bound = 1.0 / std::sqrt(400.0);
  EXPECT_LE(a.A().abs().max().item<double>(), bound);
  EXPECT_GT(a.A().abs().max().item<double>(), 0.9 * bound);
  EXPECT_NEAR(a.A().std().item<double>(), bound / std::sqrt(3.0), 0.05 * bound);
  EXPECT_EQ(a.B().abs().max().item<double>(), 0.0);
  EXPECT_TRUE(a.A().equal(b.A()));
  EXPECT_FALSE(a.A().equal(c.A()));
  EXPECT_TRUE(a.A().requires_grad() && a.B().requires_grad());
  s.use_rslora = true;
  EXPECT_NEAR(s.scaling(), 16 / std::sqrt(8.0), 1e-12);
}

TEST(Lora, NamesFollowPeftAndOrderOfUse) {
  const std::string dir = ref_dir("mixtral");
  auto m = MoeModel::load(dir + "/model", LoadOptions{});
  LoraSpec s;
  s.targets = {"q_proj", "w1", "w2", "w3"};
  m->add_lora(s);
  const auto p = peft_lora_tensors(m->lora_parameters());  // what save_adapter writes
  ASSERT_GE(p.size(), 4u);
  EXPECT_EQ(p[0].first, "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight");
  EXPECT_EQ(p[1].first, "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight");
  EXPECT_EQ(p[2].first, "base_model.model.model.layers.0.block_sparse_moe.experts.0.w1.lora_A.weight");
  EXPECT_EQ(p[4].first, "base_model.model.model.layers.0.block_sparse_moe.experts.0.w3.lora_A.weight");
  EXPECT_EQ(p[6].first, "base_model.model.model.layers.0.block_sparse_moe.experts.0.w2.lora_A.weight");
  // Zero B: the adapter starts as the identity, and bad targets are refused.
  s.targets = {"not_a_module"};
  EXPECT_THROW(m->add_lora(s), UsageError);
}

TEST(Model, PackedSegmentsEqualSeparateSequences) {
  const std::string dir = ref_dir("qwen3_moe");
  c10::NoGradGuard no_grad;
  auto m = MoeModel::load(dir + "/model", LoadOptions{});
  const at::Tensor a = at::arange(5, 12).view({1, 7}), b = at::arange(40, 46).view({1, 6});
  Batch packed;
  packed.input_ids = at::cat({a, b}, 1);
  packed.positions = at::cat({at::arange(7), at::arange(6)}).view({1, 13});
  packed.segment_ids = at::cat({at::full({7}, 1, at::kLong), at::full({6}, 2, at::kLong)}).view({1, 13});
  const at::Tensor lp = m->forward(packed).logits;
  Batch ba, bb;
  ba.input_ids = a;
  bb.input_ids = b;
  EXPECT_LT(rel_err(lp.narrow(1, 0, 7), m->forward(ba).logits), 1e-5);
  EXPECT_LT(rel_err(lp.narrow(1, 7, 6), m->forward(bb).logits), 1e-5);
}

TEST(Model, MissingOrMisshapedTensorsAreNamed) {
  const std::string dir = ref_dir("olmoe");
  const fs::path bad = fs::path(EO_BINARY_DIR) / "tests" / "model_bad_config";
  fs::create_directories(bad);
  fs::copy_file(dir + "/model/model.safetensors", bad / "model.safetensors", fs::copy_options::overwrite_existing);
  auto cfg = nlohmann::json::parse(std::ifstream(dir + "/model/config.json"));
  cfg["intermediate_size"] = 40;  // experts on disk are 32 wide
  std::ofstream(bad / "config.json") << cfg.dump();
  try {
    MoeModel::load(bad.string(), LoadOptions{});
    FAIL() << "expected a shape error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("experts.0.gate_proj.weight"), std::string::npos) << msg;
    EXPECT_NE(msg.find("expected [40, 64]"), std::string::npos) << msg;
  }
}

TEST(Jsonl, StrictReaderNamesFileAndLine) {
  const fs::path p = fs::path(EO_BINARY_DIR) / "tests" / "model_jsonl_test.jsonl";
  fs::create_directories(p.parent_path());
  std::ofstream(p) << "{\"input_ids\": [1, 2, 3]}\n\n{\"input_ids\": [4, 5], \"labels\": [-100, 5]}\n";
  const auto lines = data::read_tokenized_jsonl(p.string(), 10);
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0].labels, lines[0].input_ids);
  EXPECT_EQ(lines[1].labels, (std::vector<std::int64_t>{-100, 5}));
  EXPECT_EQ(lines[1].line, 3);
  auto error_of = [&](const std::string& body, std::int64_t vocab = 10) -> std::string {
    std::ofstream(p) << body;
    try {
      data::read_tokenized_jsonl(p.string(), vocab);
    } catch (const UsageError& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(error_of("{\"input_ids\": [1]}\n{\"labels\": [1]}\n").find(p.string() + ":2: 'input_ids' is missing"), std::string::npos);
  EXPECT_NE(error_of("{\"input_ids\": [1, 2], \"labels\": [1]}\n").find(":1: 'labels' has 1 entries"), std::string::npos);
  EXPECT_NE(error_of("{\"input_ids\": [1, 20]}\n").find(":1: token id 20 is outside"), std::string::npos);
  EXPECT_NE(error_of("{\"input_ids\": [1, 2.5]}\n").find(":1: 'input_ids' must contain only integers"), std::string::npos);
  EXPECT_NE(error_of("not json\n").find(":1: invalid JSON"), std::string::npos);
}

TEST(Score, BadArgumentsExitTwo) {
  const std::string bin = std::string(EO_BINARY_DIR) + "/eo-ddp score";
  EXPECT_EQ(sh(bin + " --data x.jsonl"), 2);
  EXPECT_EQ(sh(bin + " --model /nonexistent --data x.jsonl"), 2);
  EXPECT_EQ(sh(bin + " --model " + ref_dir("olmoe") + "/model --data /nonexistent.jsonl"), 2);
  EXPECT_EQ(sh(bin + " --model " + ref_dir("olmoe") + "/model --data x --dtype fp8"), 2);
}

}  // namespace

namespace {

TEST_P(Parity, Nf4QuantisationOfCheckpointWeightsEqualsBitsandbytes) {
  const std::string dir = ref_dir(GetParam());
  const Ref r = load_ref(dir);
  const st::Checkpoint ck = st::Checkpoint::open(dir + "/model");
  int checked = 0;
  for (const auto& t : r.file->tensors()) {
    if (t.name.rfind("nf4_packed.", 0) != 0) continue;
    const std::string key = t.name.substr(11);
    SCOPED_TRACE(key);
    const nf4::QuantizedWeight q = nf4::quantize(ck.load(key));
    const at::Tensor want = r[t.name].reshape({-1});
    EXPECT_EQ(q.packed.reshape({-1}).ne(want).sum().item<std::int64_t>(), 0) << "bytes differing from bitsandbytes";
    EXPECT_TRUE(q.absmax.equal(r["nf4_absmax." + key]));
    ++checked;
  }
  EXPECT_EQ(checked, 2);
}

}  // namespace
