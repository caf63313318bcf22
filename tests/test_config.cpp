// Config schema and validation: every rule, and the text users see.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <functional>
#include <filesystem>
#include <fstream>
#include <random>
#include <regex>
#include <iterator>
#include <set>
#include <sstream>

#include "common/files.h"
#include "common/error.h"
#include "common/text.h"
#include "models/hf_config.h"
#include "models/safetensors.h"
#include "runtime/config.h"
#include "runtime/config_help.h"
#include "runtime/dataset_keys.h"
#include "runtime/key_aliases.h"
#include "runtime/setup.h"
#include "runtime/rank_agreement.h"
#include "tests/test_paths.h"

using namespace eo;

namespace {

const char* kValid = R"(
base_model: /models/tiny
load_in_4bit: true
adapter: qlora
lora_r: 16
lora_alpha: 32
datasets:
  - path: train.jsonl
    type: tokenized
)";

ConfigLoadOptions no_files() {
  ConfigLoadOptions o;
  o.check_files = false;
  return o;
}

TrainConfig load(const std::string& text, const std::vector<std::string>& sets = {}) {
  return load_config_text(text, "test.yaml", sets, no_files());
}

// The error message of a config that must fail.
std::string error_of(const std::string& text, const std::vector<std::string>& sets = {}) {
  try {
    load(text, sets);
  } catch (const UsageError& e) {
    return e.what();
  }
  ADD_FAILURE() << "config was accepted:\n" << text;
  return "";
}

const char* kOffload = R"(
expert_offload: true
gradient_checkpointing: true
gradient_checkpointing_kwargs:
  use_reentrant: false
)";

}  // namespace

TEST(Config, MinimalValidConfigUsesDefaults) {
  const TrainConfig c = load(kValid);
  EXPECT_EQ(c.base_model, "/models/tiny");
  EXPECT_EQ(c.adapter, "qlora");
  EXPECT_EQ(c.lora_r, 16);
  EXPECT_DOUBLE_EQ(c.lora_alpha, 32);
  EXPECT_EQ(c.sequence_len, 2048);
  EXPECT_EQ(c.micro_batch_size, 1);
  EXPECT_EQ(c.lr_scheduler, "cosine");
  EXPECT_FALSE(c.expert_offload);  // a config without expert_offload is plain QLoRA
  ASSERT_EQ(c.datasets.size(), 1u);
  EXPECT_EQ(c.datasets[0].path, "train.jsonl");
}

TEST(Config, OffloadConfigValid) {
  const TrainConfig c = load(std::string(kValid) + kOffload);
  EXPECT_TRUE(c.expert_offload);
  EXPECT_TRUE(c.expert_offload_prefetch);
  ASSERT_TRUE(c.use_reentrant.has_value());
  EXPECT_FALSE(*c.use_reentrant);
}

TEST(Config, PrefetchDepthIsCheckedAndOnlyUsedWithPrefetch) {
  const std::string offload = std::string(kValid) + kOffload;
  EXPECT_EQ(load(offload).expert_offload_prefetch_depth, 1);
  const TrainConfig deep = load(offload + "expert_offload_prefetch_depth: 3\n");
  EXPECT_EQ(deep.expert_offload_prefetch_depth, 3);
  EXPECT_TRUE(deep.warnings.empty());
  for (const char* bad : {"0", "9"}) {
    const std::string e = error_of(offload + "expert_offload_prefetch_depth: " + bad + "\n");
    EXPECT_NE(e.find("expert_offload_prefetch_depth: must be between 1 and 8, got " + std::string(bad)), std::string::npos) << e;
  }
  // Without prefetch (or without offload) there is nothing to stage ahead: a warning, not an error.
  for (const std::string& off : {offload + "expert_offload_prefetch: false\n", std::string(kValid)}) {
    const TrainConfig c = load(off + "expert_offload_prefetch_depth: 2\n");
    ASSERT_EQ(c.warnings.size(), 1u);
    EXPECT_NE(c.warnings[0].find("expert_offload_prefetch_depth is ignored"), std::string::npos) << c.warnings[0];
  }
}

TEST(Config, UnknownKeySuggestsClosest) {
  const std::string e = error_of(std::string(kValid) + "expert_offlaod_pin_memory: true\n");
  EXPECT_NE(e.find("expert_offlaod_pin_memory: unknown key; did you mean 'expert_offload_pin_memory'?"), std::string::npos) << e;
  const std::string e2 = error_of(std::string(kValid) + "lerning_rate: 1e-4\n");
  EXPECT_NE(e2.find("did you mean 'learning_rate'"), std::string::npos) << e2;
  const std::string e3 = error_of(std::string(kValid) + "completely_unrelated_thing: 1\n");
  EXPECT_NE(e3.find("completely_unrelated_thing: unknown key; `eo-ddp --help-config`"), std::string::npos) << e3;
}

// The names transformers' Trainer, TRL / Unsloth and peft use are named with eo-ddp's spelling,
// before any edit-distance guess (which offered 'rl' for lr and 'local_rank' for lora_rank).
TEST(Config, ForeignKeyNamesAreSpelledAsHere) {
  for (const auto& [foreign, key] : std::vector<std::pair<std::string, std::string>>{
           {"lr", "learning_rate"}, {"lora_rank", "lora_r"}, {"max_seq_length", "sequence_len"}, {"epochs", "num_epochs"},
           {"num_train_epochs", "num_epochs"}, {"per_device_train_batch_size", "micro_batch_size"},
           {"gradient_accumulation", "gradient_accumulation_steps"}, {"target_modules", "lora_target_modules"}, {"r", "lora_r"}}) {
    const std::string e = error_of(kValid, {foreign + "=1"});
    EXPECT_NE(e.find(foreign + ": unknown key; '" + foreign + "' is spelled '" + key + "' here ("), std::string::npos) << e;
    EXPECT_EQ(e.find("did you mean"), std::string::npos) << e;
  }
  // The table's own rules: every target is a key of the schema, and no foreign name is one of
  // eo-ddp's or axolotl's keys (it would never be reached).
  const std::vector<std::string> known = config_known_keys();
  std::set<std::string> axolotl;
  for (const auto& a : axolotl_keys()) axolotl.insert(a.key);
  for (const auto& a : key_aliases()) {
    EXPECT_NE(std::find(known.begin(), known.end(), a.key), known.end()) << a.foreign << " -> " << a.key;
    EXPECT_EQ(std::find(known.begin(), known.end(), a.foreign), known.end()) << a.foreign;
    EXPECT_EQ(axolotl.count(a.foreign), 0u) << a.foreign;
  }
  // Keys that are the same everywhere are no alias.
  EXPECT_NO_THROW(load(kValid, {"weight_decay=0.01", "warmup_ratio=0.1", "max_grad_norm=0.5", "lora_alpha=8"}));
}

// --help-config: grouped by section (each section starts at a key of the schema), every key once,
// no line over 120 columns.
TEST(Config, HelpConfigIsGroupedAndFitsATerminal) {
  const std::vector<std::string> known = config_known_keys();
  for (const auto& s : config_sections())
    EXPECT_NE(std::find(known.begin(), known.end(), s.first_key), known.end()) << s.first_key;
  const std::string text = config_reference_text();
  std::istringstream lines(text);
  std::string line;
  std::set<std::string> listed;
  while (std::getline(lines, line)) {
    EXPECT_LE(line.size(), std::size_t(kHelpWidth)) << line;
    if (line.rfind("  ", 0) == 0 && line[2] != ' ') listed.insert(line.substr(2, line.find(' ', 2) - 2));
  }
  for (const auto& k : known) EXPECT_EQ(listed.count(k), 1u) << k;
  for (const auto& s : config_sections()) EXPECT_NE(text.find(std::string("\n") + s.title + "\n"), std::string::npos) << s.title;
  const KeyHelp one = config_key_help("lora_r");
  EXPECT_TRUE(one.found);
  EXPECT_EQ(one.text.rfind("  lora_r  (int; default 8)", 0), 0u) << one.text;
  const KeyHelp alias = config_key_help("lr");
  EXPECT_TRUE(alias.found);
  EXPECT_NE(alias.text.find("'lr' is spelled 'learning_rate' here"), std::string::npos) << alias.text;
  EXPECT_NE(alias.text.find("  learning_rate  ("), std::string::npos) << alias.text;
  const KeyHelp typo = config_key_help("lerning_rate");
  EXPECT_FALSE(typo.found);
  EXPECT_NE(typo.text.find("did you mean 'learning_rate'?"), std::string::npos) << typo.text;
  EXPECT_EQ(wrap("aaa bbb ccc", "  ", 9), "  aaa bbb\n  ccc\n");
}

// A datasets entry's keys are one table: axolotl's implemented dataset keys are exactly its rows (plus
// eo-ddp's own keys of the binary token files), each has help, and every string key set in a config
// comes back in the resolved config and reads back the same.
TEST(Config, DatasetKeysAreOneTable) {
  std::set<std::string> table, implemented;
  for (const auto& d : dataset_key_docs()) {
    table.insert(d.key);
    EXPECT_TRUE(config_key_help(d.key).found) << d.key;
    EXPECT_FALSE(d.doc.empty()) << d.key;
  }
  for (const auto& a : axolotl_keys())
    if (a.key.rfind("datasets[].", 0) == 0 && a.cls == "implemented") implemented.insert(a.key);
  implemented.insert({"datasets[].dtype", "datasets[].eos_token_id"});
  EXPECT_EQ(table, implemented);
  const std::string text = std::string(kValid) + R"(test_datasets:
  - path: chat.jsonl
    type: chat_template
    field_messages: conversations
    message_field_role: from
    message_field_content: value
    message_field_training: train
    train_on_eos: all
    train_on_eot: last
    chat_template: chatml
    field_thinking: thoughts
    template_thinking_key: reasoning
    split: train[:50%]
  - path: text.jsonl
    type: completion
    field: body
)";
  const TrainConfig c = load(text);
  ASSERT_EQ(c.test_datasets.size(), 2u);
  const DatasetSpec& chat = c.test_datasets[0];
  EXPECT_EQ(chat.field_messages, "conversations");
  EXPECT_EQ(chat.message_field_role, "from");
  EXPECT_EQ(chat.message_field_content, "value");
  EXPECT_EQ(chat.message_field_training, "train");
  EXPECT_EQ(chat.train_on_eos, "all");
  EXPECT_EQ(chat.train_on_eot, "last");
  EXPECT_EQ(chat.chat_template, "chatml");
  EXPECT_EQ(chat.field_thinking, "thoughts");
  EXPECT_EQ(chat.template_thinking_key, "reasoning");
  EXPECT_EQ(chat.split, "train[:50%]");
  EXPECT_EQ(c.test_datasets[1].field, "body");
  const std::string yaml = config_to_yaml(c);
  for (const char* v : {"field_messages: conversations", "message_field_training: train", "train_on_eot: last",
                        "template_thinking_key: reasoning", "field: body", "split: train[:50%]"})
    EXPECT_NE(yaml.find(v), std::string::npos) << v << "\n" << yaml;
  EXPECT_EQ(config_to_yaml(load(yaml)), yaml);
  const std::string e = error_of(std::string(kValid) + "test_datasets:\n  - path: t.jsonl\n    type: completion\n    field_messages: m\n");
  EXPECT_NE(e.find("test_datasets.0.field_messages: does not apply to type: completion"), std::string::npos) << e;
}

