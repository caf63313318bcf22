// The older axolotl forms the config loader takes, each noted with what it became: a dataset
// without a type, fractional save_steps, and model_config overrides of config.json (applied to the
// model's config, refused where they change the weights' shapes). The dataset forms' tokens are
// checked end to end by tests/older_forms.sh.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "common/error.h"
#include "models/hf_config.h"
#include "runtime/config.h"
#include "runtime/model_overrides.h"
#include "tests/test_paths.h"

using namespace eo;
namespace fs = std::filesystem;

namespace {

const char* kModel = "base_model: /models/tiny\nadapter: lora\n";

ConfigLoadOptions no_files() {
  ConfigLoadOptions o;
  o.check_files = false;
  return o;
}

std::string all_warnings(const TrainConfig& c) {
  std::string s;
  for (const auto& w : c.warnings) s += w + "\n";
  return s;
}

std::string error_of(const std::string& text, const ConfigLoadOptions& o = no_files()) {
  try {
    load_config_text(text, "t.yaml", {}, o);
  } catch (const UsageError& e) {
    return e.what();
  }
  return "accepted";
}

}  // namespace

// axolotl reads a dataset without a type (or `type:` with no value) as already tokenized rows.
TEST(ConfigOlderForms, DatasetWithoutTypeIsPreTokenized) {
  for (const char* entry : {"{path: t.jsonl, ds_type: json}", "{path: t.jsonl, type: }", "{path: t.jsonl, type: null}"}) {
    const TrainConfig c = load_config_text(std::string(kModel) + "datasets: [" + entry + "]\n", "t.yaml", {}, no_files());
    ASSERT_EQ(c.datasets.size(), 1u);
    EXPECT_EQ(c.datasets[0].type, "tokenized") << entry;
    EXPECT_NE(all_warnings(c).find("datasets.0: no type: read as pre-tokenized rows (input_ids, labels), as axolotl"),
              std::string::npos)
        << all_warnings(c);
  }
  // A current form has nothing to note.
  const TrainConfig c = load_config_text(std::string(kModel) + "datasets: [{path: t.jsonl, type: tokenized}]\n", "t.yaml",
                                         {}, no_files());
  EXPECT_TRUE(c.warnings.empty()) << all_warnings(c);
}

// save_steps as axolotl and transformers take it: whole steps, or a fraction (< 1) of the run.
TEST(ConfigOlderForms, FractionalSaveSteps) {
  const std::string base = std::string(kModel) + "datasets: [{path: t.jsonl, type: tokenized}]\n";
  EXPECT_DOUBLE_EQ(load_config_text(base + "save_steps: 0.25\n", "t.yaml", {}, no_files()).save_steps.value(), 0.25);
  EXPECT_DOUBLE_EQ(load_config_text(base + "save_steps: 40\n", "t.yaml", {}, no_files()).save_steps.value(), 40);
  EXPECT_DOUBLE_EQ(load_config_text(base + "save_steps: 0\n", "t.yaml", {}, no_files()).save_steps.value(), 0);
  for (const char* bad : {"1.5", "-1", "often"})
    EXPECT_NE(error_of(base + "save_steps: " + bad + "\n").find("save_steps: expected a whole number of steps or a "
                                                                  "fraction in (0, 1) (0: never)"),
              std::string::npos)
        << bad;
  EXPECT_NE(error_of(base + "eval_steps: 0\n").find("eval_steps: expected a whole number of steps or a fraction in (0, 1), "
                                                     "got '0'"),
            std::string::npos);
  EXPECT_NE(error_of(base + "save_steps: 0.5\nsaves_per_epoch: 2\n").find("set either save_steps or saves_per_epoch"),
            std::string::npos);
}

