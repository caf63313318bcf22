// The MoE decoder against independent references: transformers (logits, loss, aux loss,
// `eo-ddp score`), peft (LoRA logits and gradients), bitsandbytes (NF4 model), for qwen3_moe,
// olmoe, mixtral, qwen2_moe, glm4_moe, deepseek_v2, deepseek_v3, glm4_moe_lite, mistral4, gemma4 and llama4
// (gpt-oss's MXFP4 and modelopt's NVFP4 checkpoints against their own references)
// (most also in a variant with their unusual options on: group-limited routing, YaRN, dense
// first layers, Mistral 4's query scaling, Gemma 4's k-as-v full layers and soft-capping ...). Reference outputs come from tests/ref/model_ref.py, generated
// into the build folder by the CTest fixture in tests/model.cmake (or on first use, under a lock).
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <sys/wait.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <unistd.h>
#include <set>
#include <nlohmann/json.hpp>

#include "common/files.h"
#include "common/error.h"
#include "tests/ref_support.h"
#include "models/hf_config.h"
#include "models/linear4bit.h"
#include "models/module_names.h"
#include "models/moe_model.h"
#include "models/mxfp4.h"
#include "models/nf4.h"
#include "models/nvfp4.h"
#include "models/safetensors.h"
#include "offload/engine.h"
#include "offload/host_memory.h"
#include "runtime/config.h"
#include "runtime/data/batcher.h"
#include "runtime/data/jsonl.h"
#include "runtime/plan.h"
#include "runtime/step.h"
#include "tests/test_paths.h"

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

// One StepRunner step (as training runs it) on the reference batch: the loss and the LoRA gradients.
std::pair<double, std::vector<at::Tensor>> ref_train_step(MoeModel& model, const Ref& r, std::int64_t tokens) {
  for (auto& [name, p] : model.lora_parameters()) p.mutable_grad() = at::Tensor();
  data::MicroBatch mb;
  mb.input_ids = r["input_ids"];
  mb.labels = r["labels"];
  mb.position_ids = at::arange(mb.input_ids.size(1)).expand(mb.input_ids.sizes()).contiguous();
  mb.segment_ids = at::zeros(mb.input_ids.sizes(), at::kInt);
  mb.num_target_tokens = tokens;
  StepRunner runner(model, StepOptions{}, 1, nullptr);
  const double l = runner.run({mb}, double(tokens)).ce_sum.item<double>() / double(tokens);
  std::vector<at::Tensor> g;
  for (auto& [name, p] : model.lora_parameters()) g.push_back(p.grad().clone());
  return {l, g};
}

class Parity : public ::testing::TestWithParam<std::string> {};

// LoRA gradients of two fp32 computations (eo-ddp's and transformers + peft's). The delta-rule
// families' are held to 1e-3: transformers' own fp32 gradients differ from its float64 ones by up to
// 1.1e-4 on their base weights (the delta rule's triangular solve and decays amplify fp32 rounding),
// and by more on the smallest LoRA factors (the shared expert gate's B: [1, r]), where eo-ddp's
// chunked backward rounds differently again; a wrong term is off by far more. The others: 1e-4.
double lora_grad_tolerance(const ModelConfig& c) { return c.linear_attn ? 1e-3 : 1e-4; }

TEST_P(Parity, LogitsLossAndAuxMatchTransformers) {
  const std::string dir = ref_dir(GetParam());
  const Ref r = load_ref(dir);
  c10::NoGradGuard no_grad;
  // transformers returns no aux loss for glm4_moe / DeepSeek (and adds none to the loss).
  const bool has_aux = r["has_aux_loss"].item<std::int64_t>() != 0;
  for (const char* variant : {"model", "model_fused"}) {
    SCOPED_TRACE(variant);
    auto m = MoeModel::load(dir + "/" + variant, LoadOptions{});
    EXPECT_EQ(m->config().has_aux_loss, has_aux);
    const auto out = m->forward(ref_batch(r), ForwardOptions{false, has_aux});
    const double logits_err = rel_err(out.logits, r["logits"]);
    RecordProperty(std::string(variant) + "_logits_rel_err", std::to_string(logits_err));  // in --gtest_output=xml
    EXPECT_LT(logits_err, 1e-4);
    const double loss = out.loss_sum.item<double>() / out.tokens;
    EXPECT_NEAR(loss, r["loss"].item<double>(), 1e-5 * r["loss"].item<double>());
    if (has_aux) {
      EXPECT_NEAR(out.aux_loss.item<double>(), r["aux_loss"].item<double>(), 1e-5 * r["aux_loss"].item<double>());
      const double with_aux = loss + m->config().router_aux_loss_coef * out.aux_loss.item<double>();
      EXPECT_NEAR(with_aux, r["loss_with_aux"].item<double>(), 1e-5 * with_aux);
    } else {
      EXPECT_NEAR(loss, r["loss_with_aux"].item<double>(), 1e-5 * loss);
      try {
        m->forward(ref_batch(r), ForwardOptions{false, true});
        ADD_FAILURE() << "an aux loss was computed for a family transformers computes none for";
      } catch (const UsageError& e) {
        EXPECT_NE(std::string(e.what()).find("output_router_logits"), std::string::npos) << e.what();
      }
    }
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
  RecordProperty("logits_lora_rel_err", std::to_string(rel_err(out.logits, r["logits_lora"])));
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
  double worst_grad = 0;
  const double grad_tol = lora_grad_tolerance(m->config());
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
    worst_grad = std::max(worst_grad, rel_err(got, want));
    EXPECT_LT(rel_err(got, want), grad_tol);
    EXPECT_EQ(p.sizes(), want.sizes());
  }
  if (m->config().experts_lora_ok()) EXPECT_GT(experts_with_grad, 0u);  // gpt-oss: attention LoRA only
  RecordProperty("grad_worst_rel_err", std::to_string(worst_grad));
}

// lora_target_parameters: peft's own ParamWrapper adapter (fused gate_up_proj / down_proj,
// made and saved by peft in model_ref.py) loads, and gives peft's logits, loss and gradients.
// Every family: transformers 5's [E, 2I, H] gate_up_proj, gpt-oss's [E, H, 2I] with gate and up
// interleaved, Llama 4's with peft's factors on swapped sides; Gemma 4's under layers.{i}.experts.
class FusedParity : public Parity {};
TEST_P(FusedParity, FusedExpertLoraMatchesPeftParamWrapper) {
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
    EXPECT_LT(rel_err(grads[i].second, want), lora_grad_tolerance(m->config()));
  }
  EXPECT_GT(fused, 0u);
}