TEST(Config, NestedUnknownKeyIsNamedWithItsPath) {
  const std::string e = error_of(std::string(kValid) + "gradient_checkpointing_kwargs:\n  use_reentrnt: false\n");
  EXPECT_NE(e.find("gradient_checkpointing_kwargs.use_reentrnt: unknown key; did you mean "
                   "'gradient_checkpointing_kwargs.use_reentrant'?"),
            std::string::npos)
      << e;
}

TEST(Config, WrongTypesAndRanges) {
  struct Case {
    std::string line, expect;
  };
  const std::vector<Case> cases = {
      {"learning_rate: -0.001", "learning_rate: must be greater than 0"},
      {"learning_rate: fast", "learning_rate: expected a number, got 'fast'"},
      {"lora_r: 0", "lora_r: must be between 1 and 4096, got 0"},
      {"lora_r: 8.5", "lora_r: expected an integer, got '8.5'"},
      {"sequence_len: 0", "sequence_len: must be between 2 and"},
      {"micro_batch_size: -1", "micro_batch_size: must be between 1"},
      {"lora_dropout: 1.5", "lora_dropout: must be at least 0 and at most 0.99"},
      {"load_in_4bit: maybe", "load_in_4bit: expected true or false, got 'maybe'"},
      {"lr_scheduler: cosin", "lr_scheduler: unknown value 'cosin'; expected one of constant, constant_with_warmup, linear, cosine (did you mean 'cosine'?)"},
      {"max_steps: 0", "max_steps: expected an integer >= 1"},
      {"bf16: sometimes", "bf16: expected true, false or auto"},
      {"expert_offload_vram_budget: lots", "expert_offload_vram_budget: expected a size"},
      {"lora_target_modules: [q_proj, gate_prj]", "lora_target_modules: unknown module 'gate_prj'"},
      {"bnb_4bit_blocksize: 100", "bnb_4bit_blocksize: must be a power of two"},
      {"warmup_ratio: 1.5", "warmup_ratio: expected a number in [0, 1)"},
  };
  for (const auto& c : cases) {
    const std::string e = error_of(std::string(kValid) + c.line + "\n");
    EXPECT_NE(e.find(c.expect), std::string::npos) << "for '" << c.line << "' got:\n" << e;
  }
}

TEST(Config, VramBudgetAcceptsSizes) {
  for (const std::string v : {"0", "auto", "8GiB", "512MB", "1e9"})
    EXPECT_EQ(load(std::string(kValid) + "expert_offload_vram_budget: " + v + "\n").expert_offload_vram_budget, v);
}