// model_config / overrides_of_model_config: values that replace config.json's, applied to the
// config the run plans and builds from; shapes may not change.
TEST(ConfigOlderForms, ModelConfigOverridesReplaceConfigJsonValues) {
  const fs::path dir = fs::temp_directory_path() / ("eo_cfg_overrides_" + std::to_string(::getpid()));
  fs::create_directories(dir / "new");
  fs::create_directories(dir / "old");
  // transformers 5's layout (rope_parameters) and the Hub's older one (top-level rope_theta).
  fs::copy_file(std::string(EO_SOURCE_DIR) + "/fixtures/tiny-qwen3-moe/config.json", dir / "new" / "config.json",
                fs::copy_options::overwrite_existing);
  fs::copy_file(std::string(EO_SOURCE_DIR) + "/configs/models/qwen3-30b-a3b/config.json", dir / "old" / "config.json",
                fs::copy_options::overwrite_existing);
  fs::create_directories(dir / "gpt-oss");  // YaRN in rope_scaling
  fs::copy_file(std::string(EO_SOURCE_DIR) + "/configs/models/gpt-oss-20b/config.json", dir / "gpt-oss" / "config.json",
                fs::copy_options::overwrite_existing);
  ConfigLoadOptions arch = no_files();
  arch.check_architecture = true;
  auto load = [&](const std::string& model, const std::string& extra, model::ModelConfig* mc) {
    ConfigLoadOptions o = arch;
    o.model_out = mc;
    return load_config_text("base_model: " + (dir / model).string() +
                                "\nadapter: lora\ndatasets: [{path: t.jsonl, type: tokenized}]\n" + extra,
                            "t.yaml", {}, o);
  };
  for (const char* model : {"new", "old"}) {
    model::ModelConfig plain, mc;
    load(model, "", &plain);
    const TrainConfig c = load(model, "model_config:\n  rope_theta: 20000\n  max_position_embeddings: 4096\n"
                               "  output_router_logits: true\n", &mc);
    EXPECT_DOUBLE_EQ(mc.rope_theta, 20000) << model;
    EXPECT_NE(plain.rope_theta, 20000) << model;
    EXPECT_TRUE(c.output_router_logits);  // eo-ddp's own key, read as itself
    EXPECT_NE(all_warnings(c).find("overrides_of_model_config: " + (dir / model).string() + "/config.json's "),
              std::string::npos)
        << all_warnings(c);
    EXPECT_NE(all_warnings(c).find(" -> 20000, max_position_embeddings: "), std::string::npos) << all_warnings(c);
    // The training path reads the same config.
    EXPECT_DOUBLE_EQ(load_model_config(c).rope_theta, 20000);
    // rope_scaling goes where the file keeps RoPE: into rope_parameters when it has one (here
    // refused by name, as config.json's own yarn would be on qwen3_moe), else at the top level.
    const std::string yarn = error_of("base_model: " + (dir / model).string() +
                                          "\nadapter: lora\ndatasets: [{path: t.jsonl, type: tokenized}]\n"
                                          "overrides_of_model_config: {rope_scaling: {rope_type: yarn, factor: 4.0}}\n",
                                      arch);
    EXPECT_NE(yarn.find(std::string(model) == "new" ? "rope_parameters.rope_type 'yarn' is not supported for qwen3_moe"
                                                    : "rope_scaling.rope_type 'yarn' is not supported for qwen3_moe"),
              std::string::npos)
        << yarn;
  }
  {
    model::ModelConfig plain, mc;
    load("gpt-oss", "", &plain);
    load("gpt-oss", "model_config:\n  rope_scaling: {rope_type: yarn, factor: 16.0, original_max_position_embeddings: 4096, "
                    "beta_fast: 32.0, beta_slow: 1.0, truncate: false}\n", &mc);
    EXPECT_DOUBLE_EQ(plain.rope.factor, 32.0);
    EXPECT_DOUBLE_EQ(mc.rope.factor, 16.0);
    EXPECT_TRUE(mc.rope.yarn);
    EXPECT_DOUBLE_EQ(mc.rope_theta, plain.rope_theta);
  }
  // Shapes: each a config error naming the key and what changes, before any weight is read.
  const std::string heads = error_of("base_model: " + (dir / "new").string() +
                                         "\nadapter: lora\ndatasets: [{path: t.jsonl, type: tokenized}]\n"
                                         "model_config: {num_attention_heads: 8, hidden_size: 128}\n",
                                     arch);
  EXPECT_NE(heads.find("overrides_of_model_config: overrides_of_model_config (num_attention_heads: 4 -> 8, "
                       "hidden_size: 64 -> 128) changes hidden_size"),
            std::string::npos)
      << heads;
  EXPECT_NE(error_of(std::string(kModel) + "datasets: [{path: t.jsonl, type: tokenized}]\nmodel_config: [rope_theta]\n")
                .find("overrides_of_model_config: expected a map of config.json keys to their values"),
            std::string::npos);
  fs::remove_all(dir);
}

// ds_type: parquet on a file not named .parquet would be read as JSON by the data tool: refused.
TEST(ConfigOlderForms, DsTypeParquetNeedsAParquetName) {
  const std::string e = error_of(std::string(kModel) + "datasets: [{path: rows.bin, ds_type: parquet, type: alpaca}]\n");
  EXPECT_NE(e.find("datasets.0.ds_type: parquet, but 'rows.bin' is not named .parquet"), std::string::npos) << e;
  EXPECT_EQ(error_of(std::string(kModel) + "datasets: [{path: rows.parquet, ds_type: parquet, type: alpaca}]\n"), "accepted");
  EXPECT_EQ(error_of(std::string(kModel) + "datasets: [{path: org/rows, ds_type: parquet, type: alpaca}]\n"), "accepted");
}
