#include "runtime/key_aliases.h"

#include <algorithm>
#include <cctype>

namespace eo {

const std::vector<KeyAlias>& key_aliases() {
  static const char* kTrainer = "transformers' TrainingArguments";
  static const char* kTrl = "TRL's SFTConfig and Unsloth";
  static const char* kPeft = "peft's LoraConfig";
  static const char* kCommon = "a common spelling";
  static const std::vector<KeyAlias> table = {
      {"max_seq_length", "sequence_len", kTrl},
      {"max_seq_len", "sequence_len", kCommon},
      {"max_length", "sequence_len", kTrl},
      {"seq_len", "sequence_len", kCommon},
      {"sequence_length", "sequence_len", kCommon},
      {"packing", "sample_packing", kTrl},
      {"epochs", "num_epochs", kCommon},
      {"num_train_epochs", "num_epochs", kTrainer},
      {"lr", "learning_rate", kCommon},
      {"lr_scheduler_type", "lr_scheduler", kTrainer},
      {"optim", "optimizer", kTrainer},
      {"adam_eps", "adam_epsilon", kCommon},
      {"per_device_train_batch_size", "micro_batch_size", kTrainer},
      {"train_micro_batch_size_per_gpu", "micro_batch_size", "DeepSpeed"},
      {"per_device_eval_batch_size", "eval_batch_size", kTrainer},
      {"gradient_accumulation", "gradient_accumulation_steps", kCommon},
      {"grad_accum", "gradient_accumulation_steps", kCommon},
      {"use_gradient_checkpointing", "gradient_checkpointing", "Unsloth's get_peft_model"},
      {"random_state", "seed", "Unsloth's get_peft_model"},
      {"lora_rank", "lora_r", kCommon},
      {"r", "lora_r", kPeft},
      {"rank", "lora_r", kCommon},
      {"target_modules", "lora_target_modules", kPeft},
      {"target_parameters", "lora_target_parameters", kPeft},
      {"layers_to_transform", "peft_layers_to_transform", kPeft},
      {"use_rslora", "peft_use_rslora", kPeft},
      {"model_name", "base_model", "Unsloth's FastLanguageModel"},
      {"model_name_or_path", "base_model", kTrainer},
      {"model_id", "base_model", kCommon},
      {"dataset", "datasets", kCommon},
      {"train_file", "datasets", kTrainer},
  };
  return table;
}

std::optional<KeyAlias> key_alias(const std::string& foreign) {
  const auto& t = key_aliases();
  for (const auto& a : t)
    if (foreign == a.foreign) return a;
  auto lower = [](std::string s) {
    std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
    return s;
  };
  const std::string l = lower(foreign);
  for (const auto& a : t)
    if (l == a.foreign) return a;
  return std::nullopt;
}

std::string spelled_here(const KeyAlias& a) {
  return std::string("'") + a.foreign + "' is spelled '" + a.key + "' here (" + a.from + ")";
}

}  // namespace eo