// The GPU's grouped expert path (run on fp32 CPU tensors, NF4 experts) reads the same factors out of
// peft's layout as the per-expert loop held to peft above: the loss and every LoRA gradient.
TEST_P(FusedParity, GroupedPathMatchesTheLoop) {
  const std::string dir = ref_dir(GetParam());
  const Ref r = load_ref(dir);
  LoadOptions lo;
  lo.load_in_4bit = true;
  auto m = MoeModel::load(dir + "/model", lo);
  LoraSpec spec;
  spec.r = 8;  // the grouped form needs r % 8 == 0
  spec.alpha = 12;
  spec.target_parameters = {kGateUpParam, kDownParam};
  m->add_lora(spec);
  {
    at::NoGradGuard ng;  // non-zero B so every factor gets a gradient
    at::manual_seed(3);
    for (auto& [n, p] : m->lora_parameters()) p.normal_(0, 0.05);
  }
  auto run = [&](bool grouped) {
    for (auto& [n, p] : m->lora_parameters()) p.mutable_grad() = at::Tensor();
    set_grouped_gemm_on_cpu(grouped);
    const auto out = m->forward(ref_batch(r));
    set_grouped_gemm_on_cpu(false);
    const at::Tensor loss = out.loss_sum / static_cast<double>(out.tokens);
    loss.backward();
    std::vector<at::Tensor> grads;
    for (auto& [n, p] : m->lora_parameters()) grads.push_back(p.grad().defined() ? p.grad().clone() : at::zeros_like(p));
    return std::make_pair(loss.item<double>(), grads);
  };
  const auto [loop_loss, loop_grads] = run(false);
  const std::int64_t banks_before = grouped_bank_dequantisations();
  const auto [grouped_loss, grouped_grads] = run(true);
  EXPECT_GT(grouped_bank_dequantisations(), banks_before) << "the grouped path did not run";
  EXPECT_NEAR(grouped_loss, loop_loss, 1e-5 * loop_loss);
  ASSERT_EQ(grouped_grads.size(), loop_grads.size());
  for (std::size_t i = 0; i < loop_grads.size(); ++i) EXPECT_LT(rel_err(grouped_grads[i], loop_grads[i]), 1e-4) << i;
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

INSTANTIATE_TEST_SUITE_P(Arch, FusedParity,
                         ::testing::Values("qwen3_moe", "olmoe", "mixtral", "qwen2_moe", "glm4_moe", "glm4_moe_grouped",
                                           "deepseek_v2", "deepseek_v2_grouped", "deepseek_v3", "deepseek_v3_yarn", "gpt_oss",
                                           "glm4_moe_lite_grouped", "mistral4_scaled", "mistral4_mm", "gemma4", "gemma4_kv",
                                           "llama4", "qwen3_next", "qwen3_5_moe_mm", "minimax_m2", "ernie4_5_moe",
                                           "hunyuan_v1_moe"));
INSTANTIATE_TEST_SUITE_P(Arch, Parity,
                         ::testing::Values("qwen3_moe", "olmoe", "mixtral", "qwen2_moe", "glm4_moe", "glm4_moe_grouped",
                                           "deepseek_v2", "deepseek_v2_grouped", "deepseek_v3", "deepseek_v3_yarn", "gpt_oss",
                                           "glm4_moe_lite", "glm4_moe_lite_grouped", "mistral4_scaled", "mistral4_mm", "gemma4",
                                           "gemma4_kv", "llama4", "qwen3_next", "qwen3_5_moe_mm", "minimax_m2", "ernie4_5_moe",
                                           "hunyuan_v1_moe"));

// ---------------------------------------------------------------------------------------------
// Unit tests (no reference needed beyond float math).

// The architecture table: one row per family, found by its model_type, named in the supported
// list; its module paths are checked against transformers' own checkpoints by the parity tests.
// The Hugging Face module paths lora_target_modules' regular expressions and dotted suffixes see,
// against transformers 5.24's modules of layer 0 (named_modules() of the *ForCausalLM on the meta
// device): qwen2_moe's shared expert and its gate, Llama 4's router and shared expert under
// feed_forward with no per-expert modules, gpt-oss's experts fused only, Mixtral's w1 / w3 / w2.
TEST(ArchTable, ModuleNamesAreTransformers) {
  auto layer0 = [](const std::string& shape, int layer = 0) {
    std::vector<std::string> out;
    const std::string at = ".layers." + std::to_string(layer) + ".";
    for (const auto& m : model::hf_linear_modules(load_config(std::string(EO_SOURCE_DIR) + "/configs/models/" + shape))) {
      const bool first = m.name.find(at) != std::string::npos;
      if (first && m.name.find(".experts.") != std::string::npos && m.name.find(".experts.0.") == std::string::npos) continue;
      if (first || m.name == "lm_head") out.push_back(m.name + (m.adaptable ? "" : " (not adapted)"));
    }
    return out;
  };
  const std::string a = "model.layers.0.self_attn.";
  EXPECT_EQ(layer0("gpt-oss-20b"), (std::vector<std::string>{a + "q_proj", a + "k_proj", a + "v_proj", a + "o_proj",
                                                               "model.layers.0.mlp.router (not adapted)", "lm_head (not adapted)"}));
  const std::string ff = "language_model.model.layers.0.feed_forward.", la = "language_model.model.layers.0.self_attn.";
  EXPECT_EQ(layer0("llama-4-scout-17b-16e"),
            (std::vector<std::string>{la + "q_proj", la + "k_proj", la + "v_proj", la + "o_proj", ff + "router (not adapted)",
                                      ff + "shared_expert.gate_proj", ff + "shared_expert.up_proj", ff + "shared_expert.down_proj",
                                      "lm_head (not adapted)"}));
  const std::string m = "model.layers.0.mlp.";
  EXPECT_EQ(layer0("qwen1.5-moe-a2.7b"),
            (std::vector<std::string>{a + "q_proj", a + "k_proj", a + "v_proj", a + "o_proj", m + "gate (not adapted)",
                                      m + "experts.0.gate_proj", m + "experts.0.up_proj", m + "experts.0.down_proj",
                                      m + "shared_expert.gate_proj", m + "shared_expert.up_proj", m + "shared_expert.down_proj",
                                      m + "shared_expert_gate", "lm_head (not adapted)"}));
  // Qwen3-Next's layer 0 is a gated delta-rule layer (linear_attn) beside the gated shared expert.
  const std::string l = "model.layers.0.linear_attn.";
  EXPECT_EQ(layer0("qwen3-next-80b-a3b"),
            (std::vector<std::string>{l + "in_proj_qkvz", l + "in_proj_ba", l + "out_proj", m + "gate (not adapted)",
                                      m + "shared_expert.gate_proj", m + "shared_expert.up_proj", m + "shared_expert.down_proj",
                                      m + "shared_expert_gate", "lm_head (not adapted)"}));
  const std::string b = "model.layers.0.block_sparse_moe.";
  EXPECT_EQ(layer0("mixtral-8x7b"), (std::vector<std::string>{a + "q_proj", a + "k_proj", a + "v_proj", a + "o_proj",
                                                                b + "gate (not adapted)", b + "experts.0.w1", b + "experts.0.w3",
                                                                b + "experts.0.w2", "lm_head (not adapted)"}));
  // ERNIE-4.5-21B-A3B: layer 0 dense (moe_layer_start_index 1), layer 1 the router, experts and shared experts.
  EXPECT_EQ(layer0("ernie-4.5-21b-a3b"), (std::vector<std::string>{a + "q_proj", a + "k_proj", a + "v_proj", a + "o_proj",
                                                                     m + "gate_proj", m + "up_proj", m + "down_proj",
                                                                     "lm_head (not adapted)"}));
  const std::string a1 = "model.layers.1.self_attn.", m1 = "model.layers.1.mlp.";
  EXPECT_EQ(layer0("ernie-4.5-21b-a3b", 1),
            (std::vector<std::string>{a1 + "q_proj", a1 + "k_proj", a1 + "v_proj", a1 + "o_proj", m1 + "gate (not adapted)",
                                      m1 + "experts.0.gate_proj", m1 + "experts.0.up_proj", m1 + "experts.0.down_proj",
                                      m1 + "shared_experts.gate_proj", m1 + "shared_experts.up_proj",
                                      m1 + "shared_experts.down_proj", "lm_head (not adapted)"}));
  // Hunyuan-A13B: the router's linear is mlp.gate.wg, the shared MLP mlp.shared_mlp.
  EXPECT_EQ(layer0("hunyuan-a13b"),
            (std::vector<std::string>{a + "q_proj", a + "k_proj", a + "v_proj", a + "o_proj", m + "gate.wg (not adapted)",
                                      m + "experts.0.gate_proj", m + "experts.0.up_proj", m + "experts.0.down_proj",
                                      m + "shared_mlp.gate_proj", m + "shared_mlp.up_proj", m + "shared_mlp.down_proj",
                                      "lm_head (not adapted)"}));
}

TEST(ArchTable, OneRowPerFamilyFoundByItsModelType) {
  std::set<int> archs;
  std::set<std::string> types;
  for (const auto& f : model::families()) {
    EXPECT_TRUE(archs.insert(static_cast<int>(f.arch)).second) << f.model_type;
    EXPECT_TRUE(types.insert(f.model_type).second) << f.model_type;
    ASSERT_EQ(model::find_family(f.model_type), &f) << f.model_type;
    EXPECT_EQ(&model::family(f.arch), &f) << f.model_type;
    const std::string listed = model::supported_model_types();
    EXPECT_NE(listed.find(f.model_type), std::string::npos) << listed;
    // A family's router and experts sit in its MoE block, Gemma 4's beside it.
    const std::string block = std::string(f.moe_block) + ".";
    if (f.arch != model::Arch::Gemma4) {
      EXPECT_EQ(std::string(f.router).rfind(block, 0), 0u) << f.model_type;
      EXPECT_EQ(std::string(f.experts).rfind(block, 0), 0u) << f.model_type;
    }
    // Only where per-expert modules exist can a family have names of its own for them.
    if (!f.per_expert_lora) EXPECT_EQ(std::string(f.expert_linears[0]), "gate_proj") << f.model_type;
  }
  EXPECT_EQ(archs.size(), static_cast<std::size_t>(model::Arch::HunyuanV1Moe) + 1);
  EXPECT_EQ(model::expert_linear_names(), (std::vector<std::string>{"gate_proj", "up_proj", "down_proj", "w1", "w3", "w2"}));
  EXPECT_EQ(model::supported_model_types(),
            "qwen3_moe, olmoe, mixtral, qwen2_moe, glm4_moe, deepseek_v2, deepseek_v3, gpt_oss, glm4_moe_lite, mistral4, "
            "gemma4 (gemma4_text), llama4 (llama4_text), qwen3_next, qwen3_5_moe (qwen3_5_moe_text), minimax_m2, "
            "ernie4_5_moe, hunyuan_v1_moe, mistral3 (around mistral4)");
}

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

// ERNIE-4.5-MoE and Hunyuan-MoE read as transformers 5.24's Ernie4_5_MoeConfig / HunYuanMoEV1Config and
// their modules build them (configs/models: the Hub files), and the files they cannot mean refused by key.
TEST(HfConfig, ErnieAndHunyuanReadAsTransformersBuildThem) {
  const std::string models = std::string(EO_SOURCE_DIR) + "/configs/models/";
  const ModelConfig e = load_config(models + "ernie-4.5-21b-a3b");
  EXPECT_EQ(e.experts, 64);
  EXPECT_EQ(e.top_k, 6);
  EXPECT_EQ(e.expert_width, 1536);
  EXPECT_EQ(e.shared_expert_width, 2 * 1536);
  EXPECT_FALSE(e.shared_expert_gated);
  EXPECT_EQ(e.dense_width, 12288);
  EXPECT_EQ(e.head_dim, 128);
  EXPECT_TRUE(e.tie_word_embeddings);
  EXPECT_TRUE(e.norm_topk_prob);
  EXPECT_EQ(e.router.score, RouterScore::Softmax);
  EXPECT_TRUE(e.router.correction_bias);
  EXPECT_TRUE(e.router.fp32);
  EXPECT_TRUE(e.rope.interleaved);
  EXPECT_EQ(e.rope_theta, 5e5);
  EXPECT_FALSE(e.is_moe_layer(0));  // moe_layer_start_index 1
  EXPECT_EQ(e.moe_layer_count(), 27);
  nlohmann::json ej = read_config_json(models + "ernie-4.5-21b-a3b");
  auto error = [](const nlohmann::json& j) -> std::string {
    try {
      parse_config(j, "dir/config.json");
    } catch (const UsageError& err) {
      return err.what();
    }
    return "";
  };
  // (i + 1) % interval == 0 and start <= i <= end, as Ernie4_5_MoeDecoderLayer builds them.
  nlohmann::json small = ej;
  small["num_hidden_layers"] = 6;
  small["moe_layer_start_index"] = 2;
  small["moe_layer_end_index"] = 4;
  small["moe_layer_interval"] = 2;
  small.erase("tie_word_embeddings");
  const ModelConfig s = parse_config(small, "small.json");
  EXPECT_EQ(s.moe_layer_ids(), (std::vector<int>{3}));
  EXPECT_TRUE(s.tie_word_embeddings) << "Ernie4_5_MoeConfig ties by default";
  small["moe_layer_end_index"] = -1;  // the last layer
  EXPECT_EQ(parse_config(small, "small.json").moe_layer_ids(), (std::vector<int>{3, 5}));
  nlohmann::json biased = ej;
  biased["use_bias"] = true;
  EXPECT_NE(error(biased).find("dir/config.json: use_bias true is not supported for ernie4_5_moe"), std::string::npos)
      << error(biased);

  const ModelConfig h = load_config(models + "hunyuan-a13b");
  EXPECT_EQ(h.experts, 64);
  EXPECT_EQ(h.top_k, 8);
  EXPECT_EQ(h.expert_width, 3072);
  EXPECT_EQ(h.shared_expert_width, 3072);
  EXPECT_FALSE(h.shared_expert_gated);
  EXPECT_EQ(h.moe_layer_count(), 32);
  EXPECT_EQ(h.qk_norm, QkNorm::PerHead);
  EXPECT_TRUE(h.qk_norm_after_rope);
  EXPECT_FALSE(h.has_aux_loss);
  EXPECT_TRUE(h.tie_word_embeddings);
  EXPECT_EQ(h.rope.dim, 128);
  // compute_ntk_alpha_rope_parameters: base = rope_theta * alpha ** (head_dim / (head_dim - 2)).
  EXPECT_DOUBLE_EQ(h.rope_theta, 10000.0 * std::pow(1000.0, 128.0 / 126.0));
  const nlohmann::json hj = read_config_json(models + "hunyuan-a13b");
  auto with = [&](const char* key, const nlohmann::json& v) {
    nlohmann::json j = hj;
    j[key] = v;
    return error(j);
  };
  std::vector<int> topk(32, 8);
  topk[5] = 4;
  EXPECT_NE(with("moe_topk", topk).find("field 'moe_topk'"), std::string::npos) << with("moe_topk", topk);
  EXPECT_NE(with("moe_topk", topk).find("differs between layers"), std::string::npos);
  EXPECT_NE(with("use_cla", true).find("use_cla true (cross-layer attention) is not supported"), std::string::npos)
      << with("use_cla", true);
  EXPECT_NE(with("moe_intermediate_size", 1536).find("moe_intermediate_size differs from intermediate_size"),
            std::string::npos);
  EXPECT_NE(with("num_shared_expert", 2).find("num_shared_expert must be 1"), std::string::npos);
  const std::string dynamic = with("rope_scaling", nlohmann::json{{"type", "dynamic"}, {"factor", 2.0}});
  EXPECT_NE(dynamic.find("rope_scaling.rope_type 'dynamic' without 'alpha' is not supported"), std::string::npos) << dynamic;
  EXPECT_EQ(with("moe_topk", 8), "");  // an integer, as transformers also reads it
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
  EXPECT_NE(unknown.find("qwen3_moe, olmoe, mixtral, qwen2_moe, glm4_moe, deepseek_v2, deepseek_v3, gpt_oss, glm4_moe_lite, mistral4, gemma4"),
            std::string::npos)
      << unknown;
  // Mistral 3's wrapper around a dense mistral text model (Mistral Small 3.x; Mistral3Config's
  // default when text_config names none) is not one eo-ddp trains; around mistral4 its text_config's
  // own errors name where they are.
  const std::string dense = msg(R"({"model_type": "mistral3", "text_config": {"hidden_size": 64}})");
  EXPECT_NE(dense.find("dir/config.json text_config: model_type 'mistral' is not supported (eo-ddp trains mistral3 "
                       "around a mistral4 text model"), std::string::npos) << dense;
  const std::string wrapped = msg(R"({"model_type": "mistral3", "text_config": {"model_type": "mistral4"}})");
  EXPECT_NE(wrapped.find("dir/config.json text_config: required field 'hidden_size' is missing"), std::string::npos) << wrapped;
  const std::string odd = msg(R"({"model_type": "mistral3", "text_config": [1]})");
  EXPECT_NE(odd.find("field 'text_config' must be an object"), std::string::npos) << odd;
  const std::string missing = msg(R"({"model_type": "mixtral", "num_hidden_layers": 2})");
  EXPECT_NE(missing.find("hidden_size"), std::string::npos) << missing;
  EXPECT_NE(missing.find("dir/config.json"), std::string::npos) << missing;
  const std::string typed = msg(R"({"model_type": "mixtral", "hidden_size": "64"})");
  EXPECT_NE(typed.find("'hidden_size' must be an integer"), std::string::npos) << typed;
  // Issue #32 item 13: shapes that would make planning spin are refused at once.
  const std::string huge = msg(R"({"model_type": "mixtral", "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 100, "num_local_experts": 2147483647,
    "num_experts_per_tok": 2, "intermediate_size": 32, "rope_theta": 10000})");
  EXPECT_NE(huge.find("2147483647 experts is over eo-ddp's limit of 65536"), std::string::npos) << huge;
}

// Gemma 4 as transformers 5.24's Gemma4TextConfig resolves it: the Hub's 26B-A4B (a
// Gemma4ForConditionalGeneration wrapper: global_head_dim / num_global_key_value_heads), and the
// per_layer_config that save_pretrained writes instead (the tiny literal below is its output for
// Gemma4TextConfig(head_dim=16, global_head_dim=32, num_global_key_value_heads=1, ...)). The
// dense Gemma 4 options are refused in one error.
TEST(HfConfig, Gemma4IsReadAsTransformersResolvesIt) {
  auto msg = [](const std::function<void()>& f) -> std::string {
    try {
      f();
    } catch (const UsageError& e) {
      return e.what();
    }
    return "accepted";
  };
  const ModelConfig real = load_config(std::string(EO_SOURCE_DIR) + "/configs/models/gemma-4-26b-a4b");
  EXPECT_EQ(real.arch, Arch::Gemma4);
  ASSERT_TRUE(real.multimodal.has_value());
  EXPECT_EQ(real.multimodal->class_name, "Gemma4ForConditionalGeneration");
  EXPECT_EQ(real.decoder_prefix(), "model.language_model.");
  EXPECT_EQ(real.layers, 30);
  for (int i = 0; i < 30; ++i) {
    const bool full = i % 6 == 5;
    EXPECT_EQ(real.is_sliding_layer(i), !full) << i;
    EXPECT_EQ(real.head_dim_at(i), full ? 512 : 256) << i;
    EXPECT_EQ(real.kv_heads_at(i), full ? 2 : 8) << i;
    EXPECT_EQ(real.has_v_proj(i), !full) << i;
    EXPECT_TRUE(real.is_moe_layer(i)) << i;
  }
  EXPECT_EQ(real.sliding_window, 1024);
  EXPECT_EQ(real.rope.dim, 256);
  EXPECT_EQ(real.rope.proportional_pairs, 0);
  EXPECT_DOUBLE_EQ(real.rope_theta, 1e4);
  EXPECT_EQ(real.gemma->full_rope.dim, 512);
  EXPECT_EQ(real.gemma->full_rope.proportional_pairs, 64);  // int(0.25 * 512 // 2)
  EXPECT_DOUBLE_EQ(real.gemma->full_rope_theta, 1e6);
  EXPECT_DOUBLE_EQ(real.final_logit_softcap, 30.0);
  EXPECT_DOUBLE_EQ(real.attn_scale, 1.0);
  EXPECT_EQ(real.experts, 128);
  EXPECT_EQ(real.top_k, 8);
  EXPECT_EQ(real.expert_width, 704);
  EXPECT_EQ(real.dense_width, 2112);
  EXPECT_TRUE(real.tie_word_embeddings);
  EXPECT_FALSE(real.has_aux_loss);
  EXPECT_EQ(real.act, Activation::GeluTanh);
  EXPECT_EQ(real.linear_modules(),
            (std::vector<std::string>{"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}));
  EXPECT_EQ(real.attention_shapes(5).size(), 3u);  // q, k, o: no v_proj with attention_k_eq_v
  EXPECT_EQ(real.attention_shapes(5)[1].out, 2 * 512);

  const std::string tiny = R"({"model_type": "gemma4_text", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
    "hidden_activation": "gelu_pytorch_tanh", "rope_parameters": {"sliding_attention": {"rope_type": "default",
    "rope_theta": 10000.0}, "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
    "rope_theta": 1000000.0}}, "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"],
    "final_logit_softcapping": null, "hidden_size_per_layer_input": 0, "attention_k_eq_v": true,
    "num_kv_shared_layers": 0, "enable_moe_block": true, "use_double_wide_mlp": false, "num_experts": 4,
    "top_k_experts": 2, "moe_intermediate_size": 16, "per_layer_config": {"1": {"head_dim": 32, "num_key_value_heads": 1}}})";
  const ModelConfig t = parse_config(nlohmann::json::parse(tiny), "tiny/config.json");
  EXPECT_FALSE(t.multimodal.has_value());
  EXPECT_EQ(t.decoder_prefix(), "model.");
  EXPECT_EQ(t.head_dim_at(1), 32);
  EXPECT_EQ(t.kv_heads_at(1), 1);
  EXPECT_EQ(t.gemma->full_rope.proportional_pairs, 4);
  EXPECT_DOUBLE_EQ(t.final_logit_softcap, 0.0);  // null: off
  EXPECT_TRUE(t.tie_word_embeddings);            // Gemma4TextConfig's default

  // A dense Gemma 4 with per-layer embeddings (E2B-like: Gemma4TextConfig's defaults), and a type
  // error in the wrapped text config.
  const std::string dense = msg([] { parse_config(nlohmann::json::parse(R"({"model_type": "gemma4_text",
    "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1})"), "d.json"); });
  EXPECT_NE(dense.find("d.json: this gemma4 config is not supported (Gemma4ForCausalLM)"), std::string::npos) << dense;
  EXPECT_NE(dense.find("enable_moe_block false: a dense Gemma 4"), std::string::npos) << dense;
  EXPECT_NE(dense.find("hidden_size_per_layer_input > 0"), std::string::npos) << dense;
  nlohmann::json odd = nlohmann::json::parse(tiny);
  odd["use_bidirectional_attention"] = "all";
  odd["hidden_activation"] = "silu";
  odd["rope_parameters"]["full_attention"]["rope_type"] = "yarn";
  const std::string o = msg([&] { parse_config(odd, "o.json"); });
  for (const char* part : {"use_bidirectional_attention 'all'", "hidden_activation 'silu'", "full_attention.rope_type 'yarn'"})
    EXPECT_NE(o.find(part), std::string::npos) << part << "\n" << o;
  const std::string typed = msg([] { parse_config(nlohmann::json::parse(
    R"({"model_type": "gemma4", "text_config": {"hidden_size": "2816"}})"), "w.json"); });
  EXPECT_NE(typed.find("w.json text_config: field 'hidden_size' must be an integer"), std::string::npos) << typed;
}

