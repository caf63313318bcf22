// Loading checkpoints that bitsandbytes already quantised (transformers' save_pretrained of a
// 4-bit model) against independent references: logits from transformers on bitsandbytes'
// dequantisation of the stored weights, and the file's own bytes. Fixtures come from
// tests/ref/bnb_checkpoint_ref.py (CTest fixture in tests/bnb_checkpoint.cmake, or on first use
// under a lock).
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <filesystem>

#include "common/error.h"
#include "tests/ref_support.h"
#include "models/moe_model.h"
#include "models/nf4_bnb.h"
#include "models/safetensors.h"

namespace fs = std::filesystem;
using namespace eo;
using namespace eo::model;

namespace {

using eo::testing::rel_err;
using eo::testing::sh;

std::string ref_dir(const std::string& arch) { return eo::testing::python_fixture("bnb_checkpoint_ref.py", "bnb_checkpoint_ref", arch); }

at::Tensor ref(const std::string& dir, const std::string& name) {
  const auto f = st::File::open(dir + "/ref.safetensors");
  EXPECT_NE(f->find(name), nullptr) << name;
  return f->load(name);
}

at::Tensor logits(const std::string& model_dir, const LoadOptions& lo, const at::Tensor& ids) {
  c10::NoGradGuard no_grad;
  Batch b;
  b.input_ids = ids;
  return MoeModel::load(model_dir, lo)->forward(b).logits;
}

LoadOptions four_bit(int blocksize = 64, bool double_quant = false) {
  LoadOptions lo;
  lo.load_in_4bit = true;
  lo.blocksize = blocksize;
  lo.double_quant = double_quant;
  return lo;
}

// Every expert matrix eo-ddp holds equals the checkpoint's bytes: packed nibbles, absmax (or the
// nested codes, scales and map) and the quant state's numbers. Returns how many were compared.
int expect_experts_hold_file_bytes(MoeModel& m, const std::string& model_dir) {
  const st::Checkpoint ck = st::Checkpoint::open(model_dir);
  const bool mix = m.config().arch == Arch::Mixtral;
  static const char* kQwen[3] = {"gate_proj", "up_proj", "down_proj"};
  static const char* kMix[3] = {"w1", "w3", "w2"};
  int compared = 0;
  for (int i = 0; i < m.num_layers(); ++i) {
    if (!m.config().is_moe_layer(i)) continue;
    m.weight_provider().stage(i);
    for (int e = 0; e < m.config().experts; ++e)
      for (int mi = 0; mi < 3; ++mi) {
        const std::string prefix = "model.layers." + std::to_string(i) + "." + m.config().moe_prefix() + ".experts." +
                                   std::to_string(e) + "." + (mix ? kMix : kQwen)[mi];
        SCOPED_TRACE(prefix);
        const QuantizedWeight& q = m.weight_provider().expert_weight(i, e, static_cast<ExpertMatrix>(mi));
        const QuantizedWeight file = nf4::from_bitsandbytes([&](const std::string& n) { return ck.load(n); },
                                                                 [&](const std::string& n) { return ck.has(n); }, prefix);
        EXPECT_EQ(q.blocksize, file.blocksize);
        EXPECT_EQ(q.shape, file.shape);
        EXPECT_EQ(q.nested.has_value(), file.nested.has_value());
        for (const auto& [name, t] : nf4::to_bitsandbytes(q, prefix)) {
          if (name.find(".quant_state.") != std::string::npos) continue;  // JSON spacing differs from Python's
          EXPECT_TRUE(t.reshape({-1}).equal(ck.load(name).reshape({-1}))) << name << " differs from the file";
        }
        if (q.nested) EXPECT_EQ(q.nested->offset, file.nested->offset);
        ++compared;
      }
  }
  return compared;
}

class BnbCheckpoint : public ::testing::TestWithParam<std::string> {};

TEST_P(BnbCheckpoint, StoredNf4IsUsedAsItIsWithLoadIn4bit) {
  const std::string dir = ref_dir(GetParam());
  const at::Tensor ids = ref(dir, "input_ids");
  for (const char* variant : {"nf4", "nf4_dq"}) {
    SCOPED_TRACE(variant);
    const at::Tensor want = ref(dir, std::string("logits_") + variant);
    EXPECT_LT(rel_err(logits(dir + "/" + variant, four_bit(), ids), want), 1e-4);
    // Other LoadOptions quantisation settings: the stored blocksize / double quantisation win.
    const bool stored_dq = std::string(variant) == "nf4_dq";
    EXPECT_LT(rel_err(logits(dir + "/" + variant, four_bit(128, !stored_dq), ids), want), 1e-4);
    auto m = MoeModel::load(dir + "/" + variant, four_bit(128, !stored_dq));
    EXPECT_GT(expect_experts_hold_file_bytes(*m, dir + "/" + variant), 0);
  }
  // The nf4/ fixture's absmax was perturbed after quantisation: quantising the float weights
  // afresh gives visibly other logits, so the match above needs the stored absmax.
  EXPECT_GT(rel_err(logits(dir + "/plain", four_bit(), ids), ref(dir, "logits_nf4")), 1e-3);
}

TEST_P(BnbCheckpoint, StoredNf4IsDequantisedWithoutLoadIn4bit) {
  const std::string dir = ref_dir(GetParam());
  const at::Tensor ids = ref(dir, "input_ids");
  for (const char* variant : {"nf4", "nf4_dq"}) {
    SCOPED_TRACE(variant);
    EXPECT_LT(rel_err(logits(dir + "/" + variant, LoadOptions{}, ids), ref(dir, std::string("logits_") + variant)), 1e-4);
  }
  EXPECT_GT(rel_err(logits(dir + "/nf4", LoadOptions{}, ids), ref(dir, "logits_plain")), 1e-3);
}

TEST_P(BnbCheckpoint, MixedCheckpointsLoadBothWays) {
  const std::string dir = ref_dir(GetParam());
  const at::Tensor ids = ref(dir, "input_ids");
  EXPECT_LT(rel_err(logits(dir + "/mixed", four_bit(), ids), ref(dir, "logits_mixed_4bit")), 1e-4);
  EXPECT_LT(rel_err(logits(dir + "/mixed", LoadOptions{}, ids), ref(dir, "logits_mixed_dense")), 1e-4);
  EXPECT_GT(rel_err(ref(dir, "logits_mixed_4bit"), ref(dir, "logits_mixed_dense")), 1e-3);
}

TEST_P(BnbCheckpoint, Fp4IsAUsageErrorNamingTheModule) {
  const std::string dir = ref_dir(GetParam());
  for (bool four : {true, false}) {
    try {
      MoeModel::load(dir + "/fp4", four ? four_bit() : LoadOptions{});
      ADD_FAILURE() << "fp4 checkpoint loaded";
    } catch (const UsageError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("fp4"), std::string::npos) << msg;
      EXPECT_NE(msg.find("model.layers.0.self_attn.q_proj"), std::string::npos) << msg;
    }
  }
}