TEST(Config, OffloadRequiresQloraAndNonReentrantCheckpointing) {
  const std::string e = error_of(R"(
base_model: /m
adapter: lora
datasets: [{path: a.jsonl}]
expert_offload: true
)");
  EXPECT_NE(e.find("load_in_4bit: expert_offload: true requires load_in_4bit: true"), std::string::npos) << e;
  EXPECT_NE(e.find("adapter: expert_offload: true requires adapter: qlora"), std::string::npos) << e;
  EXPECT_NE(e.find("gradient_checkpointing: expert_offload: true requires gradient_checkpointing: true"), std::string::npos) << e;
  // Omitted use_reentrant is an error that says why.
  EXPECT_NE(e.find("gradient_checkpointing_kwargs.use_reentrant: expert_offload: true requires it to be set explicitly to "
                   "false: the non-reentrant recompute"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("has 4 problems"), std::string::npos) << e;
}

TEST(Config, ReentrantCheckpointingIsRejected) {
  const std::string e = error_of(std::string(kValid) +
                                 "gradient_checkpointing: true\ngradient_checkpointing_kwargs: {use_reentrant: true}\n");
  EXPECT_NE(e.find("gradient_checkpointing_kwargs.use_reentrant: eo-ddp implements non-reentrant checkpointing only"),
            std::string::npos)
      << e;
}

TEST(Config, ShardedAndParallelModesAreRejectedWithReasons) {
  const std::string e = error_of(std::string(kValid) + R"(
fsdp: [full_shard, auto_wrap]
fsdp_config:
  fsdp_offload_params: true
deepspeed: deepspeed_configs/zero3.json
expert_parallel_size: 2
tensor_parallel_size: 4
)");
  EXPECT_NE(e.find("fsdp: not supported: FSDP shards every weight"), std::string::npos) << e;
  EXPECT_NE(e.find("fsdp_config: not supported"), std::string::npos) << e;
  EXPECT_NE(e.find("deepspeed: not supported: DeepSpeed/ZeRO"), std::string::npos) << e;
  EXPECT_NE(e.find("expert_parallel_size: not supported (2): expert parallelism"), std::string::npos) << e;
  EXPECT_NE(e.find("tensor_parallel_size: not supported (4)"), std::string::npos) << e;
  EXPECT_NE(e.find("has 5 problems"), std::string::npos) << e;
}

TEST(Config, ParallelSizesOfOneAndEmptyFsdpAreFine) {
  EXPECT_NO_THROW(load(std::string(kValid) + "expert_parallel_size: 1\ntensor_parallel_size: 1\nfsdp:\ndeepspeed:\n"));
}

TEST(Config, AllErrorsListedAtOnce) {
  // The acceptance case: a typo'd key, an fsdp key and no use_reentrant under offload.
  const std::string e = error_of(std::string(kValid) +
                                 "expert_offlaod_pin_memory: true\nfsdp: [full_shard]\nexpert_offload: true\n"
                                 "gradient_checkpointing: true\n");
  EXPECT_NE(e.find("has 3 problems"), std::string::npos) << e;
  EXPECT_NE(e.find("expert_offlaod_pin_memory"), std::string::npos);
  EXPECT_NE(e.find("fsdp: not supported"), std::string::npos);
  EXPECT_NE(e.find("gradient_checkpointing_kwargs.use_reentrant"), std::string::npos);
}

TEST(Config, RequiredKeys) {
  const std::string e = error_of("lora_r: 8\n");
  EXPECT_NE(e.find("base_model: required"), std::string::npos) << e;
  EXPECT_NE(e.find("adapter: required"), std::string::npos) << e;
  EXPECT_NE(e.find("datasets: required"), std::string::npos) << e;
}

TEST(Config, QloraNeedsLoadIn4bit) {
  const std::string e = error_of("base_model: /m\nadapter: qlora\ndatasets: [{path: a}]\n");
  EXPECT_NE(e.find("load_in_4bit: adapter: qlora needs load_in_4bit: true"), std::string::npos) << e;
}

TEST(Config, DatasetEntriesAreChecked) {
  const std::string e = error_of(R"(
base_model: /m
adapter: lora
datasets:
  - path: a.bin
    type: tokens
    dtype: int8
  - type: sharegpt
    pth: x
  - path: c.jsonl
    type: alpaca
    roles_to_train: [assistant]
  - path: d.jsonl
    type: chat_template
    train_on_eos: sometimes
    chat_template: llama99
)");
  EXPECT_NE(e.find("datasets.0.dtype: expected uint16 or uint32"), std::string::npos) << e;
  EXPECT_EQ(e.find("datasets.1.type"), std::string::npos) << e;  // sharegpt is converted (datasets_legacy.h)
  EXPECT_NE(e.find("datasets.2.roles_to_train: does not apply to type: alpaca"), std::string::npos) << e;
  EXPECT_NE(e.find("datasets.3.train_on_eos: expected one of all, turn, last, none"), std::string::npos) << e;
  EXPECT_NE(e.find("datasets.3.chat_template: unknown value 'llama99'"), std::string::npos) << e;
  EXPECT_NE(e.find("datasets.1.pth: unknown key"), std::string::npos) << e;
  EXPECT_NE(e.find("did you mean 'path'"), std::string::npos) << e;
  EXPECT_NE(e.find("datasets.1.path: required"), std::string::npos) << e;
}

// Issue #16: the axolotl dataset keys are read per type; what changes the training is implemented
// or an error, never a warning.
TEST(Config, AxolotlDatasetsAndEvaluation) {
  const TrainConfig c = load(R"(
base_model: /m
adapter: lora
train_on_inputs: true
chat_template: chatml
special_tokens: {pad_token: "<|endoftext|>"}
datasets:
  - path: chat.jsonl
    type: chat_template
    field_messages: conversations
    message_field_role: from
    message_field_content: value
    roles_to_train: [gpt]
    train_on_eos: last
    roles: {assistant: [gpt, bot]}
  - path: text.jsonl
    type: completion
    field: body
val_set_size: 0.1
evals_per_epoch: 4
saves_per_epoch: 2
)");
  ASSERT_EQ(c.datasets.size(), 2u);
  EXPECT_TRUE(c.datasets[0].formatted());
  EXPECT_EQ(c.datasets[0].field_messages, "conversations");
  EXPECT_EQ(c.datasets[0].roles_to_train.value(), std::vector<std::string>{"gpt"});
  EXPECT_EQ(c.datasets[0].train_on_eos, "last");
  ASSERT_EQ(c.datasets[0].roles.size(), 1u);
  EXPECT_EQ(c.datasets[0].roles[0].second.size(), 2u);
  EXPECT_EQ(c.datasets[1].field, "body");
  EXPECT_TRUE(c.train_on_inputs);
  EXPECT_EQ(c.chat_template, "chatml");
  EXPECT_EQ(c.val_set_size.value(), 0.1);
  EXPECT_EQ(c.evals_per_epoch.value(), 4);
  EXPECT_EQ(c.saves_per_epoch.value(), 2);
  for (const auto& w : c.warnings) EXPECT_EQ(w.find("train_on_inputs"), std::string::npos) << w;
  // The printout reads back to the same config.
  EXPECT_EQ(config_to_yaml(load(config_to_yaml(c))), config_to_yaml(c));

  const std::string e = error_of(R"(
base_model: /m
adapter: lora
datasets: [{path: a.jsonl, type: alpaca}]
test_datasets: [{path: b.jsonl, type: alpaca}]
val_set_size: 0.05
eval_steps: 10
evals_per_epoch: 2
save_steps: 5
saves_per_epoch: 2
group_by_length: true
lora_fan_in_fan_out: true
special_tokens: {sep_token: x}
)");
  EXPECT_NE(e.find("val_set_size: set either val_set_size"), std::string::npos) << e;
  EXPECT_NE(e.find("evals_per_epoch: set either eval_steps or evals_per_epoch"), std::string::npos) << e;
  EXPECT_NE(e.find("saves_per_epoch: set either save_steps or saves_per_epoch"), std::string::npos) << e;
  EXPECT_NE(e.find("group_by_length: not supported: batches by length are not implemented"), std::string::npos) << e;
  EXPECT_NE(e.find("lora_fan_in_fan_out:"), std::string::npos) << e;
  EXPECT_NE(e.find("special_tokens.sep_token: unknown"), std::string::npos) << e;
  // As axolotl: evaluation keys without evaluation data (val_set_size 0) run no evaluation.
  const TrainConfig no_eval =
      load("base_model: /m\nadapter: lora\ndatasets: [{path: a, type: tokenized}]\neval_steps: 5\nval_set_size: 0\n");
  ASSERT_EQ(no_eval.warnings.size(), 1u);
  EXPECT_NE(no_eval.warnings[0].find("'eval_steps' has no effect: there is no evaluation data"), std::string::npos)
      << no_eval.warnings[0];
  EXPECT_NE(error_of("base_model: /m\nadapter: lora\ndatasets: [{path: a}]\nchat_template: jinja\n")
                .find("chat_template_jinja: chat_template: jinja needs the template text"),
            std::string::npos);
}

TEST(Config, SetOverridesFileAndIsValidated) {
  const TrainConfig c = load(std::string(kValid) + kOffload,
                             {"learning_rate=1e-4", "gradient_checkpointing_kwargs.use_reentrant=false", "lora_r=4",
                              "lora_target_modules=[q_proj, gate_proj, up_proj]", "datasets.0.path=other.jsonl"});
  EXPECT_DOUBLE_EQ(c.learning_rate, 1e-4);
  EXPECT_EQ(c.lora_r, 4);
  EXPECT_EQ(c.lora_target_modules.size(), 3u);
  EXPECT_EQ(c.datasets[0].path, "other.jsonl");
  // A nested key that did not exist in the file is created by --set.
  const TrainConfig d = load(std::string(kValid) + "expert_offload: true\ngradient_checkpointing: true\n",
                             {"gradient_checkpointing_kwargs.use_reentrant=false"});
  EXPECT_FALSE(*d.use_reentrant);
  // --set values go through the same validation.
  EXPECT_NE(error_of(kValid, {"lora_r=0"}).find("lora_r: must be between 1"), std::string::npos);
  EXPECT_NE(error_of(kValid, {"lora_rr=4"}).find("lora_rr: unknown key; did you mean 'lora_r'?"), std::string::npos);
  EXPECT_NE(error_of(kValid, {"novalue"}).find("expected key=value"), std::string::npos);
}

TEST(Config, IgnoredAxolotlKeysWarn) {
  // A noted key set to nothing (strict: false) says nothing.
  const TrainConfig c = load(std::string(kValid) + "strict: false\nwandb_watch: gradients\nflash_attention: true\n");
  ASSERT_EQ(c.warnings.size(), 2u);
  EXPECT_NE(c.warnings[0].find("is ignored by eo-ddp"), std::string::npos);
  EXPECT_NE(error_of(std::string(kValid) + "load_in_8bit: true\n").find("load_in_8bit: not supported"), std::string::npos);
  EXPECT_NO_THROW(load(std::string(kValid) + "load_in_8bit: false\n"));
}

// fp16 / bf16: axolotl's keys, one rule (resolve_compute), and the contradiction a config error
// that names the key and the fix.
TEST(Config, Fp16AndBf16ResolveToOneComputeDtype) {
  struct Case {
    std::string yaml;
    bool cuda, has_bf16;
    Compute expect;
    std::string why;
  };
  const std::vector<Case> cases = {
      {"", true, true, Compute::Bf16, "bf16: auto on a GPU with bf16"},
      {"", true, false, Compute::Fp16, "compute capability below 8.0"},
      {"", false, false, Compute::Fp32, "on the CPU"},
      {"fp16: false\n", true, false, Compute::Fp32, "fp16: false"},
      {"fp16: true\n", false, false, Compute::Fp16, "fp16: true"},
      {"fp16: true\nbf16: false\n", true, true, Compute::Fp16, "fp16: true"},
      {"fp16: true\nbf16: auto\n", true, true, Compute::Fp16, "fp16: true"},
      {"bf16: true\n", true, false, Compute::Bf16, "bf16: true"},  // refused at start-up, naming the card
      {"bf16: false\n", true, true, Compute::Fp32, "bf16: false"},
  };
  for (const auto& c : cases) {
    const ComputeChoice r = resolve_compute(load(std::string(kValid) + c.yaml), c.cuda, c.has_bf16);
    EXPECT_EQ(r.dtype, c.expect) << c.yaml << " cuda " << c.cuda << " bf16 " << c.has_bf16;
    EXPECT_NE(r.why.find(c.why), std::string::npos) << r.why;
  }
  const std::string e = error_of(std::string(kValid) + "fp16: true\nbf16: true\n");
  EXPECT_NE(e.find("fp16: fp16: true and bf16: true contradict each other"), std::string::npos) << e;
  EXPECT_NE(e.find("set bf16: false (or auto)"), std::string::npos) << e;
  EXPECT_NE(error_of(std::string(kValid) + "fp16: often\n").find("fp16: expected true or false"), std::string::npos);
  EXPECT_NE(error_of(std::string(kValid) + "loss_scale_growth_interval: 0\n").find("loss_scale_growth_interval: must be"),
            std::string::npos);
  EXPECT_STREQ(compute_name(Compute::Fp16), "fp16");
}

TEST(Config, FilesAreCheckedBeforeAnythingLoads) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / "eo_cfg_test";
  fs::create_directories(dir / "model");
  // output_dir spelled otherwise but the base_model folder (issue #32 item 12).
  const std::string same = (dir / "model" / ".").string();
  const std::string yaml = "base_model: " + (dir / "model").string() + "\nadapter: lora\ndatasets: [{path: " +
                           (dir / "missing.jsonl").string() + "}]\noutput_dir: " + same + "\n";
  try {
    load_config_text(yaml, "t.yaml", {});
    FAIL() << "accepted";
  } catch (const UsageError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("base_model: '" + (dir / "model").string() + "' has no config.json"), std::string::npos) << m;
    EXPECT_NE(m.find("datasets.0.path: file '"), std::string::npos) << m;
    EXPECT_NE(m.find("output_dir: '" + same + "' is the base_model folder"), std::string::npos) << m;
  }
  eo::remove_tree(dir);
}

TEST(Config, InvalidYamlIsAUsageError) {
  EXPECT_THROW(load("base_model: [unclosed\n"), UsageError);
  EXPECT_THROW(load("- just\n- a list\n"), UsageError);
}

TEST(Config, ResolvedYamlRoundTrips) {
  const TrainConfig a = load(std::string(kValid) + kOffload + "max_steps: 7\nwarmup_ratio: 0.1\n");
  const TrainConfig b = load(config_to_yaml(a));
  EXPECT_EQ(config_to_yaml(a), config_to_yaml(b));
  EXPECT_EQ(b.max_steps.value_or(0), 7);
  // Doubles print in their shortest exact form (not 0.050000000000000003) and read back bitwise.
  const TrainConfig c = load(std::string(kValid) + "lora_dropout: 0.05\nlearning_rate: 3.0e-4\n");
  const std::string yaml = config_to_yaml(c);
  EXPECT_NE(yaml.find("lora_dropout: 0.05\n"), std::string::npos) << yaml;
  EXPECT_NE(yaml.find("learning_rate: 3e-04\n"), std::string::npos) << yaml;
  EXPECT_EQ(load(yaml).lora_dropout, 0.05);
  EXPECT_EQ(load(yaml).learning_rate, 3.0e-4);
}