// Qwen3-Next and Qwen3.5-MoE are refused with the reason (their linear-attention layers), not as
// unknown families.
TEST(HfConfig, Llama4IsReadAsTransformersResolvesIt) {
  auto msg = [](const std::function<void()>& f) -> std::string {
    try {
      f();
    } catch (const UsageError& e) {
      return e.what();
    }
    return "accepted";
  };
  // Llama-4-Scout-17B-16E as the Hub ships it (Llama4ForConditionalGeneration around the text model).
  const ModelConfig real = load_config(std::string(EO_SOURCE_DIR) + "/configs/models/llama-4-scout-17b-16e");
  EXPECT_EQ(real.arch, Arch::Llama4);
  ASSERT_TRUE(real.multimodal.has_value());
  EXPECT_EQ(real.decoder_prefix(), "language_model.model.");
  EXPECT_EQ(real.multimodal->layouts.front().lm_head, "language_model.lm_head.weight");
  ASSERT_EQ(real.layers, 48);
  for (int i = 0; i < 48; ++i) {
    const bool nope = (i + 1) % 4 == 0;  // no_rope_layers
    EXPECT_EQ(real.uses_rope(i), !nope) << i;
    EXPECT_EQ(real.is_chunked_layer(i), !nope) << i;  // transformers' layer_types: the RoPE layers chunked
    EXPECT_TRUE(real.is_moe_layer(i)) << i;
  }
  EXPECT_EQ(real.llama4->chunk, 8192);
  EXPECT_TRUE(real.llama4->temperature_tuning);
  EXPECT_DOUBLE_EQ(real.llama4->floor_scale, 8192);
  EXPECT_DOUBLE_EQ(real.llama4->attn_scale, 0.1);
  EXPECT_EQ(real.hidden, 5120);
  EXPECT_EQ(real.heads, 40);
  EXPECT_EQ(real.kv_heads, 8);
  EXPECT_EQ(real.head_dim, 128);
  EXPECT_EQ(real.vocab, 202048);
  EXPECT_EQ(real.experts, 16);
  EXPECT_EQ(real.top_k, 1);
  EXPECT_EQ(real.expert_width, 8192);
  EXPECT_EQ(real.shared_expert_width, 8192);
  EXPECT_EQ(real.dense_width, 16384);
  EXPECT_EQ(real.qk_norm, QkNorm::L2);
  EXPECT_TRUE(real.rope.interleaved);
  EXPECT_EQ(real.rope.dim, 128);
  EXPECT_TRUE(real.rope.llama3);
  EXPECT_DOUBLE_EQ(real.rope.factor, 8.0);
  EXPECT_DOUBLE_EQ(real.rope.low_freq_factor, 1.0);
  EXPECT_DOUBLE_EQ(real.rope.high_freq_factor, 4.0);
  EXPECT_DOUBLE_EQ(real.rope.original_max_positions, 8192);
  EXPECT_DOUBLE_EQ(real.rope_theta, 5e5);
  EXPECT_DOUBLE_EQ(real.attn_scale, 1.0 / std::sqrt(128.0));
  EXPECT_EQ(real.router.score, RouterScore::Sigmoid);
  EXPECT_FALSE(real.norm_topk_prob);
  EXPECT_FALSE(real.has_aux_loss);
  EXPECT_FALSE(real.tie_word_embeddings);
  EXPECT_FALSE(real.experts_lora_ok());
  EXPECT_EQ(real.moe_prefix(), "feed_forward");
  EXPECT_EQ(real.router_path(), "feed_forward.router");
  EXPECT_EQ(real.shared_expert_name(), "shared_expert");
  EXPECT_EQ(real.linear_modules(),
            (std::vector<std::string>{"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}));

  // A text model's config.json resolved as Llama4TextConfig does: MoE every interleave step (from
  // step - 1), a NoPE layer every no_rope_layer_interval, the RoPE layers chunked; the Hub's
  // attn_temperature_tuning 4 is true, null attention_chunk_size turns chunking off.
  const std::string tiny = R"({"model_type": "llama4_text", "vocab_size": 64, "hidden_size": 32, "num_attention_heads": 4,
      "num_key_value_heads": 2, "head_dim": 8, "num_hidden_layers": 4, "intermediate_size": 16, "intermediate_size_mlp": 24,
      "interleave_moe_layer_step": 2, "no_rope_layer_interval": 2, "attention_chunk_size": 16, "attn_temperature_tuning": 4,
      "use_qk_norm": false, "rope_theta": 1000.0})";
  const ModelConfig t = parse_config(nlohmann::json::parse(tiny), "t.json");
  EXPECT_FALSE(t.multimodal.has_value());
  EXPECT_EQ(t.decoder_prefix(), "model.");
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(t.is_moe_layer(i), i % 2 == 1) << i;
    EXPECT_EQ(t.uses_rope(i), i % 2 == 0) << i;
    EXPECT_EQ(t.is_chunked_layer(i), i % 2 == 0) << i;
  }
  EXPECT_TRUE(t.llama4->temperature_tuning);
  EXPECT_EQ(t.qk_norm, QkNorm::None);
  EXPECT_FALSE(t.rope.llama3);
  auto j = nlohmann::json::parse(tiny);
  j["attention_chunk_size"] = nullptr;
  j["moe_layers"] = {0, 3};
  const ModelConfig unchunked = parse_config(j, "u.json");
  for (int i = 0; i < 4; ++i) {
    EXPECT_FALSE(unchunked.is_chunked_layer(i)) << i;
    EXPECT_EQ(unchunked.is_moe_layer(i), i == 0 || i == 3) << i;  // moe_layers overrides the step
  }

  // What eo-ddp does not train, named at once with the class transformers would build.
  auto bad = nlohmann::json::parse(tiny);
  bad["hidden_act"] = "gelu";
  bad["attention_dropout"] = 0.1;
  bad["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
  const std::string m = msg([&] { parse_config(bad, "b.json"); });
  EXPECT_NE(m.find("b.json: this llama4 config is not supported (Llama4ForCausalLM)"), std::string::npos) << m;
  EXPECT_NE(m.find("hidden_act 'gelu'"), std::string::npos) << m;
  EXPECT_NE(m.find("attention_dropout"), std::string::npos) << m;
  EXPECT_NE(m.find("rope_type 'yarn' (default, llama3)"), std::string::npos) << m;
  auto short_nope = nlohmann::json::parse(tiny);
  short_nope["no_rope_layers"] = {1, 0};
  EXPECT_NE(msg([&] { parse_config(short_nope, "n.json"); }).find("no_rope_layers has 2 entries for 4 layers"), std::string::npos);
  auto chunk_null = nlohmann::json::parse(tiny);
  chunk_null["attention_chunk_size"] = nullptr;
  chunk_null["layer_types"] = {"chunked_attention", "full_attention", "full_attention", "full_attention"};
  EXPECT_NE(msg([&] { parse_config(chunk_null, "c.json"); }).find("attention_chunk_size is null"), std::string::npos);
  const std::string inner = msg([] { parse_config(nlohmann::json::parse(
      R"({"model_type": "llama4", "text_config": {"model_type": "llama"}})"), "w.json"); });
  EXPECT_NE(inner.find("w.json text_config: model_type 'llama' is not supported (eo-ddp trains llama4 around a llama4_text text model"),
            std::string::npos) << inner;
}

// The GPU's grouped dispatch (run on fp32 CPU tensors): the experts' input rows scaled by the router
// in expert order, the combine summing with weight 1; transformers' / peft's logits and gradients, and
// with NF4 experts bitsandbytes' dequantised model.
TEST(Model, Llama4GroupedDispatchMatchesTransformers) {
  const std::string dir = ref_dir("llama4");
  const Ref r = load_ref(dir);
  auto m = MoeModel::load(dir + "/model", LoadOptions{});
  m->load_adapter(dir + "/adapter");
  set_grouped_gemm_on_cpu(true);
  const auto out = m->forward(ref_batch(r));
  const at::Tensor loss = out.loss_sum / static_cast<double>(out.tokens);
  loss.backward();
  set_grouped_gemm_on_cpu(false);
  EXPECT_LT(rel_err(out.logits, r["logits_lora"]), 1e-4);
  EXPECT_NEAR(loss.item<double>(), r["loss_lora"].item<double>(), 1e-5 * r["loss_lora"].item<double>());
  NamedLora grads;
  for (const auto& [name, p] : m->lora_parameters()) grads.emplace_back(name, p.grad());
  int checked = 0;
  for (const auto& [name, g] : peft_lora_tensors(grads)) {
    SCOPED_TRACE(name);
    EXPECT_LT(rel_err(g, r["grad." + name]), 1e-4);
    ++checked;
  }
  EXPECT_EQ(checked, 4 * 4 * 2 + 4 * 3 * 2);  // q k v o of 4 layers; the dense / shared MLP of each

  c10::NoGradGuard no_grad;
  LoadOptions lo;
  lo.load_in_4bit = true;
  auto q = MoeModel::load(dir + "/model", lo);
  const std::int64_t banks_before = grouped_bank_dequantisations();
  set_grouped_gemm_on_cpu(true);
  const at::Tensor logits = q->forward(ref_batch(r)).logits;
  set_grouped_gemm_on_cpu(false);
  EXPECT_GT(grouped_bank_dequantisations(), banks_before) << "the grouped path did not run";
  EXPECT_LT(rel_err(logits, r["logits_nf4"]), 1e-4);
}

// Llama 4: lora_target_parameters adapts feed_forward.experts with peft's factors on swapped sides
// (lora_A [r·E, out of x @ W], lora_B [in, r·E]: down_proj's A [16, H 64], B [I 32, 16] as peft
// saves them, not [16, 32] and [64, 16]), beside target_modules on the shared expert and dense layers.
TEST(Lora, Llama4TargetParametersBesideItsSharedExpert) {
  auto m = MoeModel::load(ref_dir("llama4") + "/model", LoadOptions{});
  LoraSpec spec;
  spec.r = 4;
  spec.alpha = 8;
  spec.targets = {"gate_proj"};
  spec.target_parameters = {kDownParam};
  m->add_lora(spec);
  std::vector<std::string> names;
  for (const auto& [n, t] : peft_lora_tensors(m->lora_parameters())) names.push_back(n + " " + c10::str(t.sizes()));
  const std::string l1 = "base_model.model.model.layers.1.feed_forward.", l3 = "base_model.model.model.layers.3.feed_forward.";
  EXPECT_EQ(names, (std::vector<std::string>{
                       "base_model.model.model.layers.0.feed_forward.gate_proj.lora_A.weight [4, 64]",
                       "base_model.model.model.layers.0.feed_forward.gate_proj.lora_B.weight [48, 4]",
                       l1 + "experts.lora_A.weight [16, 64]", l1 + "experts.lora_B.weight [32, 16]",
                       l1 + "shared_expert.gate_proj.lora_A.weight [4, 64]", l1 + "shared_expert.gate_proj.lora_B.weight [32, 4]",
                       "base_model.model.model.layers.2.feed_forward.gate_proj.lora_A.weight [4, 64]",
                       "base_model.model.model.layers.2.feed_forward.gate_proj.lora_B.weight [48, 4]",
                       l3 + "experts.lora_A.weight [16, 64]", l3 + "experts.lora_B.weight [32, 16]",
                       l3 + "shared_expert.gate_proj.lora_A.weight [4, 64]", l3 + "shared_expert.gate_proj.lora_B.weight [32, 4]"}));
}

// The delta-rule families' packed rows: one row of two documents (7 and 6 tokens, positions
// restarting) against transformers run on each document alone, the conv1d window and the delta
// rule's state restarting at the second; then with the LoRA on every linear (delta-rule
// projections, gated attention, experts, shared expert): logits, summed loss and every gradient
// against peft's. `linears`: each delta-rule layer's LoRA-carrying linears (0: a family without them).
void expect_packed_rows_match_transformers(const std::string& arch, std::size_t linears) {
  SCOPED_TRACE(arch);
  const std::string dir = ref_dir(arch);
  const Ref r = load_ref(dir);
  Batch packed;
  packed.input_ids = r["input_ids"].narrow(0, 0, 1);
  packed.labels = r["packed_labels"];
  packed.positions = at::cat({at::arange(7), at::arange(6)}).view({1, 13});
  packed.segment_ids = at::cat({at::full({7}, 1, at::kLong), at::full({6}, 2, at::kLong)}).view({1, 13});
  auto m = MoeModel::load(dir + "/model", LoadOptions{});
  {
    c10::NoGradGuard no_grad;
    const auto out = m->forward(packed);
    EXPECT_LT(rel_err(out.logits, r["logits_packed"]), 1e-4);
    EXPECT_NEAR(out.loss_sum.item<double>(), r["loss_sum_packed"].item<double>(), 1e-5 * r["loss_sum_packed"].item<double>());
    Batch unpacked = packed;  // the documents run into each other: a different answer, so the reset matters
    unpacked.segment_ids = at::Tensor();
    unpacked.positions = at::Tensor();
    EXPECT_GT(rel_err(m->forward(unpacked).logits.narrow(1, 7, 6), r["logits_packed"].narrow(1, 7, 6)), 1e-3);
  }
  m->load_adapter(dir + "/adapter");
  const auto out = m->forward(packed);
  EXPECT_LT(rel_err(out.logits, r["logits_packed_lora"]), 1e-4);
  EXPECT_NEAR(out.loss_sum.item<double>(), r["loss_sum_packed_lora"].item<double>(), 1e-5 * r["loss_sum_packed_lora"].item<double>());
  out.loss_sum.backward();
  NamedLora stacked = m->lora_parameters(), stacked_grads;
  for (const auto& [name, p] : stacked) stacked_grads.emplace_back(name, p.grad().defined() ? p.grad() : at::zeros_like(p));
  const auto grads = peft_lora_tensors(stacked_grads);
  std::size_t n_ref = 0, linear_attn = 0;
  for (const auto& t : r.file->tensors()) n_ref += t.name.rfind("grad_packed.", 0) == 0;
  EXPECT_EQ(grads.size(), n_ref);
  double largest = 0;
  for (const auto& [name, g] : grads) largest = std::max(largest, g.abs().max().item<double>());
  for (const auto& [name, g] : grads) {
    SCOPED_TRACE(name);
    const at::Tensor want = r["grad_packed." + name];
    linear_attn += name.find(".linear_attn.") != std::string::npos;
    if (want.abs().max().item<double>() == 0.0) {
      // An expert only a document's last token reached: no loss depends on that token, so run alone
      // transformers gives it exactly zero; in the packed row the masks that end the document are
      // exact but the chunked backward's sums pass it fp32 rounding (seen: 5e-8 beside gradients of 1e2).
      EXPECT_LT(g.abs().max().item<double>(), 1e-7 * largest);
      continue;
    }
    EXPECT_LT(rel_err(g, want), lora_grad_tolerance(m->config()));
  }
  EXPECT_EQ(linear_attn, 3u * linears * 2u) << "three delta-rule layers, A and B of each linear";
}

TEST(Model, Qwen3NextPackedRowsMatchTransformersPerDocument) { expect_packed_rows_match_transformers("qwen3_next", 3); }
TEST(Model, Qwen35MoePackedRowsMatchTransformersPerDocument) { expect_packed_rows_match_transformers("qwen3_5_moe_mm", 5); }
// ERNIE-4.5-MoE and Hunyuan-MoE: no delta-rule layers; the packed row against each document alone, base and LoRA.
TEST(Model, Ernie45MoePackedRowsMatchTransformersPerDocument) { expect_packed_rows_match_transformers("ernie4_5_moe", 0); }
TEST(Model, HunyuanV1MoePackedRowsMatchTransformersPerDocument) { expect_packed_rows_match_transformers("hunyuan_v1_moe", 0); }

// Qwen3-Next's layer kinds and LoRA names as transformers 5.24's Qwen3NextConfig and peft give them.
TEST(HfConfig, Qwen3NextLayersAndModuleNames) {
  const ModelConfig c = load_config(ref_dir("qwen3_next") + "/model");
  EXPECT_EQ(c.arch, Arch::Qwen3Next);
  ASSERT_TRUE(c.linear_attn.has_value());
  EXPECT_EQ(c.linear_attn->layers, (std::vector<bool>{true, true, true, false}));
  EXPECT_EQ(c.rope.dim, 4);  // partial_rotary_factor 0.25 of head_dim 16
  EXPECT_TRUE(c.norm_plus_one && c.attn_output_gate && c.shared_expert_gated);
  EXPECT_FALSE(c.experts_lora_ok());  // transformers 5.24 holds the experts fused only
  EXPECT_EQ(c.moe_layer_count(), 4);
  EXPECT_EQ(c.attention_linears(), (std::vector<std::string>{"q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkvz",
                                                              "in_proj_ba", "out_proj"}));
  const auto shapes = c.attention_shapes(0);
  ASSERT_EQ(shapes.size(), 3u);
  EXPECT_EQ(shapes[0].module, "linear_attn");
  EXPECT_EQ(shapes[0].out, 2 * 2 * 8 + 2 * 4 * 12);  // [q; k; v; z] of 2 key heads (8) and 4 value heads (12)
  EXPECT_EQ(c.attention_shapes(3)[0].out, 2 * 4 * 16);  // q_proj: each head's query and gate
  std::set<std::string> names;
  for (const auto& mod : hf_linear_modules(c)) names.insert(mod.name);
  for (const char* want : {"model.layers.0.linear_attn.in_proj_qkvz", "model.layers.2.linear_attn.out_proj",
                           "model.layers.3.self_attn.q_proj", "model.layers.0.mlp.shared_expert.gate_proj",
                           "model.layers.0.mlp.shared_expert_gate", "model.layers.1.mlp.shared_expert.down_proj"})
    EXPECT_TRUE(names.count(want)) << want;
  EXPECT_FALSE(names.count("model.layers.0.self_attn.q_proj"));
  EXPECT_FALSE(names.count("model.layers.0.mlp.experts.0.gate_proj"));
}

// The real shapes in configs/models (Hub spelling: rope_scaling, top-level partial_rotary_factor):
// the RoPE and softmax-scale numbers are transformers 5.24's (DeepseekV2Attention.scaling,
// *RotaryEmbedding.attention_scaling / inv_freq), printed from those files.
TEST(HfConfig, NewerFamiliesRealShapesMatchTransformers) {
  const ModelConfig v2 = load_config(std::string(EO_SOURCE_DIR) + "/configs/models/deepseek-v2-lite");
  ASSERT_TRUE(v2.mla.has_value());
  EXPECT_EQ(v2.mla->q_lora_rank, 0);
  EXPECT_EQ(v2.mla->kv_lora_rank, 512);
  EXPECT_EQ(v2.mla->qk_dim(), 192);
  EXPECT_EQ(v2.head_dim, 64);
  EXPECT_EQ(v2.rope.dim, 64);
  EXPECT_TRUE(v2.rope.interleaved && v2.rope.yarn);
  EXPECT_DOUBLE_EQ(v2.rope.attention_factor, 1.0);
  EXPECT_NEAR(v2.attn_scale, 0.1147213867929261, 1e-15);
  const at::Tensor f2 = rope_inv_freq(v2.rope, v2.rope_theta, at::kCPU);
  ASSERT_EQ(f2.size(0), 32);
  const double want2[] = {1.0, 0.23713736236095428, 0.0035619973205029964, 1.8747354260995053e-05, 3.3338035336782923e-06};
  const int at_idx[] = {0, 5, 17, 25, 31};
  for (int i = 0; i < 5; ++i) EXPECT_NEAR(f2[at_idx[i]].item<double>(), want2[i], 1e-6 * want2[i]) << at_idx[i];
  EXPECT_EQ(v2.experts, 64);
  EXPECT_EQ(v2.top_k, 6);
  EXPECT_EQ(v2.shared_expert_width, 2 * 1408);
  EXPECT_FALSE(v2.shared_expert_gated);
  EXPECT_FALSE(v2.is_moe_layer(0));
  EXPECT_TRUE(v2.is_moe_layer(1) && v2.is_moe_layer(26));
  EXPECT_EQ(v2.router.score, RouterScore::Softmax);
  EXPECT_EQ(v2.router.group, GroupScore::None);
  EXPECT_FALSE(v2.has_aux_loss);
  EXPECT_EQ(v2.linear_modules(), (std::vector<std::string>{"q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj",
                                                            "up_proj", "down_proj"}));

  const ModelConfig glm = load_config(std::string(EO_SOURCE_DIR) + "/configs/models/glm-4.5-air");
  EXPECT_FALSE(glm.mla.has_value());
  EXPECT_EQ(glm.head_dim, 128);
  EXPECT_EQ(glm.rope.dim, 64);
  EXPECT_FALSE(glm.rope.interleaved || glm.rope.yarn);
  EXPECT_NEAR(glm.attn_scale, 1 / std::sqrt(128.0), 1e-15);
  const at::Tensor fg = rope_inv_freq(glm.rope, glm.rope_theta, at::kCPU);
  const double wantg[] = {1.0, 0.11547820270061493, 0.0006493816617876291, 2.0535249859676696e-05, 1.5399265294036013e-06};
  for (int i = 0; i < 5; ++i) EXPECT_NEAR(fg[at_idx[i]].item<double>(), wantg[i], 1e-6 * wantg[i]) << at_idx[i];
  EXPECT_TRUE(glm.qkv_bias);
  EXPECT_FALSE(glm.o_bias);
  EXPECT_EQ(glm.router.score, RouterScore::Sigmoid);
  EXPECT_TRUE(glm.router.correction_bias && glm.router.fp32 && glm.norm_topk_prob);
  EXPECT_EQ(glm.shared_expert_width, 1408);
  EXPECT_FALSE(glm.is_moe_layer(0));
  EXPECT_TRUE(glm.is_moe_layer(1));
  EXPECT_EQ(glm.linear_modules(), (std::vector<std::string>{"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                             "down_proj"}));
}

TEST(HfConfig, GptOssRealShapeMatchesTransformers) {
  const ModelConfig c = load_config(std::string(EO_SOURCE_DIR) + "/configs/models/gpt-oss-20b");
  EXPECT_EQ(c.arch, Arch::GptOss);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.rope.dim, 64);
  EXPECT_TRUE(c.rope.yarn && !c.rope.truncate && !c.rope.interleaved);
  EXPECT_NEAR(c.rope.attention_factor, 1.3465735902799727, 1e-15);  // GptOssRotaryEmbedding.attention_scaling
  const at::Tensor f = rope_inv_freq(c.rope, c.rope_theta, at::kCPU);
  const double want[] = {1.0, 0.15532298386096954, 0.00012931869423482567, 2.8250667583051836e-06, 3.023511396804679e-07};
  const int idx[] = {0, 5, 17, 25, 31};
  for (int i = 0; i < 5; ++i) EXPECT_NEAR(f[idx[i]].item<double>(), want[i], 1e-6 * want[i]) << idx[i];
  EXPECT_EQ(c.experts, 32);
  EXPECT_EQ(c.top_k, 4);
  EXPECT_EQ(c.expert_width, 2880);
  EXPECT_TRUE(c.attention_sinks && c.expert_bias && c.router.bias && c.qkv_bias && c.o_bias);
  EXPECT_EQ(c.router.score, RouterScore::SoftmaxTopK);
  ASSERT_TRUE(c.swiglu_clamp.has_value());
  EXPECT_EQ(c.swiglu_clamp->limit, 7.0);
  EXPECT_EQ(c.swiglu_clamp->alpha, 1.702);
  EXPECT_EQ(c.sliding_window, 128);
  EXPECT_TRUE(c.is_sliding_layer(0) && !c.is_sliding_layer(1) && c.is_sliding_layer(22) && !c.is_sliding_layer(23));
  EXPECT_TRUE(c.has_aux_loss);
  EXPECT_EQ(c.router_aux_loss_coef, 0.9);
  // Its experts have no per-expert modules for peft: lora_target_linear is the attention.
  EXPECT_EQ(c.linear_modules(), (std::vector<std::string>{"q_proj", "k_proj", "v_proj", "o_proj"}));
  // The Hub file's MXFP4 quantization_config is gpt-oss's (its experts are dequantised at load);
  // on another family it is refused before any weight is read.
  std::ifstream in(std::string(EO_SOURCE_DIR) + "/configs/models/gpt-oss-20b/config.json");
  nlohmann::json j = nlohmann::json::parse(in);
  j["quantization_config"] = {{"quant_method", "mxfp4"}};
  EXPECT_NO_THROW(parse_config(j, "oss/config.json"));
  nlohmann::json glm = j;
  glm["model_type"] = "glm4_moe";
  try {
    parse_config(glm, "glm/config.json");
    ADD_FAILURE() << "MXFP4 on glm4_moe was accepted";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("'mxfp4' is supported for gpt_oss experts only"), std::string::npos) << e.what();
  }
  j.erase("quantization_config");
  j["layer_types"][3] = "chunked_attention";
  try {
    parse_config(j, "oss/config.json");
    ADD_FAILURE() << "chunked attention was accepted";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("layer_types entry \"chunked_attention\" is not supported"), std::string::npos) << e.what();
  }
}

// GLM-4.7-Flash and Mistral Small 4 (configs/models/): the values transformers 5.24 derives from
// the same files (attention.scaling, the rotary's inv_freq and attention_scaling, the layer kinds).
TEST(HfConfig, LatentAttentionDescendantsRealShapesMatchTransformers) {
  const int at_idx[] = {0, 5, 17, 25, 31};
  const ModelConfig g = load_config(std::string(EO_SOURCE_DIR) + "/configs/models/glm-4.7-flash");
  EXPECT_EQ(g.arch, Arch::Glm4MoeLite);
  ASSERT_TRUE(g.mla.has_value());
  EXPECT_EQ(g.mla->q_lora_rank, 768);
  EXPECT_EQ(g.mla->qk_dim(), 256);
  EXPECT_EQ(g.rope.dim, 64);
  EXPECT_TRUE(g.rope.interleaved && !g.rope.yarn);
  EXPECT_DOUBLE_EQ(g.attn_scale, 0.0625);
  const at::Tensor fg = rope_inv_freq(g.rope, g.rope_theta, at::kCPU);
  const double wantg[] = {1.0, 0.11547820270061493, 0.0006493816617876291, 2.0535249859676696e-05, 1.5399265294036013e-06};
  for (int i = 0; i < 5; ++i) EXPECT_NEAR(fg[at_idx[i]].item<double>(), wantg[i], 1e-6 * wantg[i]) << at_idx[i];
  EXPECT_EQ(g.experts, 64);
  EXPECT_EQ(g.top_k, 4);
  EXPECT_EQ(g.shared_expert_width, 1536);
  EXPECT_DOUBLE_EQ(g.router.scaling, 1.8);
  EXPECT_EQ(g.router.score, RouterScore::Sigmoid);
  EXPECT_TRUE(g.router.correction_bias && g.router.fp32 && g.norm_topk_prob);
  EXPECT_EQ(g.router.group, GroupScore::None);
  EXPECT_FALSE(g.qkv_bias || g.o_bias || g.has_aux_loss);
  EXPECT_DOUBLE_EQ(g.rms_eps, 1e-5);
  EXPECT_FALSE(g.is_moe_layer(0));
  EXPECT_TRUE(g.is_moe_layer(1) && g.is_moe_layer(46));
  EXPECT_EQ(g.llama4_beta, 0.0);
  EXPECT_EQ(g.linear_modules(), (std::vector<std::string>{"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
                                                           "gate_proj", "up_proj", "down_proj"}));

  const ModelConfig m = load_config(std::string(EO_SOURCE_DIR) + "/configs/models/mistral-small-4");
  EXPECT_EQ(m.arch, Arch::Mistral4);
  ASSERT_TRUE(m.mla.has_value());
  EXPECT_EQ(m.mla->qk_dim(), 128);
  EXPECT_EQ(m.rope.dim, 64);  // partial_rotary_factor 0.5 of the 128-dim head
  EXPECT_TRUE(m.rope.interleaved && m.rope.yarn);
  EXPECT_DOUBLE_EQ(m.rope.attention_factor, 1.0);
  EXPECT_NEAR(m.attn_scale, 0.19496949473302969, 1e-15);
  const at::Tensor fm = rope_inv_freq(m.rope, m.rope_theta, at::kCPU);
  const double wantm[] = {1.0, 0.23713736236095428, 0.004637266509234905, 5.858548320247792e-06, 1.04181367532874e-06};
  for (int i = 0; i < 5; ++i) EXPECT_NEAR(fm[at_idx[i]].item<double>(), wantm[i], 1e-6 * wantm[i]) << at_idx[i];
  EXPECT_EQ(m.experts, 128);
  EXPECT_EQ(m.top_k, 4);
  EXPECT_EQ(m.router.score, RouterScore::Softmax);
  EXPECT_FALSE(m.router.correction_bias || m.router.fp32 || m.has_aux_loss);
  EXPECT_TRUE(m.norm_topk_prob);
  EXPECT_TRUE(m.is_moe_layer(0) && m.is_moe_layer(35));
  EXPECT_DOUBLE_EQ(m.llama4_beta, 0.1);
  EXPECT_DOUBLE_EQ(m.llama4_positions, 8192);

  // Mistral Small 4 as the Hub ships it: Mistral3ForConditionalGeneration around that text model.
  // The text model reads the same; lm_head is tied by the wrapper's tie_word_embeddings (transformers
  // 5.24's Mistral3Config: true by default), not by text_config's.
  nlohmann::json text;
  std::ifstream(std::string(EO_SOURCE_DIR) + "/configs/models/mistral-small-4/config.json") >> text;
  nlohmann::json wrapped = {{"model_type", "mistral3"}, {"text_config", text}, {"vision_config", {{"model_type", "pixtral"}}}};
  const ModelConfig w = parse_config(wrapped, "w.json");
  EXPECT_EQ(w.arch, Arch::Mistral4);
  EXPECT_EQ(w.model_type, "mistral3");
  ASSERT_TRUE(w.multimodal.has_value());
  EXPECT_EQ(w.multimodal->class_name, "Mistral3ForConditionalGeneration");
  EXPECT_EQ(w.decoder_prefix(), "model.language_model.");
  EXPECT_EQ(w.linear_modules(), m.linear_modules());
  EXPECT_EQ(w.experts, m.experts);
  EXPECT_DOUBLE_EQ(w.attn_scale, m.attn_scale);
  EXPECT_TRUE(w.tie_word_embeddings);
  wrapped["tie_word_embeddings"] = false;
  EXPECT_FALSE(parse_config(wrapped, "w.json").tie_word_embeddings);
}

// Every option the newer families cannot honour is refused before a weight loads, naming the key.
TEST(HfConfig, UnsupportedOptionsOfNewerFamiliesAreNamed) {
  const nlohmann::json v2 = nlohmann::json::parse(R"({"model_type": "deepseek_v2", "hidden_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100, "q_lora_rank": null, "kv_lora_rank": 16,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12, "n_routed_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "intermediate_size": 64, "first_k_dense_replace": 1, "rope_theta": 10000})");
  const nlohmann::json glm = nlohmann::json::parse(R"({"model_type": "glm4_moe", "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 100, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "intermediate_size": 64, "rope_theta": 10000})");
  EXPECT_NO_THROW(parse_config(v2, "c.json"));
  EXPECT_NO_THROW(parse_config(glm, "c.json"));
  auto msg = [](nlohmann::json j, const nlohmann::json& patch) -> std::string {
    j.merge_patch(patch);
    try {
      parse_config(j, "dir/config.json");
    } catch (const UsageError& e) {
      return e.what();
    }
    return "(accepted)";
  };
  auto expect = [&](const nlohmann::json& base, const char* patch, const char* want) {
    const std::string m = msg(base, nlohmann::json::parse(patch));
    EXPECT_NE(m.find(want), std::string::npos) << patch << " -> " << m;
    EXPECT_NE(m.find("dir/config.json"), std::string::npos) << m;
  };
  expect(v2, R"({"norm_topk_prob": true})", "norm_topk_prob true is not supported for deepseek_v2");
  expect(v2, R"({"topk_method": "noaux_tc"})", "topk_method 'noaux_tc' is not supported for deepseek_v2");
  expect(v2, R"({"scoring_func": "sigmoid"})", "scoring_func \"sigmoid\" is not supported");
  expect(v2, R"({"moe_layer_freq": 2})", "moe_layer_freq 2 is not supported");
  expect(v2, R"({"num_key_value_heads": 2})", "must equal num_attention_heads");
  expect(v2, R"({"rope_scaling": {"type": "dynamic", "factor": 2}})", "rope_scaling.rope_type 'dynamic' is not supported");
  expect(v2, R"({"partial_rotary_factor": 0.5})", "partial_rotary_factor is not supported for deepseek_v2");
  expect(v2, R"({"hidden_act": "gelu"})", "hidden_act 'gelu' is not supported");
  expect(v2, R"({"topk_method": "group_limited_greedy", "n_group": 3})", "n_group (3) must divide");
  expect(v2, R"({"qk_rope_head_dim": 7})", "head_dim must be even for RoPE");
  nlohmann::json no_q = v2;
  no_q.erase("q_lora_rank");
  EXPECT_NE(msg(no_q, nlohmann::json::object()).find("'q_lora_rank' is missing"), std::string::npos);
  expect(glm, R"({"scoring_func": "softmax"})", "scoring_func \"softmax\" is not supported");
  expect(glm, R"({"n_group": 8, "topk_group": 2})", "needs at least two experts");
  expect(glm, R"({"n_group": 4, "topk_group": 1, "num_experts_per_tok": 3})", "exceeds the experts of the 1 groups");
  expect(glm, R"({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1}})", "rope_type 'longrope' is not supported");
  expect(glm, R"({"partial_rotary_factor": 0.1})", "rotary dimension (1) must be positive and even");
  // glm4_moe_lite's layer kinds come from mlp_layer_types; mistral4 needs its YaRN and query scaling.
  const nlohmann::json lite = nlohmann::json::parse(R"({"model_type": "glm4_moe_lite", "hidden_size": 64,
    "num_hidden_layers": 3, "num_attention_heads": 4, "vocab_size": 100, "q_lora_rank": null, "kv_lora_rank": 16,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12, "n_routed_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "intermediate_size": 64, "rope_theta": 10000})");
  const ModelConfig lc = parse_config(lite, "c.json");
  EXPECT_TRUE(!lc.is_moe_layer(0) && lc.is_moe_layer(1) && lc.is_moe_layer(2));
  nlohmann::json middle = lite;
  middle["mlp_layer_types"] = {"sparse", "dense", "sparse"};
  const ModelConfig mc = parse_config(middle, "c.json");
  EXPECT_TRUE(mc.is_moe_layer(0) && !mc.is_moe_layer(1) && mc.is_moe_layer(2));
  expect(lite, R"({"first_k_dense_replace": 2})", "first_k_dense_replace 2 disagrees with the dense layers");
  expect(lite, R"({"mlp_layer_types": ["dense", "moe", "sparse"]})", "mlp_layer_types entry \"moe\" is not supported");
  expect(lite, R"({"mlp_layer_types": ["dense"]})", "mlp_layer_types must be a list of num_hidden_layers (3)");
  expect(lite, R"({"partial_rotary_factor": 0.5})", "partial_rotary_factor is not supported for glm4_moe_lite");
  expect(lite, R"({"topk_method": "greedy"})", "topk_method \"greedy\" is not supported");
  nlohmann::json m4 = lite;
  m4["model_type"] = "mistral4";
  m4.erase("rope_theta");
  m4["rope_parameters"] = nlohmann::json::parse(R"({"rope_type": "yarn", "rope_theta": 10000, "factor": 4,
    "original_max_position_embeddings": 64, "llama_4_scaling_beta": 0.1})");
  const ModelConfig m4c = parse_config(m4, "c.json");
  EXPECT_EQ(m4c.rope.dim, 8);  // the default partial_rotary_factor: qk_rope / (qk_nope + qk_rope)
  EXPECT_DOUBLE_EQ(m4c.llama4_positions, 64);
  nlohmann::json m4_bare = m4;
  m4_bare.erase("rope_parameters");
  m4_bare["rope_theta"] = 10000;
  EXPECT_NE(msg(m4_bare, nlohmann::json::object()).find("mistral4 needs 'rope_parameters'"), std::string::npos);
  nlohmann::json m4_nobeta = m4;
  m4_nobeta["rope_parameters"].erase("llama_4_scaling_beta");
  EXPECT_NE(msg(m4_nobeta, nlohmann::json::object()).find("needs rope_parameters.llama_4_scaling_beta"), std::string::npos);
  expect(m4, R"({"rope_parameters": {"rope_type": "default"}})", "rope_type 'default' is not supported for mistral4");
  expect(m4, R"({"rope_parameters": {"partial_rotary_factor": 1.0}})", "it rotates 24 dims of 24");
  expect(m4, R"({"scoring_func": "sigmoid"})", "scoring_func \"sigmoid\" is not supported");
  // The older families keep refusing what they always refused.
  const nlohmann::json qwen = nlohmann::json::parse(R"({"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 1,
    "num_attention_heads": 4, "vocab_size": 100, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "rope_theta": 10000})");
  expect(qwen, R"({"rope_scaling": {"rope_type": "yarn", "factor": 4}})", "(only 'default' RoPE)");
  expect(qwen, R"({"partial_rotary_factor": 0.5})", "partial_rotary_factor is not supported for qwen3_moe");
}

