// The kv cache (models/kv_cache.h): a prompt prefilled, then one token per forward, gives at every
// position the logits of the whole sequence run at once (MoeModel::forward, which tests/test_model.cpp
// holds to transformers), for every attention form: GQA, partial RoPE, latent attention (with
// Mistral 4's query scale), sinks and sliding windows, Gemma 4's two geometries, Llama 4's chunked and
// NoPE layers, Hunyuan's q/k norms after RoPE, and the delta-rule layers' carried conv and recurrent
// state; with model_ref's peft adapter on. The fixtures' sequences are longer than their windows and
// chunks.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>

#include <string>

#include "models/kv_cache.h"
#include "models/moe_model.h"
#include "models/safetensors.h"
#include "tests/ref_support.h"

using namespace eo::model;

namespace {

class KvCacheParity : public ::testing::TestWithParam<std::string> {};

TEST_P(KvCacheParity, CachedDecodingGivesTheWholeSequencesLogits) {
  const std::string dir = eo::testing::python_fixture("model_ref.py", "model_ref", GetParam());
  auto model = MoeModel::load(dir + "/model", LoadOptions{});
  model->load_adapter(dir + "/adapter");
  const at::Tensor ids = eo::st::File::open(dir + "/ref.safetensors")->load("input_ids");
  c10::NoGradGuard no_grad;
  const std::int64_t T = ids.size(1), prefill = 5;
  ASSERT_GT(T, prefill + 4);
  // fp32 rounding: the attention forms sum in the same order either way; the delta rule's chunked
  // recurrence over a whole sequence sums in another order than one token at a time (~2e-5 seen).
  // A cache that drops or misplaces state is off by far more (1e-2 and up).
  const double tol = model->config().linear_attn ? 1e-4 : 1e-5;
  for (std::int64_t row = 0; row < ids.size(0); ++row) {
    const at::Tensor seq = ids.narrow(0, row, 1);
    Batch whole;
    whole.input_ids = seq;
    const at::Tensor want = model->forward(whole).logits[0].to(at::kFloat);  // [T, V]
    KvCache cache(model->num_layers());
    for (std::int64_t t = prefill; t <= T; ++t) {
      const std::int64_t from = cache.length();
      const at::Tensor got = forward_cached(*model, seq.narrow(1, from, t - from), cache);
      EXPECT_EQ(cache.length(), t);
      const double err = eo::testing::rel_err(got, want[t - 1]);
      EXPECT_LT(err, tol) << GetParam() << " row " << row << ": position " << t - 1 << (from == 0 ? " (prefill)" : "");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Arch, KvCacheParity,
                         ::testing::Values("qwen3_moe", "glm4_moe", "deepseek_v3", "glm4_moe_lite", "mistral4_mm", "gpt_oss",
                                           "gemma4", "gemma4_kv", "llama4", "qwen3_next", "qwen3_5_moe_mm", "olmoe",
                                           "ernie4_5_moe", "hunyuan_v1_moe"),
                         [](const auto& info) { return info.param; });

}  // namespace