TEST_P(BnbCheckpoint, QuantisedFusedExpertsAreAUsageError) {
  const std::string dir = ref_dir(GetParam());
  for (bool four : {true, false}) {
    try {
      MoeModel::load(dir + "/fused_bnb", four ? four_bit() : LoadOptions{});
      ADD_FAILURE() << "quantised fused experts loaded";
    } catch (const UsageError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("experts.gate_up_proj"), std::string::npos) << msg;
      EXPECT_NE(msg.find("per expert"), std::string::npos) << msg;
    }
  }
}

// The float fused-expert layout still loads (the loader's expert path serves both layouts).
TEST_P(BnbCheckpoint, FloatFusedExpertsStillLoad) {
  const std::string dir = ref_dir(GetParam());
  const at::Tensor ids = ref(dir, "input_ids");
  EXPECT_LT(rel_err(logits(dir + "/plain_fused", LoadOptions{}, ids), ref(dir, "logits_plain")), 1e-4);
  EXPECT_LT(rel_err(logits(dir + "/plain_fused", four_bit(), ids), logits(dir + "/plain", four_bit(), ids)), 1e-6);
}

INSTANTIATE_TEST_SUITE_P(Arch, BnbCheckpoint, ::testing::Values("qwen3_moe", "mixtral", "qwen2_moe"));

}  // namespace