// gpt-oss MXFP4 experts (tests/ref/mxfp4_ref.py): the dequantisation is transformers'
// convert_moe_packed_tensors bit for bit (every code at every scale byte, the Hub layout), whether
// the bytes are the checkpoint's tensors or a QuantizedWeight held in MXFP4 (whole, stacked,
// windowed, any output dtype); the checkpoint loads as transformers' model with
// Mxfp4Config(dequantize=True), and QLoRA on it with the experts kept in MXFP4 gives transformers'
// + peft's logits, loss and gradients.
std::string mxfp4_dir() { return eo::testing::python_fixture("mxfp4_ref.py", "mxfp4_ref", "gpt_oss"); }

bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() &&
         (a.scalar_type() == at::kFloat ? a.view(at::kInt).equal(b.view(at::kInt)) : a.view(at::kShort).equal(b.view(at::kShort)));
}

TEST(Mxfp4, DequantisationIsBitExactAgainstTransformers) {
  const Ref r = load_ref(mxfp4_dir());
  for (const char* t : {"random", "layer0.gate_up_proj", "layer0.down_proj"}) {
    SCOPED_TRACE(t);
    const std::string n(t);
    const at::Tensor blocks = r[n + ".blocks"], scales = r[n + ".scales"], want = r[n + ".expected"];  // [E, rows, cols]
    const at::Tensor got = mxfp4::dequantize(blocks, scales);
    ASSERT_EQ(got.sizes(), want.sizes());
    ASSERT_EQ(got.scalar_type(), at::kBFloat16);
    EXPECT_TRUE(same_bits(got, want)) << "bf16 bit patterns differ";
    // Each expert's matrix held in MXFP4: the dispatching dequantisers give the same bits (fp32:
    // the same values; fp16: those values rounded), whole, stacked and windowed.
    std::vector<QuantizedWeight> qs;
    for (std::int64_t e = 0; e < blocks.size(0); ++e) qs.push_back(mxfp4::weight(blocks[e], scales[e]));
    std::vector<const QuantizedWeight*> ptrs;
    for (const auto& q : qs) ptrs.push_back(&q);
    EXPECT_EQ(qs[0].format, QuantFormat::Mxfp4);
    EXPECT_EQ(qs[0].shape, (std::vector<std::int64_t>{want.size(1), want.size(2)}));
    EXPECT_EQ(qs[0].bytes(), want.size(1) * want.size(2) / 2 + want.size(1) * want.size(2) / 32);
    for (std::int64_t e = 0; e < blocks.size(0); ++e) {
      EXPECT_TRUE(same_bits(eo::dequantize(qs[e]), want[e])) << "expert " << e;
      EXPECT_TRUE(same_bits(eo::dequantize(qs[e], at::kFloat), want[e].to(at::kFloat))) << "expert " << e;
      EXPECT_TRUE(same_bits(eo::dequantize(qs[e], at::kHalf), want[e].to(at::kHalf))) << "expert " << e;
    }
    EXPECT_TRUE(same_bits(eo::dequantize_stack(ptrs, at::kBFloat16), want));
    const std::int64_t rows = want.size(1), cols = want.size(2);
    const std::int64_t r0 = rows / 3, nr = rows / 2, c0 = 8, nc = cols - 16;
    EXPECT_TRUE(same_bits(eo::dequantize_stack_window(ptrs, at::kBFloat16, r0, nr, c0, nc),
                          want.narrow(1, r0, nr).narrow(2, c0, nc).contiguous()));
  }
  // The extremes are covered: every scale byte with every code, so ±inf (2^128 and beyond),
  // bf16 subnormals (scale bytes 0 and 1) and -0.
  const at::Tensor all = r["random.expected"].to(at::kFloat);
  EXPECT_TRUE(all.isinf().any().item<bool>());
  EXPECT_TRUE(((all.abs() > 0) & (all.abs() < 1.1754943508222875e-38)).any().item<bool>());
  EXPECT_TRUE((all.eq(0) & all.signbit()).any().item<bool>());
}