// docs/configuration.md is the config reference: every key of the schema is in it (its table is
// `eo-ddp --help-config` as printed, which tests/docs_check.py compares whole).
TEST(Config, DocsDocumentEveryKey) {
  std::ifstream in(std::string(EO_SOURCE_DIR) + "/docs/configuration.md");
  ASSERT_TRUE(in) << "docs/configuration.md missing";
  const std::string page((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (const auto& k : config_known_keys())
    EXPECT_NE(page.find("`" + k + "`"), std::string::npos) << "docs/configuration.md does not document " << k
                                                           << " (paste `eo-ddp --help-config` into it)";
}

TEST(Text, BytesAndSuggestions) {
  EXPECT_EQ(parse_bytes("8GiB").value(), 8ull << 30);
  EXPECT_EQ(parse_bytes("512 MB").value(), 512000000ull);
  EXPECT_EQ(parse_bytes("123").value(), 123ull);
  EXPECT_FALSE(parse_bytes("lots"));
  EXPECT_FALSE(parse_bytes("-1GB"));
  EXPECT_EQ(edit_distance("offlaod", "offload"), 1u);
  EXPECT_EQ(closest_match("lora_rr", {"lora_r", "lora_alpha"}).value(), "lora_r");
  EXPECT_FALSE(closest_match("zzzzzz", {"lora_r"}));
}

// The suggestion search stops early against the best candidate so far; its answers must be the
// full optimal-string-alignment table's, written out here independently, on random near-miss words.
TEST(Text, SuggestionsEqualTheFullDistanceTable) {
  auto osa = [](const std::string& a, const std::string& b) {
    std::vector<std::vector<int>> d(a.size() + 1, std::vector<int>(b.size() + 1));
    for (std::size_t i = 0; i <= a.size(); ++i) d[i][0] = static_cast<int>(i);
    for (std::size_t j = 0; j <= b.size(); ++j) d[0][j] = static_cast<int>(j);
    for (std::size_t i = 1; i <= a.size(); ++i)
      for (std::size_t j = 1; j <= b.size(); ++j) {
        d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] != b[j - 1])});
        if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
      }
    return static_cast<std::size_t>(d[a.size()][b.size()]);
  };
  std::mt19937 rng(7);
  auto word = [&](std::size_t len) {
    std::string w;
    for (std::size_t i = 0; i < len; ++i) w += "abcd_"[rng() % 5];
    return w;
  };
  for (int t = 0; t < 300; ++t) {
    const std::string w = word(rng() % 13);
    std::vector<std::string> cands;
    for (int c = 0; c < 6; ++c) cands.push_back(word(rng() % 13));
    std::optional<std::string> want;
    std::size_t want_d = std::max<std::size_t>(2, w.size() / 3) + 1;
    for (const auto& c : cands) {
      ASSERT_EQ(edit_distance(w, c), osa(w, c)) << w << " / " << c;
      if (osa(w, c) < want_d) want_d = osa(w, c), want = c;
    }
    EXPECT_EQ(closest_match(w, cands), want) << w;
  }
}

// Issue #15 item 11: `--set key=` (empty) is an error, not a silent reset to the default.
TEST(Config, EmptySetValueIsAnError) {
  const std::string m = error_of(kValid, {"lora_r="});
  EXPECT_NE(m.find("lora_r: --set lora_r= has an empty value"), std::string::npos) << m;
  EXPECT_NO_THROW(load(kValid, {"lora_r=16"}));
}

// Issue #15 item 10: lora_target_linear takes the architecture's linears from base_model/config.json
// (Mixtral experts are w1/w2/w3); targets of which none matches a linear of it are a config error.
TEST(Config, TargetModulesComeFromTheArchitecture) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("eo_cfg_targets_" + std::to_string(::getpid()));
  for (const char* m : {"mixtral-8x7b", "qwen3-30b-a3b", "olmoe-1b-7b", "deepseek-v2-lite", "glm-4.5-air"}) {
    fs::create_directories(dir / m);
    fs::copy_file(std::string(EO_SOURCE_DIR) + "/configs/models/" + m + "/config.json", dir / m / "config.json",
                  fs::copy_options::overwrite_existing);
  }
  std::ofstream(dir / "train.jsonl") << "{\"input_ids\": [1, 2, 3]}\n";
  auto yaml = [&](const std::string& model, const std::string& extra) {
    return "base_model: " + (dir / model).string() + "\nadapter: lora\ndatasets: [{path: " + (dir / "train.jsonl").string() +
           "}]\n" + extra;
  };
  const std::vector<std::string> mixtral{"q_proj", "k_proj", "v_proj", "o_proj", "w1", "w2", "w3"};
  const std::vector<std::string> qwen{"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
  EXPECT_EQ(load_config_text(yaml("mixtral-8x7b", "lora_target_linear: true\n"), "t.yaml", {}).lora_target_modules, mixtral);
  EXPECT_EQ(load_config_text(yaml("qwen3-30b-a3b", "lora_target_linear: true\n"), "t.yaml", {}).lora_target_modules, qwen);
  EXPECT_EQ(load_config_text(yaml("olmoe-1b-7b", "lora_target_linear: true\n"), "t.yaml", {}).lora_target_modules, qwen);
  // peft's layers_to_transform (axolotl's peft_layers_to_transform): sorted, once each, within the
  // architecture's layers; layers_pattern can only name model.layers.
  EXPECT_EQ(load_config_text(yaml("mixtral-8x7b", "peft_layers_to_transform: [3, 1, 1]\npeft_layers_pattern: [layers]\n"),
                             "t.yaml", {}).peft_layers_to_transform,
            (std::vector<int>{1, 3}));
  EXPECT_EQ(load_config_text(yaml("mixtral-8x7b", "peft_layers_to_transform: 2\n"), "t.yaml", {}).peft_layers_to_transform,
            std::vector<int>{2});
  try {
    load_config_text(yaml("mixtral-8x7b", "peft_layers_to_transform: [1, 32]\npeft_layers_pattern: [h]\n"), "t.yaml", {});
    ADD_FAILURE() << "layer 32 of Mixtral-8x7B (32 layers) and layers_pattern h were accepted";
  } catch (const UsageError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("peft_layers_to_transform: 32 is no layer of mixtral"), std::string::npos) << m;
    EXPECT_NE(m.find("peft_layers_pattern: [h] names no module list"), std::string::npos) << m;
  }
  EXPECT_NE(error_of(std::string(kValid) + "peft_layers_to_transform: [a]\n").find("peft_layers_to_transform: expected a layer "
                                                                                   "index >= 0 or a list of them"),
            std::string::npos);
  // Issue #19: GLM-4.5-Air has q/k/v/o and MLPs; DeepSeek-V2-Lite's latent attention (full q_proj).
  EXPECT_EQ(load_config_text(yaml("glm-4.5-air", "lora_target_linear: true\n"), "t.yaml", {}).lora_target_modules, qwen);
  const std::vector<std::string> mla{"q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
  EXPECT_EQ(load_config_text(yaml("deepseek-v2-lite", "lora_target_linear: true\n"), "t.yaml", {}).lora_target_modules, mla);
  // As peft, names that match no module are dropped while another matches (with a warning naming
  // them); the router-loss key is still an error.
  {
    const TrainConfig c = load_config_text(yaml("deepseek-v2-lite", "lora_target_modules: [q_proj, k_proj, q_b_proj]\n"),
                                           "t.yaml", {});
    EXPECT_EQ(c.lora_target_modules, std::vector<std::string>{"q_proj"});
    ASSERT_FALSE(c.warnings.empty());
    EXPECT_NE(c.warnings.back().find("'k_proj', 'q_b_proj' match no linear of deepseek_v2"), std::string::npos)
        << c.warnings.back();
    EXPECT_NE(c.warnings.back().find("only the names that match are adapted: q_proj"), std::string::npos)
        << c.warnings.back();
  }
  try {
    load_config_text(yaml("deepseek-v2-lite", "lora_target_modules: [k_proj, q_b_proj]\noutput_router_logits: true\n"),
                     "t.yaml", {});
    ADD_FAILURE() << "k_proj / q_b_proj alone on DeepSeek-V2-Lite were accepted";
  } catch (const UsageError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("'k_proj' matches no linear of deepseek_v2"), std::string::npos) << m;
    EXPECT_NE(m.find("'q_b_proj' matches no linear of deepseek_v2"), std::string::npos) << m;
    EXPECT_NE(m.find("output_router_logits: deepseek_v2 has no router auxiliary loss"), std::string::npos) << m;
  }
  {
    const TrainConfig c = load_config_text(yaml("mixtral-8x7b", "lora_target_modules: [q_proj, gate_proj, up_proj]\n"),
                                           "t.yaml", {});
    EXPECT_EQ(c.lora_target_modules, std::vector<std::string>{"q_proj"});
    ASSERT_FALSE(c.warnings.empty());
    EXPECT_NE(c.warnings.back().find("'gate_proj', 'up_proj' match no linear of mixtral"), std::string::npos)
        << c.warnings.back();
  }
  try {
    load_config_text(yaml("mixtral-8x7b", "lora_target_modules: [gate_proj, up_proj]\n"), "t.yaml", {});
    ADD_FAILURE() << "gate_proj on Mixtral was accepted";
  } catch (const UsageError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("'gate_proj' matches no linear of mixtral"), std::string::npos) << m;
    EXPECT_NE(m.find("'up_proj' matches no linear of mixtral"), std::string::npos) << m;
    EXPECT_NE(m.find("w1, w2, w3"), std::string::npos) << m;
  }
  try {
    load_config_text(yaml("qwen3-30b-a3b", "lora_target_modules: [w1]\n"), "t.yaml", {});
    ADD_FAILURE() << "w1 on Qwen3-MoE was accepted";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("'w1' matches no linear of qwen3_moe"), std::string::npos) << e.what();
  }
  eo::remove_tree(dir);
}