// The checkpoint's expert rows re-arranged into eo-ddp's [out, in] matrices are exactly what
// transformers runs: gate = the even rows of gate_up_proj's [2I, H], up = the odd rows, down as is.
void expect_experts_are_transformers(MoeModel& m, const Ref& r) {
  const at::Tensor gu = r["layer0.gate_up_proj.expected"], down = r["layer0.down_proj.expected"];
  const auto I = m.config().expert_width;
  for (int e = 0; e < m.config().experts; ++e) {
    const auto& gate = m.weight_provider().expert_weight(0, e, ExpertMatrix::Gate);
    ASSERT_EQ(gate.format, QuantFormat::Mxfp4);
    EXPECT_TRUE(same_bits(eo::dequantize(gate, at::kBFloat16), gu[e].slice(0, 0, 2 * I, 2).contiguous())) << "gate " << e;
    EXPECT_TRUE(same_bits(eo::dequantize(m.weight_provider().expert_weight(0, e, ExpertMatrix::Up), at::kBFloat16),
                          gu[e].slice(0, 1, 2 * I, 2).contiguous()))
        << "up " << e;
    EXPECT_TRUE(same_bits(eo::dequantize(m.weight_provider().expert_weight(0, e, ExpertMatrix::Down), at::kBFloat16), down[e]))
        << "down " << e;
  }
}

TEST(Mxfp4, GptOssCheckpointLoadsAsTransformersDequantised) {
  const std::string dir = mxfp4_dir();
  const Ref r = load_ref(dir);
  c10::NoGradGuard no_grad;
  const auto out = MoeModel::load(dir + "/model_mxfp4", LoadOptions{})->forward(ref_batch(r));
  RecordProperty("logits_rel_err", std::to_string(rel_err(out.logits, r["logits"])));
  EXPECT_LT(rel_err(out.logits, r["logits"]), 1e-4);
  EXPECT_NEAR(out.loss_sum.item<double>() / out.tokens, r["loss"].item<double>(), 1e-5 * r["loss"].item<double>());
}

TEST(Mxfp4, QloraWithMxfp4ExpertsMatchesTransformersAndPeft) {
  const std::string dir = mxfp4_dir();
  const Ref r = load_ref(dir);
  LoadOptions lo;
  lo.load_in_4bit = true;  // expert_quant auto: an MXFP4 checkpoint keeps its experts
  auto m = MoeModel::load(dir + "/model_mxfp4", lo);
  expect_experts_are_transformers(*m, r);
  m->load_adapter(dir + "/adapter");
  const auto out = m->forward(ref_batch(r));
  RecordProperty("logits_rel_err", std::to_string(rel_err(out.logits, r["logits_qlora"])));
  EXPECT_LT(rel_err(out.logits, r["logits_qlora"]), 1e-4);
  const at::Tensor loss = out.loss_sum / static_cast<double>(out.tokens);
  EXPECT_NEAR(loss.item<double>(), r["loss_qlora"].item<double>(), 1e-5 * r["loss_qlora"].item<double>());
  loss.backward();
  const auto params = m->lora_parameters();
  std::size_t n_ref = 0;
  for (const auto& t : r.file->tensors()) n_ref += t.name.rfind("grad.", 0) == 0;
  EXPECT_EQ(params.size(), n_ref);
  for (const auto& [name, p] : params) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(p.grad().defined());
    EXPECT_LT(rel_err(p.grad(), r["grad." + name]), 1e-4);
  }
  // Training's own step (runtime/step.h: checkpointed blocks, each staged again for its
  // recompute) on the resident experts and then on MXFP4 homes (the offload engine): bitwise the
  // same loss and gradients, and transformers' + peft's within the same tolerances.
  const auto [resident_loss, resident_grads] = ref_train_step(*m, r, out.tokens);
  auto& bank = static_cast<ResidentWeights&>(m->weight_provider()).bank();
  auto off = std::make_shared<offload::ExpertOffloader>(std::move(bank), offload::OffloadOptions{});
  m->set_weight_provider(off);
  const auto [homed_loss, homed_grads] = ref_train_step(*m, r, out.tokens);
  EXPECT_EQ(homed_loss, resident_loss);
  EXPECT_NEAR(homed_loss, r["loss_qlora"].item<double>(), 1e-5 * r["loss_qlora"].item<double>());
  EXPECT_GT(off->take_step_stats().copies, 0) << "the blocks came from their homes";
  for (std::size_t i = 0; i < params.size(); ++i) {
    SCOPED_TRACE(params[i].first);
    EXPECT_TRUE(homed_grads[i].equal(resident_grads[i]));
    EXPECT_LT(rel_err(homed_grads[i], r["grad." + params[i].first]), 1e-4);
  }
  // expert_quant: nf4 re-quantises the dequantised experts: other logits, NF4 experts.
  c10::NoGradGuard no_grad;
  lo.expert_quant = ExpertQuant::Nf4;
  auto n = MoeModel::load(dir + "/model_mxfp4", lo);
  EXPECT_EQ(n->weight_provider().expert_weight(1, 0, ExpertMatrix::Down).format, QuantFormat::Nf4);
  n->load_adapter(dir + "/adapter");
  EXPECT_GT(rel_err(n->forward(ref_batch(r)).logits, r["logits_qlora"]), 1e-3);
  lo.expert_quant = ExpertQuant::Mxfp4;
  EXPECT_EQ(MoeModel::load(dir + "/model_mxfp4", lo)->weight_provider().expert_weight(2, 5, ExpertMatrix::Up).format,
            QuantFormat::Mxfp4);
}

// expert_quant: mxfp4 needs MXFP4 experts in the checkpoint, and load_in_4bit; each a clear error.
TEST(Mxfp4, ExpertQuantMxfp4NeedsAnMxfp4Checkpoint) {
  const std::string dir = mxfp4_dir();
  LoadOptions lo;
  lo.load_in_4bit = true;
  lo.expert_quant = ExpertQuant::Mxfp4;
  auto message = [](const std::string& model, const LoadOptions& o) -> std::string {
    try {
      MoeModel::load(model, o);
    } catch (const UsageError& e) {
      return e.what();
    }
    return "(accepted)";
  };
  const std::string plain = message(dir + "/model_plain", lo);
  EXPECT_NE(plain.find("expert_quant: mxfp4 keeps experts in MXFP4"), std::string::npos) << plain;
  EXPECT_NE(plain.find("use expert_quant: nf4 or auto"), std::string::npos) << plain;
  const std::string qwen = message(ref_dir("qwen3_moe") + "/model", lo);
  EXPECT_NE(qwen.find("are not MXFP4"), std::string::npos) << qwen;
  lo.load_in_4bit = false;
  const std::string dense = message(dir + "/model_mxfp4", lo);
  EXPECT_NE(dense.find("expert_quant applies with load_in_4bit: true"), std::string::npos) << dense;
  // auto on a float checkpoint: NF4, as before.
  lo.load_in_4bit = true;
  lo.expert_quant = ExpertQuant::Auto;
  EXPECT_EQ(MoeModel::load(dir + "/model_plain", lo)->weight_provider().expert_weight(0, 0, ExpertMatrix::Gate).format,
            QuantFormat::Nf4);
}

// The memory plan counts the MXFP4 experts' bytes as the model holds them, and the offload arena
// as the engine lays it out from the loaded tensors; the engine's views give the resident bits.
TEST(Mxfp4, PlanAndArenaCountTheMxfp4Bytes) {
  const std::string dir = mxfp4_dir();
  TrainConfig cfg;
  cfg.base_model = dir + "/model_mxfp4";
  cfg.load_in_4bit = true;
  cfg.adapter = "qlora";
  const ModelConfig mc = load_config(cfg.base_model);
  ASSERT_TRUE(mc.mxfp4_experts);
  ASSERT_TRUE(experts_in_mxfp4(cfg, mc));
  const MemoryPlan plan = plan_memory(cfg, mc, eo::Compute::Fp32, 1, /*on_gpu=*/false);
  LoadOptions lo;
  lo.load_in_4bit = true;
  auto m = MoeModel::load(cfg.base_model, lo);
  double held = 0;  // what the model holds, counted from its tensors
  for (int l = 0; l < m->num_layers(); ++l)
    for (int e = 0; e < mc.experts; ++e)
      for (auto mx : {ExpertMatrix::Gate, ExpertMatrix::Up, ExpertMatrix::Down}) {
        const auto& q = m->weight_provider().expert_weight(l, e, mx);
        held += double(q.packed.nbytes() + q.scales.nbytes());
      }
  // By hand: H x I weights per matrix, half a byte each plus one scale byte per 32.
  const double per_matrix = double(mc.hidden * mc.expert_width) * (0.5 + 1.0 / 32);
  EXPECT_EQ(held, double(mc.layers * mc.experts * 3) * per_matrix);
  const MemoryPart* experts = nullptr;
  for (const auto& p : plan.device)
    if (p.name == "experts") experts = &p;
  ASSERT_NE(experts, nullptr);
  EXPECT_EQ(experts->bytes, held);
  EXPECT_NE(experts->what.find("MXFP4"), std::string::npos) << experts->what;
  EXPECT_NE(describe_plan(plan, 0).find("MXFP4"), std::string::npos);
  // NF4 for the same checkpoint (expert_quant: nf4) is counted as NF4: 4.5 bits per weight at
  // blocksize 64 (the resident tensors; the tiny arena's 256-byte alignment hides the difference).
  cfg.expert_quant = "nf4";
  EXPECT_FALSE(experts_in_mxfp4(cfg, mc));
  for (const auto& p : plan_memory(cfg, mc, eo::Compute::Fp32, 1, false).device)
    if (p.name == "experts") EXPECT_EQ(p.bytes, double(mc.layers * mc.experts * 3) * double(mc.hidden * mc.expert_width) * (0.5 + 4.0 / 64));
  cfg.expert_quant = "auto";

  // The offload engine's arena: laid out from the tensors themselves, equal to the plan's and the
  // host-RAM check's formula; forward through it gives the resident logits bit for bit.
  Batch b;
  b.input_ids = load_ref(dir)["input_ids"];
  c10::NoGradGuard no_grad;
  const at::Tensor resident = m->forward(b).logits;
  offload::OffloadOptions oo;
  auto& bank = static_cast<ResidentWeights&>(m->weight_provider()).bank();
  auto off = std::make_shared<offload::ExpertOffloader>(std::move(bank), oo);
  m->set_weight_provider(off);
  for (int l = 0; l < mc.layers; ++l) EXPECT_EQ(double(off->block_bytes(l)), plan.block_bytes) << "layer " << l;
  EXPECT_EQ(off->home_bytes(), offload::estimate_home_bytes(mc, 64, false, QuantFormat::Mxfp4));
  EXPECT_TRUE(m->forward(b).logits.equal(resident));
  EXPECT_EQ(off->expert_weight(mc.layers - 1, 0, ExpertMatrix::Down).format, QuantFormat::Mxfp4);
}

// NVFP4 (NVIDIA modelopt) checkpoints (tests/ref/nvfp4_ref.py): the decode is the format's
// definition computed in float64 and rounded once to fp32 (then to bf16 / fp16), for every code at
// every E4M3 scale byte under global scales from fp32 subnormals to overflow; a tiny NVFP4
// qwen3_moe checkpoint (modelopt's layout) loads as transformers' model on the decoded weights, its
// experts held in NVFP4; LoRA on it (attention + fused experts, as axolotl's NVFP4 example) gives
// peft's logits, loss and gradients, and the same bits from offload homes as resident.
std::string nvfp4_dir() { return eo::testing::python_fixture("nvfp4_ref.py", "nvfp4_ref", "qwen3_moe"); }

// Bitwise equal, NaN where the other is NaN (NaN payloads differ between conversions).
bool same_bits_or_nan(const at::Tensor& got, const at::Tensor& want) {
  if (got.scalar_type() != want.scalar_type() || got.sizes() != want.sizes()) return false;
  const at::Tensor gn = got.isnan(), wn = want.isnan();
  if (!gn.equal(wn)) return false;
  const at::Tensor g = got.masked_fill(gn, 0), w = want.masked_fill(wn, 0);
  return got.scalar_type() == at::kFloat ? g.view(at::kInt).equal(w.view(at::kInt)) : g.view(at::kShort).equal(w.view(at::kShort));
}

TEST(Nvfp4, DecodeIsTheFloat64DefinitionBitForBit) {
  const Ref r = load_ref(nvfp4_dir());
  const at::Tensor codes = r["grid.codes"], scales = r["grid.scales"], globals = r["grid.globals"];
  const at::Tensor f32 = r["grid.expected_f32"], bf16 = r["grid.expected_bf16"], f16 = r["grid.expected_f16"];
  std::vector<QuantizedWeight> qs;
  for (std::int64_t i = 0; i < globals.size(0); ++i) {
    SCOPED_TRACE("global scale " + std::to_string(globals[i].item<float>()));
    qs.push_back(nvfp4::weight(codes, scales, globals[i]));
    const QuantizedWeight& q = qs.back();
    EXPECT_EQ(q.format, QuantFormat::Nvfp4);
    EXPECT_EQ(q.shape, (std::vector<std::int64_t>{256, 128}));
    EXPECT_EQ(q.bytes(), 256 * 128 / 2 + 256 * 128 / 16 + 4);
    EXPECT_TRUE(same_bits_or_nan(eo::dequantize(q, at::kFloat), f32[i])) << "fp32";
    EXPECT_TRUE(same_bits_or_nan(eo::dequantize(q, at::kBFloat16), bf16[i])) << "bf16";
    EXPECT_TRUE(same_bits_or_nan(eo::dequantize(q, at::kHalf), f16[i])) << "fp16";
    // The checkpoint's own dtypes (scales as float8_e4m3fn, a 0-dim global) give the same.
    EXPECT_TRUE(same_bits_or_nan(nvfp4::dequantize(codes, scales.view(at::kFloat8_e4m3fn), globals[i].reshape({}), at::kFloat), f32[i]));
  }
  std::vector<const QuantizedWeight*> ptrs;
  for (const auto& q : qs) ptrs.push_back(&q);
  EXPECT_TRUE(same_bits_or_nan(eo::dequantize_stack(ptrs, at::kBFloat16), bf16));
  EXPECT_TRUE(same_bits_or_nan(eo::dequantize_stack_window(ptrs, at::kFloat, 37, 100, 24, 72),
                               f32.narrow(1, 37, 100).narrow(2, 24, 72).contiguous()));
  // The reference covers what it claims: NaN scale bytes, inf (overflow), fp32 subnormals, -0.
  EXPECT_TRUE(f32.isnan().any().item<bool>());
  EXPECT_TRUE(f32.isinf().any().item<bool>());
  EXPECT_TRUE(((f32.abs() > 0) & (f32.abs() < 1.1754943508222875e-38)).any().item<bool>());
  EXPECT_TRUE((f32.eq(0) & f32.signbit()).any().item<bool>());
  // Malformed tensors are refused with what was expected.
  try {
    nvfp4::weight(codes.narrow(1, 0, 60), scales, globals[0]);
    ADD_FAILURE() << "accepted mismatched codes and scales";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("expected uint8 codes [out, in / 2], scales [out, in / 16]"), std::string::npos) << e.what();
  }
}

TEST(Nvfp4, CheckpointLoadsAsTransformersOnTheDecodedWeights) {
  const std::string dir = nvfp4_dir();
  const Ref r = load_ref(dir);
  const ModelConfig mc = load_config(dir + "/model_nvfp4");
  EXPECT_TRUE(mc.nvfp4);
  c10::NoGradGuard no_grad;
  for (const bool four_bit : {false, true}) {
    SCOPED_TRACE(four_bit ? "load_in_4bit" : "lora base");
    LoadOptions lo;
    lo.load_in_4bit = four_bit;
    auto m = MoeModel::load(dir + "/model_nvfp4", lo);
    // The experts keep the checkpoint's NVFP4, which decodes to the reference's fp32.
    const auto& gate = m->weight_provider().expert_weight(1, 0, ExpertMatrix::Gate);
    ASSERT_EQ(gate.format, QuantFormat::Nvfp4);
    EXPECT_TRUE(same_bits_or_nan(eo::dequantize(gate, at::kFloat), r["tensor.model.layers.1.mlp.experts.0.gate_proj.weight.expected_f32"]));
    EXPECT_TRUE(same_bits_or_nan(eo::dequantize(m->weight_provider().expert_weight(2, 5, ExpertMatrix::Down), at::kFloat),
                                 r["tensor.model.layers.2.mlp.experts.5.down_proj.weight.expected_f32"]));
    const auto out = m->forward(ref_batch(r));
    RecordProperty(four_bit ? "logits_rel_err_4bit" : "logits_rel_err", std::to_string(rel_err(out.logits, r["logits"])));
    EXPECT_LT(rel_err(out.logits, r["logits"]), 1e-5);
    EXPECT_NEAR(out.loss_sum.item<double>() / out.tokens, r["loss"].item<double>(), 1e-6 * r["loss"].item<double>());
  }
  // expert_quant: nf4 re-quantises the experts: NF4, other logits.
  LoadOptions lo;
  lo.load_in_4bit = true;
  lo.expert_quant = ExpertQuant::Nf4;
  auto n = MoeModel::load(dir + "/model_nvfp4", lo);
  EXPECT_EQ(n->weight_provider().expert_weight(1, 0, ExpertMatrix::Up).format, QuantFormat::Nf4);
  EXPECT_GT(rel_err(n->forward(ref_batch(r)).logits, r["logits"]), 1e-4);
}