// Issue #31 item 1: every key of axolotl's schema is classified once; noted keys are accepted with
// their note, rejected ones refused with their reason unless off, and a typo still gets a suggestion.
TEST(Config, AxolotlKeysAreEachClassifiedOnce) {
  const auto table = axolotl_keys();
  ASSERT_GT(table.size(), 450u);
  std::set<std::string> seen;
  const auto known = config_known_keys();
  for (const auto& k : table) {
    EXPECT_TRUE(seen.insert(k.key).second) << k.key << " is listed twice";
    EXPECT_TRUE(k.cls == "implemented" || k.cls == "noted" || k.cls == "rejected") << k.key;
    if (k.cls != "implemented") EXPECT_FALSE(k.text.empty()) << k.key << " needs its note or reason";
    // An implemented key with no text is read by the schema itself.
    if (k.cls == "implemented" && k.text.empty() && k.key.rfind("datasets[].", 0) != 0)
      EXPECT_NE(std::find(known.begin(), known.end(), k.key), known.end()) << k.key << " is not in the schema";
    if (k.key.rfind("datasets[].", 0) == 0 || k.cls == "implemented") continue;
    const bool size = k.key.find("parallel_size") != std::string::npos || k.key.find("_degree") != std::string::npos ||
                      k.key.rfind("dp_", 0) == 0;
    const std::string on = std::string(kValid) + k.key + (size ? ": 2\n" : ": true\n");
    if (k.cls == "noted") {
      const TrainConfig c = load(on);
      ASSERT_EQ(c.warnings.size(), 1u) << k.key;
      EXPECT_NE(c.warnings[0].find("'" + k.key + "' is ignored by eo-ddp: " + k.text), std::string::npos) << c.warnings[0];
    } else {
      EXPECT_NE(error_of(on).find(k.key + ": not supported" + (size ? " (2)" : "") + ": " + k.text), std::string::npos) << k.key;
    }
    EXPECT_TRUE(load(std::string(kValid) + k.key + ":\n").warnings.empty()) << k.key;  // off: nothing to say
  }
  EXPECT_NE(error_of(std::string(kValid) + "attn_implementaton: sdpa\n").find("attn_implementaton: unknown key; did you mean "
                                                                             "'attn_implementation'?"),
            std::string::npos);
  const std::string ds = error_of("base_model: /m\nadapter: lora\ndatasets: [{path: a, type: chat_template, "
                                  "data_files: [x.json], shard: 1}]\n");
  EXPECT_EQ(ds.find("datasets.0.data_files"), std::string::npos) << ds;  // a Hub dataset's files
  EXPECT_NE(ds.find("datasets.0.shard: unknown key"), std::string::npos) << ds;
  // docs/axolotl-keys.md is the table as printed.
  std::ifstream in(std::string(EO_SOURCE_DIR) + "/docs/axolotl-keys.md");
  const std::string doc((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(doc, axolotl_keys_markdown()) << "regenerate docs/axolotl-keys.md with eo-ddp --help-axolotl-keys";
}

// The axolotl keys whose values eo-ddp reads itself, as the issue's table lists them.
TEST(Config, AxolotlValuesEoDdpTakesAsTheirEquivalent) {
  const TrainConfig c = load(std::string(kValid) + R"(
plugins:
  - axolotl.integrations.liger.LigerPlugin
  - axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin
model_config:
  output_router_logits: true
gradient_checkpointing: offload
gradient_checkpointing_kwargs:
  use_reentrant: false
optimizer: adamw_bnb_8bit
attn_implementation: flash_attention_2
evals_per_epoch: 4
val_set_size: 0
excess_length_strategy: drop
)");
  EXPECT_TRUE(c.output_router_logits);
  EXPECT_TRUE(c.gradient_checkpointing);
  EXPECT_TRUE(c.activation_offloading);
  std::string all;
  for (const auto& w : c.warnings) all += w + "\n";
  EXPECT_NE(all.find("plugin 'axolotl.integrations.liger.LigerPlugin' is ignored by eo-ddp"), std::string::npos) << all;
  EXPECT_NE(all.find("optimizer adamw_bnb_8bit runs as AdamW with fp32 state"), std::string::npos) << all;
  EXPECT_NE(all.find("'attn_implementation' is ignored by eo-ddp"), std::string::npos) << all;
  EXPECT_NE(all.find("'evals_per_epoch' has no effect"), std::string::npos) << all;
  const std::string e = error_of(std::string(kValid) + R"(
plugins: [axolotl.integrations.expert_parallel.ExpertParallelPlugin, my.Plugin]
model_config: [rope_theta]
optimizer: lion_8bit
excess_length_strategy: truncate
gradient_checkpointing: sometimes
)");
  EXPECT_NE(e.find("plugins: 'axolotl.integrations.expert_parallel.ExpertParallelPlugin' not supported: expert parallelism"),
            std::string::npos) << e;
  EXPECT_NE(e.find("plugins: unknown plugin 'my.Plugin'"), std::string::npos) << e;
  EXPECT_NE(e.find("overrides_of_model_config: expected a map of config.json keys"), std::string::npos) << e;
  EXPECT_NE(e.find("optimizer: unknown value 'lion_8bit'; eo-ddp's optimizer is AdamW"), std::string::npos) << e;
  EXPECT_NE(e.find("excess_length_strategy: 'truncate'"), std::string::npos) << e;
  EXPECT_NE(e.find("gradient_checkpointing: expected true, false, offload or offload_disk"), std::string::npos) << e;
  EXPECT_NE(e.find("has 6 problems"), std::string::npos) << e;
  // eot_tokens and the thinking fields (tests/ref/eot_thinking_ref.py checks the labels).
  const TrainConfig eot = load("base_model: /m\nadapter: lora\neot_tokens: ['<|end|>']\ndatasets: [{path: a, type: chat_template, "
                               "train_on_eot: last, field_thinking: thinking, template_thinking_key: thinking}]\n");
  EXPECT_EQ(eot.eot_tokens, std::vector<std::string>{"<|end|>"});
  EXPECT_EQ(eot.datasets[0].train_on_eot, "last");
  EXPECT_EQ(eot.datasets[0].field_thinking, "thinking");
  EXPECT_NE(error_of("base_model: /m\nadapter: lora\ndatasets: [{path: a, type: chat_template, train_on_eot: sometimes}]\n")
                .find("datasets.0.train_on_eot: expected one of all, turn, last, none"),
            std::string::npos);
  // datasets[].split: train and one slice of it (tests/ref/split_ref.py checks the rows kept).
  EXPECT_EQ(load("base_model: /m\nadapter: lora\ndatasets: [{path: a, type: completion, split: 'train[:20%]'}]\n")
                .datasets[0].split, "train[:20%]");
  const std::string sp = error_of("base_model: /m\nadapter: lora\ndatasets: [{path: a, type: completion, split: 'train[:200%]'}, "
                                  "{path: b, split: 'train[:10]'}, {path: c, type: alpaca, split: 'train+test'}]\n");
  EXPECT_NE(sp.find("datasets.0.split: 'train[:200%]': percentages must be between"), std::string::npos) << sp;
  EXPECT_NE(sp.find("datasets.1.split: a slice applies to the axolotl formats"), std::string::npos) << sp;
  EXPECT_NE(sp.find("datasets.2.split: 'train+test': a local JSON lines file is the split train"), std::string::npos) << sp;
}

// Issue #31 item 4: the architecture is checked with the keys, so one run lists an unsupported
// model_type beside an unknown key; unset targets follow the architecture (DeepSeek has no k_proj).
TEST(Config, ArchitectureProblemsAreListedWithKeyProblems) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("eo_cfg_arch_" + std::to_string(::getpid()));
  fs::create_directories(dir / "llama");
  std::ofstream(dir / "llama" / "config.json") << R"({"model_type": "llama", "hidden_size": 64})";
  fs::create_directories(dir / "deepseek-v2-lite");
  fs::copy_file(std::string(EO_SOURCE_DIR) + "/configs/models/deepseek-v2-lite/config.json",
                dir / "deepseek-v2-lite" / "config.json", fs::copy_options::overwrite_existing);
  std::ofstream(dir / "train.jsonl") << "{\"input_ids\": [1, 2, 3]}\n";
  auto yaml = [&](const std::string& model, const std::string& extra) {
    return "base_model: " + (dir / model).string() + "\nadapter: lora\ndatasets: [{path: " + (dir / "train.jsonl").string() +
           "}]\n" + extra;
  };
  try {
    load_config_text(yaml("llama", "lora_rr: 8\n"), "t.yaml", {});
    ADD_FAILURE() << "llama was accepted";
  } catch (const UsageError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("has 2 problems"), std::string::npos) << m;
    EXPECT_NE(m.find("lora_rr: unknown key; did you mean 'lora_r'?"), std::string::npos) << m;
    EXPECT_NE(m.find("base_model: " + (dir / "llama").string() + "/config.json: model_type 'llama' is not supported"),
              std::string::npos) << m;
  }
  // Gemma 4: the real 26B-A4B (a multimodal wrapper) resolves its targets; a dense Gemma 4's
  // options eo-ddp does not train are one problem, listed whole beside the key problem.
  fs::create_directories(dir / "gemma-4-26b-a4b");
  fs::copy_file(std::string(EO_SOURCE_DIR) + "/configs/models/gemma-4-26b-a4b/config.json",
                dir / "gemma-4-26b-a4b" / "config.json", fs::copy_options::overwrite_existing);
  EXPECT_EQ(load_config_text(yaml("gemma-4-26b-a4b", "lora_target_linear: true\n"), "t.yaml", {}).lora_target_modules,
            (std::vector<std::string>{"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}));
  fs::create_directories(dir / "gemma-dense");
  std::ofstream(dir / "gemma-dense" / "config.json") << R"({"model_type": "gemma4", "text_config": {"hidden_size": 64}})";
  try {
    load_config_text(yaml("gemma-dense", "lora_rr: 8\n"), "t.yaml", {});
    ADD_FAILURE() << "a dense gemma4 was accepted";
  } catch (const UsageError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("has 2 problems"), std::string::npos) << m;
    EXPECT_NE(m.find("text_config: this gemma4 config is not supported (Gemma4ForConditionalGeneration"), std::string::npos) << m;
    EXPECT_NE(m.find("enable_moe_block false"), std::string::npos) << m;
    EXPECT_NE(m.find("hidden_size_per_layer_input > 0"), std::string::npos) << m;
    EXPECT_EQ(m.find("bytes cut"), std::string::npos) << m;
  }
  const std::vector<std::string> mla{"q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"};
  EXPECT_EQ(load_config_text(yaml("deepseek-v2-lite", ""), "t.yaml", {}).lora_target_modules, mla);
  ConfigLoadOptions plan_options;  // eo-ddp plan: no file checks, the architecture still resolves the targets
  plan_options.check_files = false;
  plan_options.check_architecture = true;
  EXPECT_EQ(load_config_text(yaml("deepseek-v2-lite", ""), "t.yaml", {}, plan_options)
                .lora_target_modules,
            mla);
  // axolotl's named chat templates eo-ddp ships are kept by name (tools/prepare_data.py renders
  // them, tests/ref/chat_templates_ref.py checks that against axolotl's) on any model, with a note
  // on another family's; axolotl's other names are refused wherever they are set, naming the fix.
  for (const char* m : {"qwen3-30b-a3b", "mixtral-8x7b", "gemma-4-26b-a4b"}) {
    fs::create_directories(dir / m);
    fs::copy_file(std::string(EO_SOURCE_DIR) + "/configs/models/" + m + "/config.json", dir / m / "config.json",
                  fs::copy_options::overwrite_existing);
    std::ofstream(dir / m / "tokenizer_config.json") << "{}";  // a chat_template dataset needs a tokenizer
  }
  const TrainConfig q = load_config_text(yaml("qwen3-30b-a3b", "chat_template: qwen3\n"), "t.yaml", {});
  EXPECT_EQ(q.chat_template, "qwen3");
  for (const auto& w : q.warnings) EXPECT_EQ(w.find("chat_template"), std::string::npos) << w;
  EXPECT_EQ(load_config_text(yaml("deepseek-v2-lite", "chat_template: deepseek_v2\n"), "t.yaml", {}).chat_template,
            "deepseek_v2");
  EXPECT_EQ(load_config_text(yaml("mixtral-8x7b", "chat_template: chatml\n"), "t.yaml", {}).chat_template, "chatml");
  const TrainConfig g = load_config_text(yaml("mixtral-8x7b", "chat_template: gemma4\n"), "t.yaml", {});
  EXPECT_EQ(g.chat_template, "gemma4");
  ASSERT_FALSE(g.warnings.empty());
  EXPECT_NE(g.warnings.back().find("chat_template: gemma4 is axolotl's template for gemma4, rendered on mixtral's tokenizer"),
            std::string::npos) << g.warnings.back();
  // Every other axolotl name (and inst of axolotl before 0.5) is kept by name too; an unknown one
  // is refused wherever it is set, with the names eo-ddp knows.
  const TrainConfig l = load_config_text(yaml("mixtral-8x7b", "chat_template: llama3\n") + "test_datasets: [{path: " +
                                             (dir / "train.jsonl").string() + ", type: chat_template, chat_template: inst}]\n",
                                         "t.yaml", {});
  EXPECT_EQ(l.chat_template, "llama3");
  EXPECT_EQ(l.test_datasets.at(0).chat_template, "inst");
  for (const char* name : {"mistral_v2v3", "qwen_25", "phi_3", "gemma", "cohere"})
    EXPECT_EQ(load_config_text(yaml("mixtral-8x7b", std::string("chat_template: ") + name + "\n"), "t.yaml", {}).chat_template,
              name);
  try {
    load_config_text(yaml("mixtral-8x7b", "") + "test_datasets: [{path: " + (dir / "train.jsonl").string() +
                         ", type: chat_template, chat_template: llama2}]\n",
                     "t.yaml", {});
    ADD_FAILURE() << "llama2, which axolotl has no template of, was accepted";
  } catch (const UsageError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("test_datasets.0.chat_template: unknown value 'llama2'"), std::string::npos) << m;
    EXPECT_NE(m.find("mistral_v2v3"), std::string::npos) << m;
  }
  // On Gemma 4 itself (the Hub's multimodal gemma4 wrapper) its template draws no note.
  const TrainConfig own = load_config_text(yaml("gemma-4-26b-a4b", "chat_template: gemma4\n"), "t.yaml", {});
  for (const auto& w : own.warnings) EXPECT_EQ(w.find("chat_template"), std::string::npos) << w;
  EXPECT_NE(error_of(std::string(kValid) + "chat_template: qwen_3\n").find("did you mean 'qwen3'?"), std::string::npos);
  eo::remove_tree(dir);
}

// Issue #16 item 5: lora_target_parameters takes peft's fused expert parameter names (full or
// bare, written canonical), names the accepted values for anything else, and refuses dropout as
// peft's ParamWrapper does; all before a weight is read.
TEST(Config, LoraTargetParametersAreTheFusedExpertParameters) {
  const TrainConfig c = load(std::string(kValid) + "lora_target_parameters: [gate_up_proj, mlp.experts.down_proj, down_proj]\n");
  EXPECT_EQ(c.lora_target_parameters, (std::vector<std::string>{"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}));
  EXPECT_TRUE(load(kValid).lora_target_parameters.empty());
  EXPECT_EQ(load(std::string(kValid) + "lora_target_parameters: [down_proj, gate_up_proj]\n").lora_target_parameters,
            (std::vector<std::string>{"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}))
      << "one order, as resume compares it";
  // Issue #31: any dotted suffix, as peft matches parameter names (axolotl's experts.gate_up_proj).
  EXPECT_EQ(load(std::string(kValid) + "lora_target_parameters: [experts.gate_up_proj, experts.down_proj]\n").lora_target_parameters,
            (std::vector<std::string>{"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}));
  // Llama 4's module path (feed_forward.experts), as its adapters and peft's docs spell it.
  EXPECT_EQ(load(std::string(kValid) + "lora_target_parameters: [feed_forward.experts.down_proj, "
                                       "feed_forward.experts.gate_up_proj]\n").lora_target_parameters,
            (std::vector<std::string>{"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}));
  EXPECT_NE(error_of(std::string(kValid) + "lora_target_parameters: [s.gate_up_proj]\n").find("unknown parameter 's.gate_up_proj'"),
            std::string::npos);
  // axolotl's gpt-oss examples name single layers' experts (under its checkpointing wrapper): one
  // problem, which says how eo-ddp adapts some layers only.
  const std::string layered = error_of(std::string(kValid) +
                                       "lora_target_parameters: [22._checkpoint_wrapped_module.mlp.experts.gate_up_proj, "
                                       "23._checkpoint_wrapped_module.mlp.experts.down_proj, 22.mlp.experts.down_proj]\n");
  EXPECT_NE(layered.find("lora_target_parameters: 22._checkpoint_wrapped_module.mlp.experts.gate_up_proj, "
                         "23._checkpoint_wrapped_module.mlp.experts.down_proj, 22.mlp.experts.down_proj name the parameters "
                         "of single layers"),
            std::string::npos)
      << layered;
  EXPECT_NE(layered.find("peft_layers_to_transform: [22, 23]"), std::string::npos) << layered;
  EXPECT_EQ(layered.find("unknown parameter"), std::string::npos) << layered;
  const std::string bad = error_of(std::string(kValid) + "lora_target_parameters: [mlp.experts.gate_proj]\n");
  EXPECT_NE(bad.find("lora_target_parameters: unknown parameter 'mlp.experts.gate_proj'"), std::string::npos) << bad;
  EXPECT_NE(bad.find("mlp.experts.gate_up_proj, mlp.experts.down_proj, gate_up_proj, down_proj"), std::string::npos) << bad;
  const std::string map = error_of(std::string(kValid) + "lora_target_parameters: {a: 1}\n");
  EXPECT_NE(map.find("lora_target_parameters: expected a list of parameter names"), std::string::npos) << map;
  const std::string drop = error_of(std::string(kValid) + "lora_dropout: 0.05\nlora_target_parameters: [down_proj]\n");
  EXPECT_NE(drop.find("lora_dropout: must be 0 with lora_target_parameters"), std::string::npos) << drop;
  EXPECT_NO_THROW(load(std::string(kValid) + "lora_dropout: 0.05\n"));
  // Expert names beside it: peft 0.21 would load them as the fused parameters at rank 2r. Checked
  // with base_model's config.json (as `eo-ddp plan` reads it): on Gemma 4 those names are the dense
  // MLP beside the experts, which peft keeps, so they are fine there.
  ConfigLoadOptions arch = no_files();
  arch.check_architecture = true;
  auto on = [&](const char* model, const std::string& rest) -> std::string {
    const std::string text = std::string("base_model: ") + EO_SOURCE_DIR + "/configs/models/" + model +
                             "\nadapter: lora\ndatasets: [{path: t.jsonl, type: tokenized}]\n" + rest;
    try {
      load_config_text(text, "t.yaml", {}, arch);
    } catch (const UsageError& e) {
      return e.what();
    }
    return "accepted";
  };
  const std::string both = on("qwen3-30b-a3b", "lora_target_modules: [q_proj, gate_proj, down_proj]\n"
                                               "lora_target_parameters: [down_proj]\n");
  EXPECT_NE(both.find("lora_target_modules: names gate_proj, down_proj beside lora_target_parameters"), std::string::npos)
      << both;
  EXPECT_NE(both.find("rank 2r"), std::string::npos) << both;
  const std::string linear = on("qwen3-30b-a3b", "lora_target_linear: true\nlora_target_parameters: [down_proj]\n");
  EXPECT_NE(linear.find("lora_target_linear: cannot be combined with lora_target_parameters"), std::string::npos) << linear;
  EXPECT_EQ(linear.find("lora_target_modules:"), std::string::npos) << "one error for one cause\n" << linear;
  EXPECT_EQ(on("gemma-4-26b-a4b", "lora_target_modules: [q_proj, gate_proj, up_proj, down_proj]\n"
                                  "lora_target_parameters: [experts.gate_up_proj, experts.down_proj]\n"), "accepted");
  EXPECT_EQ(on("gemma-4-26b-a4b", "lora_target_linear: true\nlora_target_parameters: [experts.gate_up_proj]\n"), "accepted");
  // gpt-oss and Llama 4 were never per-expert: peft keeps Llama 4's shared expert and dense MLP.
  EXPECT_EQ(on("gpt-oss-20b", "lora_target_linear: true\nlora_target_parameters: [gate_up_proj, down_proj]\n"), "accepted");
  EXPECT_EQ(on("llama-4-scout-17b-16e", "lora_target_modules: [q_proj, shared_expert.gate_proj, down_proj]\n"
                                        "lora_target_parameters: [feed_forward.experts.gate_up_proj, "
                                        "feed_forward.experts.down_proj]\n"),
            "accepted");
}

// expert_quant: one of auto / nf4 / mxfp4, needs load_in_4bit when not auto, and mxfp4 needs a
// checkpoint whose config.json says its experts are MXFP4; listed with the other problems, before
// a weight is read. experts_in_mxfp4 resolves auto as the loader does.
TEST(Config, ExpertQuantIsCheckedAgainstTheCheckpoint) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("eo_cfg_expert_quant_" + std::to_string(::getpid()));
  fs::create_directories(dir / "oss");
  fs::create_directories(dir / "oss_mxfp4");
  fs::create_directories(dir / "qwen");
  std::ifstream in(std::string(EO_SOURCE_DIR) + "/configs/models/gpt-oss-20b/config.json");
  const std::string oss((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::ofstream(dir / "oss" / "config.json") << oss;
  const std::string tail = "\"quantization_config\": {\"quant_method\": \"mxfp4\"},\n";
  std::ofstream(dir / "oss_mxfp4" / "config.json") << std::string("{\n") + tail + oss.substr(oss.find('{') + 1);
  fs::copy_file(std::string(EO_SOURCE_DIR) + "/configs/models/qwen3-30b-a3b/config.json", dir / "qwen" / "config.json");
  std::ofstream(dir / "train.jsonl") << "{\"input_ids\": [1, 2, 3]}\n";
  auto yaml = [&](const std::string& model, const std::string& extra) {
    return "base_model: " + (dir / model).string() + "\nload_in_4bit: true\nadapter: qlora\ndatasets: [{path: " +
           (dir / "train.jsonl").string() + "}]\n" + extra;
  };
  auto error = [&](const std::string& text) -> std::string {
    try {
      load_config_text(text, "t.yaml", {});
    } catch (const UsageError& e) {
      return e.what();
    }
    return "(accepted)";
  };
  const TrainConfig mx = load_config_text(yaml("oss_mxfp4", "expert_quant: mxfp4\n"), "t.yaml", {});
  EXPECT_EQ(mx.expert_quant, "mxfp4");
  const model::ModelConfig oss_mx = model::load_config((dir / "oss_mxfp4").string());
  const model::ModelConfig oss_float = model::load_config((dir / "oss").string());
  EXPECT_TRUE(oss_mx.mxfp4_experts);
  EXPECT_FALSE(oss_float.mxfp4_experts);
  EXPECT_TRUE(experts_in_mxfp4(mx, oss_mx));
  TrainConfig c = load_config_text(yaml("oss_mxfp4", ""), "t.yaml", {});
  EXPECT_EQ(c.expert_quant, "auto");
  EXPECT_TRUE(experts_in_mxfp4(c, oss_mx)) << "auto keeps a checkpoint's MXFP4";
  EXPECT_FALSE(experts_in_mxfp4(c, oss_float)) << "auto quantises float experts to NF4";
  c.expert_quant = "nf4";
  EXPECT_FALSE(experts_in_mxfp4(c, oss_mx));
  c.expert_quant = "auto";
  c.load_in_4bit = false;
  EXPECT_FALSE(experts_in_mxfp4(c, oss_mx)) << "without load_in_4bit the experts are unquantised";

  const std::string bad = error(yaml("oss_mxfp4", "expert_quant: fp4\n"));
  EXPECT_NE(bad.find("expert_quant: unknown value 'fp4'; expected one of auto, nf4, mxfp4"), std::string::npos) << bad;
  for (const char* model : {"oss", "qwen"}) {
    const std::string e = error(yaml(model, "expert_quant: mxfp4\nlora_r: 0\n"));
    EXPECT_NE(e.find("expert_quant: mxfp4 keeps experts in the MXFP4 a checkpoint stores them in, but " + (dir / model).string() +
                     "/config.json"),
              std::string::npos)
        << e;
    EXPECT_NE(e.find("use expert_quant: nf4 or auto"), std::string::npos) << e;
    EXPECT_NE(e.find("lora_r: must be between 1 and 4096"), std::string::npos) << "all problems at once\n" << e;
  }
  const std::string dense = error("base_model: " + (dir / "oss_mxfp4").string() + "\nadapter: lora\ndatasets: [{path: " +
                                  (dir / "train.jsonl").string() + "}]\nexpert_quant: mxfp4\n");
  EXPECT_NE(dense.find("expert_quant: mxfp4 needs load_in_4bit: true"), std::string::npos) << dense;
  EXPECT_NO_THROW(load_config_text(yaml("qwen", "expert_quant: nf4\n"), "t.yaml", {}));
  eo::remove_tree(dir);
}

// cuda_graphs: the decision table of runtime/runspec.h (no GPU needed: a CUDA device is a value here).
TEST(Config, CudaGraphsAutoIsOnWhereThePlanHasRoomForThePool) {
  TrainConfig cfg;
  cfg.gradient_checkpointing = true;
  cfg.lora_dropout = 0;
  const at::Device cuda(at::kCUDA, 0);
  eo::GraphFacts room;
  room.pool = "1.5 GiB";
  room.pool_fits = true;
  room.available = "80 GiB free";
  eo::GraphFacts tight = room;
  tight.pool_fits = false;
  auto on = [&](const TrainConfig& c, const eo::GraphFacts& f, const at::Device& d) {
    RunSpec spec = resolve_run_spec(c, eo::model::ModelConfig{}, eo::Compute::Bf16, d.is_cuda(), 1);
    decide_cuda_graphs(spec, f);
    return std::make_pair(spec.graphs, spec.graphs_why);
  };

  EXPECT_EQ(cfg.cuda_graphs, "auto");
  EXPECT_TRUE(on(cfg, room, cuda).first);
  const auto [tight_on, tight_why] = on(cfg, tight, cuda);
  EXPECT_FALSE(tight_on);
  EXPECT_NE(tight_why.find("does not fit"), std::string::npos) << tight_why;
  EXPECT_FALSE(on(cfg, room, at::Device(at::kCPU)).first);

  EXPECT_NE(tight_why.find("cuda_graphs: true"), std::string::npos) << "says how to force them: " << tight_why;

  // Offloaded runs decide the same way: on where the plan has room for the pool, off where not.
  TrainConfig offload = cfg;
  offload.expert_offload = true;
  EXPECT_TRUE(on(offload, room, cuda).first) << "auto: an offloaded run with room for the pool replays graphs";
  EXPECT_FALSE(on(offload, tight, cuda).first) << "auto: an offloaded run short of memory keeps it";
  offload.cuda_graphs = "true";
  EXPECT_TRUE(on(offload, tight, cuda).first) << "true is the user's choice, even when the plan is tight";

  TrainConfig never = cfg;
  never.cuda_graphs = "false";
  EXPECT_FALSE(on(never, room, cuda).first);
  TrainConfig dropout = offload;  // cuda_graphs: true
  dropout.lora_dropout = 0.05;
  EXPECT_FALSE(on(dropout, room, cuda).first) << "per-use dropout seeds are host state a replay does not see";
  TrainConfig no_ckpt = offload;
  no_ckpt.gradient_checkpointing = false;
  EXPECT_FALSE(on(no_ckpt, room, cuda).first);

  // The model's facts: expert GEMMs that read the routing counts on the host turn them off, even
  // when asked for; merge-aware training rules them out before any memory is planned for them.
  eo::GraphFacts host_counts = room;
  host_counts.counts_on_host = "lora_r 12 is not a multiple of 8";
  const auto [counts_on, counts_why] = on(offload, host_counts, cuda);
  EXPECT_FALSE(counts_on);
  EXPECT_NE(counts_why.find("lora_r 12"), std::string::npos) << counts_why;
  TrainConfig merge = cfg;
  merge.nvfp4_merge_aware = true;
  const RunSpec merge_spec = resolve_run_spec(merge, eo::model::ModelConfig{}, eo::Compute::Bf16, true, 1);
  EXPECT_NE(merge_spec.graphs_blocked.find("nvfp4_merge_aware"), std::string::npos) << "the plan budgets no graphs for it";
  EXPECT_FALSE(on(merge, room, cuda).first);
}

// expert_gemm is decided into the spec once the device is known, never into the process-wide
// kernel (load_model sets that from the spec): on the CPU, libtorch's per-expert path; portable,
// which needs a GPU, is a usage error naming the key.
TEST(Config, ExpertGemmIsDecidedIntoTheSpec) {
  TrainConfig cfg = load(kValid);
  RunSpec spec = resolve_run_spec(cfg, eo::model::ModelConfig{}, eo::Compute::Fp32, false, 1);
  spec.expert_gemm_kernel = eo::model::ExpertGemm::kPortable;
  spec.expert_gemm_grouped = true;
  const eo::model::ExpertGemm before = eo::model::expert_gemm();
  eo::model::set_expert_gemm(eo::model::ExpertGemm::kPortable);
  eo::decide_expert_gemm(spec, at::kCPU);
  EXPECT_EQ(spec.expert_gemm_kernel, eo::model::ExpertGemm::kTorch);
  EXPECT_FALSE(spec.expert_gemm_grouped);
  EXPECT_EQ(spec.expert_gemm_why, "libtorch's (a CPU run)");
  EXPECT_EQ(eo::model::expert_gemm(), eo::model::ExpertGemm::kPortable) << "the decision lands in the spec only";
  eo::model::set_expert_gemm(before);

  cfg.expert_gemm = "portable";
  RunSpec portable = resolve_run_spec(cfg, eo::model::ModelConfig{}, eo::Compute::Fp32, false, 1);
  try {
    eo::decide_expert_gemm(portable, at::kCPU);
    ADD_FAILURE() << "expert_gemm: portable on the CPU was accepted";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("expert_gemm: portable runs on a CUDA GPU"), std::string::npos) << e.what();
  }
}

// Ranks compare their resolved configs key by key: equal configs agree; one --set on one rank is
// named with both values; base_model's path is not compared (its contents are, by identity).
TEST(RankAgreement, NamesEveryKeyThatDiffersWithEachRanksValue) {
  const auto a = run_identity(load(kValid));
  EXPECT_TRUE(rank_disagreements({a, a, a}).empty());
  EXPECT_EQ(a.count("base_model"), 0u);
  EXPECT_EQ(a.count("base model contents"), 1u);
  ASSERT_EQ(a.count("lora_r"), 1u);
  const auto b = run_identity(load(kValid, {"lora_r=4", "seed=9"}));
  const auto c = run_identity(load(kValid, {"datasets.0.path=other.jsonl"}));
  const auto d = rank_disagreements({a, b, a, c});
  ASSERT_EQ(d.size(), 3u);
  EXPECT_EQ(d[0], "datasets.0 contents: rank 0 has train.jsonl (no local file), rank 3 has other.jsonl (no local file)");
  EXPECT_EQ(d[1], "lora_r: rank 0 has 16, rank 1 has 4");
  EXPECT_EQ(d[2], "seed: rank 0 has 42, rank 1 has 9");
}

// Issue #49 item 3: ranks compare what their dataset paths hold, not the paths: one path with
// other rows on one node is named; the same rows under another path agree.
TEST(RankAgreement, ComparesDatasetContentsNotPaths) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("eo_rank_data_" + std::to_string(::getpid()));
  fs::create_directories(dir / "a");
  fs::create_directories(dir / "b");
  std::ofstream(dir / "a" / "train.jsonl") << "{\"input_ids\": [1, 2, 3]}\n";
  std::ofstream(dir / "b" / "train.jsonl") << "{\"input_ids\": [1, 2, 4]}\n";
  std::ofstream(dir / "b" / "copy.jsonl") << "{\"input_ids\": [1, 2, 3]}\n";
  const auto with = [&](const fs::path& p) { return run_identity(load(kValid, {"datasets.0.path=" + p.string()})); };
  const auto a = with(dir / "a" / "train.jsonl");
  EXPECT_TRUE(rank_disagreements({a, with(dir / "b" / "copy.jsonl")}).empty()) << "same rows, another path";
  const auto d = rank_disagreements({a, with(dir / "b" / "train.jsonl")});
  ASSERT_EQ(d.size(), 1u) << "other rows behind a path were not noticed";
  EXPECT_EQ(d[0].rfind("datasets.0 contents: rank 0 has ", 0), 0u) << d[0];
  fs::remove_all(dir);
}

// Issue #32 item 14: a repeated key, a second YAML document, a huge bad value, a folder given as
// --config or as a dataset path: each a clear error.
TEST(Config, DuplicateKeysSecondDocumentsHugeValuesAndFoldersAreErrors) {
  std::string m = error_of(std::string(kValid) + "lora_r: 8\n");
  EXPECT_NE(m.find("lora_r: appears more than once"), std::string::npos) << m;
  m = error_of(std::string(kValid) + "gradient_checkpointing_kwargs:\n  use_reentrant: false\n  use_reentrant: true\n");
  EXPECT_NE(m.find("gradient_checkpointing_kwargs.use_reentrant: appears more than once"), std::string::npos) << m;
  m = error_of(std::string(kValid) + "---\nlora_r: 4\n");
  EXPECT_NE(m.find("holds more than one YAML document"), std::string::npos) << m;
  // A trailing separator alone is one document.
  EXPECT_NO_THROW(load(std::string(kValid) + "---\n"));
  // Inputs on which yaml-cpp 0.7's LoadAll never returns, and an alias that contains itself:
  // each ends (any error is fine; the fuzz regressions hold the same inputs).
  for (const char* text : {",", ", =a[ b]\n: 0\n", "a: &a {x: 1}\nb: &b {p: *b, q: *b}\n"}) {
    try {
      load(text);
    } catch (const UsageError&) {
    }
  }
  m = error_of(std::string(kValid) + "learning_rate: \"" + std::string(10 << 20, 'x') + "\"\n");
  EXPECT_NE(m.find("learning_rate"), std::string::npos) << m.substr(0, 300);
  EXPECT_LT(m.size(), 4000u) << "a 10 MB value was echoed whole";

  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("eo_cfg_dirs_" + std::to_string(::getpid()));
  fs::create_directories(dir / "data.jsonl");
  try {
    load_config_file(dir.string(), {});
    ADD_FAILURE() << "a folder was read as a config";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("is a folder"), std::string::npos) << e.what();
  }
  const std::string yaml = "base_model: " + dir.string() + "\nadapter: lora\ndatasets: [{path: " + (dir / "data.jsonl").string() + "}]\n";
  try {
    load_config_text(yaml, "t.yaml", {});
    ADD_FAILURE() << "accepted";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("datasets.0.path: '" + (dir / "data.jsonl").string() + "' is a folder"), std::string::npos)
        << e.what();
  }
  // A FIFO as a dataset (reading it would block, or read whatever a writer sends): not "not found".
  const fs::path fifo = dir / "pipe.jsonl";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  try {
    load_config_text(yaml.substr(0, yaml.find("datasets:")) + "datasets: [{path: " + fifo.string() + "}]\n", "t.yaml", {});
    ADD_FAILURE() << "a FIFO was accepted as a dataset";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("datasets.0.path: '" + fifo.string() + "' is not a regular file (a FIFO"), std::string::npos)
        << e.what();
    EXPECT_EQ(std::string(e.what()).find("not found"), std::string::npos) << e.what();
  }
  eo::remove_tree(dir);
}

// Targets are checked against base_model's config.json also without the file checks, as
// `eo-ddp plan` loads a config: gate_proj on Mixtral (w1/w2/w3) is refused as training refuses it.
TEST(Config, TargetsAreCheckedWhenOnlyConfigJsonIsRead) {
  const std::string yaml = "base_model: " + std::string(EO_SOURCE_DIR) + "/configs/models/mixtral-8x7b\nadapter: lora\n"
                           "lora_target_modules: [gate_proj]\ndatasets: [{path: missing.jsonl}]\n";
  try {
    ConfigLoadOptions plan_options = no_files();
    plan_options.check_architecture = true;  // as `eo-ddp plan` loads it
    load_config_text(yaml, "t.yaml", {}, plan_options);
    ADD_FAILURE() << "gate_proj on Mixtral was accepted";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("'gate_proj' matches no linear of mixtral"), std::string::npos) << e.what();
  }
}

// Issue #49 item 8: the config and every model file must be a regular file of bounded size, and
// opening one never blocks: a FIFO, /dev/zero or a huge file is refused at once, naming it.
TEST(InputFiles, AFifoADeviceOrAHugeFileIsRefusedWithoutBlocking) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("eo_input_files_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string fifo = (dir / "config.yaml").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  auto refusal = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const UsageError& e) {
      return std::string(e.what());
    }
    return std::string("(no UsageError)");
  };
  std::string m = refusal([&] { eo::load_config_file(fifo, {}, {}); });
  EXPECT_NE(m.find("--config " + fifo + " is a FIFO"), std::string::npos) << m;
  m = refusal([&] { eo::load_config_file("/dev/zero", {}, {}); });
  EXPECT_NE(m.find("/dev/zero is a character device"), std::string::npos) << m;
  const fs::path huge = dir / "huge.yaml";
  { std::ofstream(huge) << "lora_r: 8\n"; }
  fs::resize_file(huge, eo::kMaxTextFileBytes + 1);  // sparse
  m = refusal([&] { eo::load_config_file(huge.string(), {}, {}); });
  EXPECT_NE(m.find("more than the 64 MiB"), std::string::npos) << m;
  // A model folder whose config.json and weights are FIFOs.
  fs::create_directories(dir / "model");
  ASSERT_EQ(::mkfifo((dir / "model" / "config.json").c_str(), 0600), 0);
  ASSERT_EQ(::mkfifo((dir / "model" / "model.safetensors").c_str(), 0600), 0);
  m = refusal([&] { eo::model::read_config_json((dir / "model").string()); });
  EXPECT_NE(m.find("config.json " + (dir / "model" / "config.json").string() + " is a FIFO"), std::string::npos) << m;
  m = refusal([&] { eo::st::File::open((dir / "model" / "model.safetensors").string()); });
  EXPECT_NE(m.find("is a FIFO"), std::string::npos) << m;
  fs::remove_all(dir);
}

// Issue #49 item 10: config.json and hf_quant_config.json that disagree on the format are refused,
// naming both (one of them used to be ignored without a word).
TEST(InputFiles, QuantConfigsThatDisagreeAreRefused) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("eo_quant_cfgs_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  std::ofstream(dir / "config.json")
      << R"({"model_type": "qwen3_moe", "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}})";
  std::ofstream(dir / "hf_quant_config.json") << R"({"quantization": {"quant_algo": "FP8"}})";
  std::string m;
  try {
    eo::model::read_config_json(dir.string());
  } catch (const UsageError& e) {
    m = e.what();
  }
  EXPECT_NE(m.find("quant_algo 'NVFP4'"), std::string::npos) << m;
  EXPECT_NE(m.find("hf_quant_config.json says 'FP8'"), std::string::npos) << m;
  std::ofstream(dir / "hf_quant_config.json", std::ios::trunc) << R"({"quantization": {"quant_algo": "NVFP4"}})";
  EXPECT_NO_THROW(eo::model::read_config_json(dir.string()));
  fs::remove_all(dir);
}

// tools/prepare_data.py keeps no default of its own for a dataset key: it reads them from the spec,
// where eo-ddp writes the table's (dataset_key_defaults). Every key the tool reads is a row of the
// table or one of the entry keys eo-ddp itself adds; a literal default beside a key read fails here.
TEST(Config, PrepareToolReadsTheDatasetKeysTable) {
  const nlohmann::json defaults = eo::dataset_key_defaults();
  EXPECT_EQ(defaults.at("field_messages"), "messages");
  EXPECT_EQ(defaults.at("roles_to_train"), nlohmann::json::array({"assistant"}));
  EXPECT_EQ(defaults.at("train_on_eos"), "turn");
  EXPECT_EQ(defaults.at("shards_idx"), 0);
  EXPECT_EQ(defaults.at("drop_system_message"), false);
  EXPECT_FALSE(defaults.contains("path")) << "(required) is no value";
  EXPECT_FALSE(defaults.contains("train_on_eot")) << "(train_on_eos) names another key";

  std::set<std::string> table;
  for (const auto& d : dataset_key_docs()) table.insert(d.key.substr(std::string("datasets[].").size()));
  const std::set<std::string> added_by_eo_ddp = {"files", "output", "seed"};
  std::ifstream in(std::string(EO_SOURCE_DIR) + "/tools/prepare_data.py");
  ASSERT_TRUE(in) << "tools/prepare_data.py";
  const std::string tool((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::regex read_key(R"((?:ds\.get\(|ds\[|setting\(spec, ds, )\"(\w+)\")");
  std::set<std::string> read;
  for (std::sregex_iterator it(tool.begin(), tool.end(), read_key), end; it != end; ++it) read.insert((*it)[1]);
  EXPECT_GT(read.size(), 10u) << "the pattern finds the tool's key reads";
  for (const auto& k : read) EXPECT_TRUE(table.count(k) || added_by_eo_ddp.count(k)) << k << " is read by the tool but not in the table";
  const std::regex own_default(R"(ds\.get\(\"\w+\"(?:,[^)]*\)|\)\s*or\s*[\"'\[0-9]))");
  for (std::sregex_iterator it(tool.begin(), tool.end(), own_default), end; it != end; ++it)
    ADD_FAILURE() << "tools/prepare_data.py keeps its own default: " << it->str() << " (read it with setting())";
  const std::regex with_default(R"(setting\(spec, ds, \"(\w+)\"\))");
  for (std::sregex_iterator it(tool.begin(), tool.end(), with_default), end; it != end; ++it)
    EXPECT_TRUE(defaults.contains((*it)[1].str())) << (*it)[1] << " is read with a default, but the table gives none";
}