// The model's LoRA gradients (after a backward) under peft's names against the reference's
// `prefix`<name> tensors, each within 1e-4; every reference gradient has one. Returns how many are
// fused-expert parameters.
std::size_t expect_peft_gradients(MoeModel& m, const Ref& r, const std::string& prefix) {
  NamedLora trained = m.lora_parameters(), grads;
  for (const auto& [name, p] : trained) grads.emplace_back(name, p.grad().defined() ? p.grad() : at::zeros_like(p));
  const auto params = peft_lora_tensors(trained), peft_grads = peft_lora_tensors(grads);
  std::size_t n_ref = 0, fused = 0;
  for (const auto& t : r.file->tensors()) n_ref += t.name.rfind(prefix, 0) == 0;
  EXPECT_EQ(params.size(), n_ref);
  for (std::size_t i = 0; i < params.size(); ++i) {
    SCOPED_TRACE(params[i].first);
    fused += params[i].first.find(".experts.") != std::string::npos;
    EXPECT_LT(rel_err(peft_grads[i].second, r[prefix + params[i].first]), 1e-4);
  }
  return fused;
}

TEST(Nvfp4, ExpertLoraMatchesPeftAndOffloadedIsResident) {
  const std::string dir = nvfp4_dir();
  const Ref r = load_ref(dir);
  auto m = MoeModel::load(dir + "/model_nvfp4", LoadOptions{});
  m->load_adapter(dir + "/adapter_params");
  const auto out = m->forward(ref_batch(r));
  RecordProperty("logits_rel_err", std::to_string(rel_err(out.logits, r["logits_params"])));
  EXPECT_LT(rel_err(out.logits, r["logits_params"]), 1e-4);
  const at::Tensor loss = out.loss_sum / static_cast<double>(out.tokens);
  EXPECT_NEAR(loss.item<double>(), r["loss_params"].item<double>(), 1e-5 * r["loss_params"].item<double>());
  loss.backward();
  EXPECT_GT(expect_peft_gradients(*m, r, "grad_params."), 0u);
  // Training's own step on the resident NVFP4 experts, then on NVFP4 homes: the same bits.
  const auto [resident_loss, resident_grads] = ref_train_step(*m, r, out.tokens);
  auto& bank = static_cast<ResidentWeights&>(m->weight_provider()).bank();
  auto off = std::make_shared<offload::ExpertOffloader>(std::move(bank), offload::OffloadOptions{});
  m->set_weight_provider(off);
  const auto [homed_loss, homed_grads] = ref_train_step(*m, r, out.tokens);
  EXPECT_EQ(homed_loss, resident_loss);
  EXPECT_GT(off->take_step_stats().copies, 0) << "the blocks came from their homes";
  EXPECT_EQ(off->expert_weight(1, 3, ExpertMatrix::Up).format, QuantFormat::Nvfp4);  // layer 1: staged last (its backward)
  ASSERT_EQ(homed_grads.size(), resident_grads.size());
  for (std::size_t i = 0; i < homed_grads.size(); ++i) EXPECT_TRUE(homed_grads[i].equal(resident_grads[i])) << i;
}

// `eo-ddp plan` counts the NVFP4 experts' bytes as the model holds them (4.5 bits per weight and
// 4 bytes per matrix), with or without load_in_4bit, and the offload arena as the engine lays it out.
TEST(Nvfp4, PlanAndArenaCountTheNvfp4Bytes) {
  const std::string dir = nvfp4_dir();
  TrainConfig cfg;
  cfg.base_model = dir + "/model_nvfp4";
  cfg.adapter = "lora";
  const ModelConfig mc = load_config(cfg.base_model);
  ASSERT_EQ(expert_format(cfg, mc), QuantFormat::Nvfp4);
  auto m = MoeModel::load(cfg.base_model, LoadOptions{});
  double held = 0;
  int moe_layers = 0;
  for (int l = 0; l < m->num_layers(); ++l) {
    if (!mc.is_moe_layer(l)) continue;
    ++moe_layers;
    for (int e = 0; e < mc.experts; ++e)
      for (auto mx : {ExpertMatrix::Gate, ExpertMatrix::Up, ExpertMatrix::Down}) held += double(m->weight_provider().expert_weight(l, e, mx).bytes());
  }
  const double per_matrix = double(mc.hidden * mc.expert_width) * (0.5 + 1.0 / 16) + 4;  // by hand
  EXPECT_EQ(held, double(moe_layers * mc.experts * 3) * per_matrix);
  for (const bool four_bit : {false, true}) {
    cfg.load_in_4bit = four_bit;
    cfg.adapter = four_bit ? "qlora" : "lora";
    const MemoryPlan plan = plan_memory(cfg, mc, eo::Compute::Fp32, 1, /*on_gpu=*/false);
    const MemoryPart* experts = nullptr;
    for (const auto& p : plan.device)
      if (p.name == "experts") experts = &p;
    ASSERT_NE(experts, nullptr);
    EXPECT_EQ(experts->bytes, held);
    EXPECT_NE(experts->what.find("NVFP4"), std::string::npos) << experts->what;
    EXPECT_NE(describe_plan(plan, 0).find("NVFP4"), std::string::npos);
  }
  cfg.expert_quant = "nf4";
  EXPECT_EQ(expert_format(cfg, mc), QuantFormat::Nf4);
  cfg.expert_quant = "auto";
  const MemoryPlan plan = plan_memory(cfg, mc, eo::Compute::Fp32, 1, false);
  Batch b;
  b.input_ids = load_ref(dir)["input_ids"];
  c10::NoGradGuard no_grad;
  const at::Tensor resident = m->forward(b).logits;
  auto& bank = static_cast<ResidentWeights&>(m->weight_provider()).bank();
  auto off = std::make_shared<offload::ExpertOffloader>(std::move(bank), offload::OffloadOptions{});
  m->set_weight_provider(off);
  for (int l = 0; l < mc.layers; ++l)
    if (mc.is_moe_layer(l)) EXPECT_EQ(double(off->block_bytes(l)), plan.block_bytes) << "layer " << l;
  EXPECT_EQ(off->home_bytes(), offload::estimate_home_bytes(mc, 64, false, QuantFormat::Nvfp4));
  EXPECT_TRUE(m->forward(b).logits.equal(resident));
}

// A malformed NVFP4 checkpoint is refused with the tensor and what was expected.
// ---- nvfp4_merge_aware (tests/ref/nvfp4_merge_ref.py: axolotl's merge-aware forward written from
// its definition, torchao's quantiser emulated in numpy float32)
std::string nvfp4_merge_dir() { return eo::testing::python_fixture("nvfp4_merge_ref.py", "nvfp4_merge_ref", "qwen3_moe"); }

TEST(Nvfp4MergeAware, FakeQuantizeIsTorchaosQuantiserBitForBit) {
  const Ref r = load_ref(nvfp4_merge_dir());
  for (const char* c : {"experts", "ties", "edges", "linear", "bf16"}) {
    SCOPED_TRACE(c);
    const std::string k = std::string("fq.") + c;
    const at::Tensor got = nvfp4::fake_quantize(r[k + ".x"], r[k + ".g"]);
    EXPECT_TRUE(same_bits(got, r[k + ".expected"])) << "max |diff| "
        << (got.to(at::kFloat) - r[k + ".expected"].to(at::kFloat)).abs().max().item<float>();
  }
  // Q is idempotent: the grid's values are its fixed points.
  const at::Tensor q = r["fq.experts.expected"];
  EXPECT_TRUE(same_bits(nvfp4::fake_quantize(q, r["fq.experts.g"]), q));
  EXPECT_THROW(nvfp4::fake_quantize(at::zeros({2, 8}), at::ones({1})), eo::Error);      // K not a multiple of 16
  EXPECT_THROW(nvfp4::fake_quantize(at::zeros({3, 2, 16}), at::ones({2})), eo::Error);  // 2 scales for 3 slices
}


TEST(Nvfp4MergeAware, LossAndGradientsMatchTheStraightThroughReference) {
  const std::string dir = nvfp4_merge_dir();
  const Ref r = load_ref(dir);
  auto m = MoeModel::load(dir + "/model_nvfp4", LoadOptions{});
  m->load_adapter(dir + "/adapter_params");
  // q/k/v/o of 3 layers; gate_up (gate and up) and down of the 2 MoE layers.
  EXPECT_EQ(m->enable_merge_aware(), std::make_pair(12, 6));
  // Not yet active (before nvfp4_merge_aware_start_step): plain LoRA, peft's loss.
  const auto before = m->forward(ref_batch(r));
  const double plain = (before.loss_sum / static_cast<double>(before.tokens)).item<double>();
  EXPECT_NEAR(plain, r["plain.loss"].item<double>(), 1e-5 * r["plain.loss"].item<double>());
  m->set_merge_aware_active(true);
  const auto out = m->forward(ref_batch(r));
  const at::Tensor loss = out.loss_sum / static_cast<double>(out.tokens);
  RecordProperty("loss_rel_err", std::to_string(std::abs(loss.item<double>() / r["ma.loss"].item<double>() - 1)));
  EXPECT_NEAR(loss.item<double>(), r["ma.loss"].item<double>(), 1e-5 * r["ma.loss"].item<double>());
  loss.backward();
  EXPECT_GT(expect_peft_gradients(*m, r, "ma.grad."), 0u);
}

TEST(Nvfp4MergeAware, BeforeTheStartStepIsPlainLoraAndOffloadedIsResident) {
  const std::string dir = nvfp4_merge_dir();
  const Ref r = load_ref(dir);
  auto plain = MoeModel::load(dir + "/model_nvfp4", LoadOptions{});
  plain->load_adapter(dir + "/adapter_params");
  auto m = MoeModel::load(dir + "/model_nvfp4", LoadOptions{});
  m->load_adapter(dir + "/adapter_params");
  m->enable_merge_aware();
  const std::int64_t tokens = plain->forward(ref_batch(r)).tokens;
  // Enabled but not active: the step of a model without nvfp4_merge_aware, bit for bit.
  const auto [plain_loss, plain_grads] = ref_train_step(*plain, r, tokens);
  const auto [off_loss, off_grads] = ref_train_step(*m, r, tokens);
  EXPECT_EQ(off_loss, plain_loss);
  for (std::size_t i = 0; i < plain_grads.size(); ++i) EXPECT_TRUE(off_grads[i].equal(plain_grads[i])) << i;
  // Active: another loss (the snapped forward), the reference's.
  m->set_merge_aware_active(true);
  const auto [resident_loss, resident_grads] = ref_train_step(*m, r, tokens);
  EXPECT_NEAR(resident_loss, r["ma.loss"].item<double>(), 1e-5 * r["ma.loss"].item<double>());
  EXPECT_GT(std::abs(resident_loss - plain_loss), 1e-3 * plain_loss);
  // On NVFP4 homes (the offload engine): the same bits.
  auto& bank = static_cast<ResidentWeights&>(m->weight_provider()).bank();
  auto off = std::make_shared<offload::ExpertOffloader>(std::move(bank), offload::OffloadOptions{});
  m->set_weight_provider(off);
  const auto [homed_loss, homed_grads] = ref_train_step(*m, r, tokens);
  EXPECT_EQ(homed_loss, resident_loss);
  EXPECT_GT(off->take_step_stats().copies, 0) << "the blocks came from their homes";
  ASSERT_EQ(homed_grads.size(), resident_grads.size());
  for (std::size_t i = 0; i < homed_grads.size(); ++i) EXPECT_TRUE(homed_grads[i].equal(resident_grads[i])) << i;
}

TEST(Nvfp4MergeAware, RefusedWithoutAnNvfp4Weight) {
  const std::string dir = nvfp4_merge_dir();
  auto m = MoeModel::load(dir + "/model_plain", LoadOptions{});
  LoraSpec spec;
  spec.r = 4;
  spec.targets = {"q_proj"};
  spec.target_parameters = {kGateUpParam};
  m->add_lora(spec);
  try {
    m->enable_merge_aware();
    ADD_FAILURE() << "enable_merge_aware on a float checkpoint";
  } catch (const eo::UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("no LoRA-carrying weight"), std::string::npos) << e.what();
  }
}

TEST(Nvfp4, MalformedCheckpointsAreRefusedPrecisely) {
  const std::string dir = nvfp4_dir();
  const std::string bad = (fs::temp_directory_path() / "eo_nvfp4_bad").string();
  fs::remove_all(bad);
  fs::create_directories(bad);
  for (const char* f : {"config.json", "tokenizer.json", "tokenizer_config.json"})
    if (fs::exists(dir + "/model_nvfp4/" + f)) fs::copy_file(dir + "/model_nvfp4/" + f, bad + "/" + f);
  auto file = st::File::open(dir + "/model_nvfp4/model.safetensors");
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& t : file->tensors()) {
    at::Tensor v = file->load(t.name);
    if (t.name == "model.layers.2.mlp.experts.1.down_proj.weight_scale") v = v.view(at::kByte);  // uint8, not float8
    tensors.emplace_back(t.name, v);
  }
  st::save(bad + "/model.safetensors", tensors);
  std::string msg = "(accepted)";
  try {
    MoeModel::load(bad, LoadOptions{});
  } catch (const Error& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("NVFP4 tensor 'model.layers.2.mlp.experts.1.down_proj.weight_scale' is Byte"), std::string::npos) << msg;
  EXPECT_NE(msg.find("expected Float8_e4m3fn"), std::string::npos) << msg;
  // A modelopt algorithm other than NVFP4 is refused when config.json is read.
  nlohmann::json j = nlohmann::json::parse(std::ifstream(bad + "/config.json"));
  j["quantization_config"]["quant_algo"] = "FP8";
  std::ofstream(bad + "/config.json") << j.dump();
  msg = "(accepted)";
  try {
    load_config(bad);
  } catch (const UsageError& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("quant_algo 'FP8' (modelopt) is not supported"), std::string::npos) << msg;
  // hf_quant_config.json alone (older modelopt exports) says NVFP4 as well.
  j.erase("quantization_config");
  std::ofstream(bad + "/config.json") << j.dump();
  fs::copy_file(dir + "/model_nvfp4/hf_quant_config.json", bad + "/hf_quant_config.json", fs::copy_options::overwrite_existing);
  EXPECT_TRUE(load_config(bad).nvfp4);
  fs::remove_all(bad);
}

// A provider whose bytes can be swapped, as the offload engine reuses slots.
class SwappableProvider : public WeightProvider {
 public:
  QuantizedWeight w;
  const QuantizedWeight& expert_weight(int, int, ExpertMatrix) override { return w; }

 protected:
  void stage_block(int) override {}
};

TEST(Linear4bit, BackwardUsesTheBytesCurrentAtBackwardTimeAndHoldsNoReference) {
  at::manual_seed(0);
  const at::Tensor w1 = at::randn({24, 16}), w2 = at::randn({24, 16});
  SwappableProvider prov;
  prov.w = nf4::quantize(w1);
  const QuantizedWeight q2 = nf4::quantize(w2);
  const at::Tensor x = at::randn({5, 16}).set_requires_grad(true);
  const auto storage_refs = prov.w.packed.storage().use_count();
  const auto absmax_refs = prov.w.absmax.storage().use_count();
  prov.stage(3);
  const at::Tensor y = linear4bit(x, WeightHandle{&prov, 3, 1, ExpertMatrix::Up, nullptr});
  EXPECT_EQ(prov.w.packed.storage().use_count(), storage_refs) << "the autograd node must not hold the packed bytes";
  EXPECT_EQ(prov.w.absmax.storage().use_count(), absmax_refs);
  // Forward used the first bytes (float reference: x · dequant(W1)^T).
  const at::Tensor w1_deq = eo::dequantize(prov.w, at::kFloat);
  EXPECT_LT(rel_err(y, at::matmul(x.detach(), w1_deq.t())), 1e-6);
  // The "offloader" reuses the slot: overwrite the bytes in place, then run backward.
  prov.w.packed.copy_(q2.packed);
  prov.w.absmax.copy_(q2.absmax);
  const at::Tensor dy = at::randn({5, 24});
  y.backward(dy);
  const at::Tensor want = at::matmul(dy, eo::dequantize(q2, at::kFloat));
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

// Packing (positions restart, segment mask) is exact: one packed row of two documents gives each
// document's logits alone.
void expect_packed_equals_separate(const std::string& arch) {
  c10::NoGradGuard no_grad;
  SCOPED_TRACE(arch);
  auto m = MoeModel::load(ref_dir(arch) + "/model", LoadOptions{});
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

// For plain attention, DeepSeek's latent attention with interleaved RoPE, and gpt-oss's sinks and
// 4-token sliding window.
TEST(Model, PackedSegmentsEqualSeparateSequences) {
  for (const char* arch : {"qwen3_moe", "deepseek_v3", "gpt_oss"}) expect_packed_equals_separate(arch);
}

// Llama 4's chunks of 4 positions and its NoPE layers' temperature count from each document's
// start, as its RoPE positions do.
TEST(Model, Llama4PackedSegmentsEqualSeparateSequences) { expect_packed_equals_separate("llama4"); }

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

// A row longer than --window is scored in windows sharing one token: the same sums as scoring
// those windows as rows of their own (each counted label predicted once, from its window only).
TEST(Score, LongRowsAreScoredInWindowsThatCountEveryLabelOnce) {
  const fs::path dir = fs::temp_directory_path() / ("eo_score_window_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  std::vector<std::int64_t> ids, labels;
  for (int i = 0; i < 20; ++i) {
    ids.push_back(1 + (i * 7) % 50);
    labels.push_back(i % 5 == 3 ? -100 : ids.back());
  }
  auto row = [&](std::int64_t b, std::int64_t e) {
    nlohmann::json j;
    j["input_ids"] = std::vector<std::int64_t>(ids.begin() + b, ids.begin() + e);
    j["labels"] = std::vector<std::int64_t>(labels.begin() + b, labels.begin() + e);
    return j.dump() + "\n";
  };
  std::ofstream(dir / "long.jsonl") << row(0, 20);
  std::ofstream(dir / "pieces.jsonl") << row(0, 8) << row(7, 15) << row(14, 20);
  const std::string bin = std::string(EO_BINARY_DIR) + "/eo-ddp score --json --model " + ref_dir("olmoe") + "/model";
  auto score = [&](const std::string& args) {
    std::string text;
    EXPECT_EQ(sh(bin + " " + args + " 2>/dev/null", &text), 0) << text;
    return nlohmann::json::parse(text.substr(text.find('{')));
  };
  const auto windowed = score("--window 8 --data " + (dir / "long.jsonl").string());
  const auto pieces = score("--data " + (dir / "pieces.jsonl").string());
  const auto whole = score("--data " + (dir / "long.jsonl").string());
  std::int64_t counted = 0;
  for (std::size_t i = 1; i < labels.size(); ++i) counted += labels[i] != -100;
  EXPECT_EQ(windowed.at("tokens").get<std::int64_t>(), counted);
  EXPECT_EQ(whole.at("tokens").get<std::int64_t>(), counted);
  EXPECT_EQ(pieces.at("tokens").get<std::int64_t>(), counted);
  EXPECT_NEAR(windowed.at("loss").get<double>(), pieces.at("loss").get<double>(), 1e-6);
  EXPECT_GT(std::abs(windowed.at("loss").get<double>() - whole.at("loss").get<double>()), 1e-6)
      << "windows must cut the context (else this test checks nothing)";
  EXPECT_EQ(sh(bin + " --window 1 --data " + (dir / "long.jsonl").string() + " 2>/dev/null"), 2);
  eo::remove_tree(dir);
}

}  // namespace

namespace {

// Mistral 3's wrapper as transformers 5.24 saves it (llava's language_model.model.*, the fixture) and
// under its module names (model.language_model.*, which from_pretrained reads too) give the same model;
// untied, each layout's lm_head (language_model.lm_head.weight, lm_head.weight) is read.
TEST(MultimodalWrapper, Mistral3LoadsEitherCheckpointLayout) {
  const std::string dir = ref_dir("mistral4_mm");
  const Ref r = load_ref(dir);
  const st::Checkpoint ck = st::Checkpoint::open(dir + "/model");
  ASSERT_FALSE(ck.has("language_model.lm_head.weight")) << "the fixture is tied";
  const at::Tensor embed = ck.load("language_model.model.embed_tokens.weight");
  c10::NoGradGuard no_grad;
  const at::Tensor a = MoeModel::load(dir + "/model", LoadOptions{})->forward(ref_batch(r)).logits;
  EXPECT_LT(rel_err(a, r["logits"]), 1e-4);
  const fs::path root = fs::temp_directory_path() / ("eo_mistral3_layout_" + std::to_string(::getpid()));
  for (const bool llava : {true, false})
    for (const bool tied : {true, false}) {
      SCOPED_TRACE(std::string(llava ? "llava" : "module names") + (tied ? ", tied" : ", untied"));
      const fs::path other = root / (std::to_string(llava) + std::to_string(tied));
      fs::create_directories(other);
      nlohmann::json cfg;
      std::ifstream(dir + "/model/config.json") >> cfg;
      cfg["tie_word_embeddings"] = tied;
      std::ofstream(other / "config.json") << cfg.dump();
      std::vector<std::pair<std::string, at::Tensor>> tensors;
      for (const auto& n : ck.names()) {
        const std::string from = "language_model.model.";
        const bool text = n.rfind(from, 0) == 0;
        tensors.emplace_back(llava ? n : text ? "model.language_model." + n.substr(from.size()) : "model." + n, ck.load(n));
      }
      if (!tied) tensors.emplace_back(llava ? "language_model.lm_head.weight" : "lm_head.weight", embed);
      st::save((other / "model.safetensors").string(), tensors);
      EXPECT_TRUE(a.equal(MoeModel::load(other.string(), LoadOptions{})->forward(ref_batch(r)).logits));
    }
  eo::remove_tree(root.string());
}

TEST_P(Parity, Nf4QuantisationOfCheckpointWeightsEqualsBitsandbytes) {
  const std::string dir = ref_dir(GetParam());
  const Ref r = load_ref(dir);
  const st::Checkpoint ck = st::Checkpoint::open(dir + "/model");
  int checked = 0;
  for (const auto& t : r.file->tensors()) {
    if (t.name.rfind("nf4_packed.", 0) != 0) continue;
    const std::string key = t.name.substr(11);
    SCOPED_TRACE(key);
    const QuantizedWeight q = nf4::quantize(ck.load(key));
    const at::Tensor want = r[t.name].reshape({-1});
    EXPECT_EQ(q.packed.reshape({-1}).ne(want).sum().item<std::int64_t>(), 0) << "bytes differing from bitsandbytes";
    EXPECT_TRUE(q.absmax.equal(r["nf4_absmax." + key]));
    ++checked;
  }
  EXPECT_EQ(checked, 2);
}

}  // namespace

// Issue #49 items 7 and 9: a checkpoint's non-finite quantisation scales and float tensors are
// refused at load, naming the tensor (they used to load without a word and train NaN, or skip
// every step); an NVFP4 linear without its global scale is named as such.
namespace {
// `from` copied to `to` with model.safetensors' tensors passed through `edit` (which may drop one).
void damaged_copy(const std::filesystem::path& from, const std::filesystem::path& to,
                  const std::function<void(std::vector<std::pair<std::string, at::Tensor>>&)>& edit) {
  namespace fs = std::filesystem;
  fs::remove_all(to);
  fs::create_directories(to);
  for (const auto& e : fs::directory_iterator(from))
    if (e.path().filename() != "model.safetensors") fs::copy(e.path(), to / e.path().filename());
  std::vector<std::pair<std::string, at::Tensor>> ts;
  auto f = eo::st::File::open((from / "model.safetensors").string());
  for (const auto& t : f->tensors()) ts.emplace_back(t.name, f->load(t.name).clone());
  edit(ts);
  eo::st::save((to / "model.safetensors").string(), ts);
}
std::string load_error(const std::string& dir, bool four_bit = false) {
  LoadOptions lo;
  lo.load_in_4bit = four_bit;
  try {
    MoeModel::load(dir, lo);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(loaded)";
}
at::Tensor& named(std::vector<std::pair<std::string, at::Tensor>>& ts, const std::string& suffix) {
  for (auto& [n, t] : ts)
    if (n.size() >= suffix.size() && n.compare(n.size() - suffix.size(), suffix.size(), suffix) == 0) return t;
  throw std::runtime_error("no tensor ending in " + suffix);
}
}  // namespace

TEST(LoadChecks, NonFiniteScalesAndTensorsAreRefusedNamingTheTensor) {
  namespace fs = std::filesystem;
  const fs::path nv = fs::path(nvfp4_dir()) / "model_nvfp4";
  const fs::path tmp = fs::temp_directory_path() / ("eo_load_checks_" + std::to_string(::getpid()));
  const std::string g2 = "model.layers.1.mlp.experts.0.gate_proj.weight_scale_2";
  for (const float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(), 3e38f}) {
    damaged_copy(nv, tmp, [&](auto& ts) { named(ts, g2).fill_(bad); });
    const std::string m = load_error(tmp.string());
    EXPECT_NE(m.find("'" + g2 + "' is the NVFP4 global scale"), std::string::npos) << bad << ": " << m;
  }
  const std::string s1 = "model.layers.1.mlp.experts.0.gate_proj.weight_scale";
  damaged_copy(nv, tmp, [&](auto& ts) { named(ts, s1).view(at::kByte).view({-1})[3] = 0x7f; });
  std::string m = load_error(tmp.string());
  EXPECT_NE(m.find("'" + s1 + "' holds NaN E4M3 block scales (1 of"), std::string::npos) << m;
  // A float tensor with a NaN: named, also where load_in_4bit would quantise it to NF4.
  damaged_copy(nv, tmp, [&](auto& ts) { named(ts, "model.embed_tokens.weight")[0][1] = NAN; });
  EXPECT_NE(load_error(tmp.string()).find("'model.embed_tokens.weight' holds NaN or infinity"), std::string::npos);
  // The NF4 path (a float linear quantised at load) names the tensor too.
  const fs::path mx = fs::path(mxfp4_dir());
  const std::string q = "model.layers.0.self_attn.q_proj.weight";
  damaged_copy(mx / "model_plain", tmp, [&](auto& ts) { named(ts, q)[0][0] = NAN; });
  m = load_error(tmp.string(), /*four_bit=*/true);
  EXPECT_NE(m.find("'" + q + "' holds NaN or infinity (1 of"), std::string::npos) << m;
  // An NVFP4 linear without weight_scale_2 (the per-expert check names the first expert instead).
  const std::string lone = "model.layers.0.self_attn.q_proj";
  damaged_copy(nv, tmp, [&](auto& ts) {
    ts.erase(std::remove_if(ts.begin(), ts.end(), [&](const auto& p) { return p.first == lone + ".weight_scale_2"; }), ts.end());
  });
  m = load_error(tmp.string());
  EXPECT_NE(m.find("NVFP4 module '" + lone + "' has"), std::string::npos) << m;
  EXPECT_NE(m.find("but no '" + lone + ".weight_scale_2'"), std::string::npos) << m;
  // MXFP4 (gpt-oss): an E8M0 scale of 255 is NaN.
  damaged_copy(mx / "model_mxfp4", tmp, [&](auto& ts) { named(ts, "layers.0.mlp.experts.down_proj_scales").view({-1})[5] = 255; });
  m = load_error(tmp.string());
  EXPECT_NE(m.find("experts.down_proj_scales' holds E8M0 block scales of 255"), std::string::npos) << m;
  // Item 10: blocks under another quant_method (mxfp8), and a float copy beside the blocks, are
  // refused instead of read as MXFP4 / ignored.
  damaged_copy(mx / "model_mxfp4", tmp, [](auto&) {});
  {
    std::ifstream in(tmp / "config.json");
    nlohmann::json c = nlohmann::json::parse(in);
    c["quantization_config"]["quant_method"] = "mxfp8";
    std::ofstream(tmp / "config.json", std::ios::trunc) << c.dump();
  }
  m = load_error(tmp.string());
  EXPECT_NE(m.find("does not say quant_method: mxfp4"), std::string::npos) << m;
  damaged_copy(mx / "model_mxfp4", tmp, [](auto& ts) {
    ts.emplace_back("model.layers.0.mlp.experts.gate_up_proj", at::zeros({1}));
  });
  m = load_error(tmp.string());
  EXPECT_NE(m.find("'model.layers.0.mlp.experts.gate_up_proj' is stored both in float and as MXFP4"), std::string::npos) << m;
  fs::remove_all(tmp);
}
