#include "runtime/resume_check.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>

#include "common/checksum.h"
#include "common/error.h"
#include "common/files.h"
#include "runtime/config.h"
#include "runtime/model_identity.h"

namespace eo {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {


// The sampled fingerprint that checkpoints of earlier eo-ddp recorded (base_model_fingerprint):
// config.json, then for every *.safetensors file its name, size and 16 windows of 4 KiB. Only
// computed to resume such a checkpoint; base_model_identity replaced it.
std::string legacy_sampled_fingerprint(const TrainConfig& cfg) {
  Fnv1a64 f;
  std::string text;
  if (read_model_file((fs::path(cfg.base_model) / "config.json").string(), text)) f.add(text);
  if (cfg.synthetic_weights) {
    f.add("synthetic seed " + std::to_string(cfg.seed));
  } else {
    std::vector<fs::path> files;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(cfg.base_model, ec))
      if (e.path().extension() == ".safetensors") files.push_back(e.path());
    std::sort(files.begin(), files.end());
    std::vector<char> buf(4096);
    for (const auto& p : files) {
      const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) continue;
      struct stat st {};
      ::fstat(fd, &st);
      f.add(p.filename().string());
      f.add(&st.st_size, sizeof st.st_size);
      for (int w = 0; w < 16; ++w) {
        const off_t off = st.st_size <= off_t(buf.size()) ? 0 : off_t((st.st_size - off_t(buf.size())) / 15 * w);
        const ssize_t n = ::pread(fd, buf.data(), buf.size(), off);
        if (n > 0) f.add(buf.data(), static_cast<std::size_t>(n));
      }
      ::close(fd);
    }
  }
  char out[17];
  std::snprintf(out, sizeof out, "%016llx", static_cast<unsigned long long>(f.h));
  return out;
}

std::string show(const json& v) { return v.is_string() ? v.get<std::string>() : v.is_null() ? "(not set)" : v.dump(); }

template <class T>
json opt(const std::optional<T>& v) {
  return v ? json(*v) : json();
}

}  // namespace

json recorded_config(const TrainConfig& cfg) {
  json datasets = json::array(), contents = json::array();
  for (const auto& d : cfg.datasets) {
    datasets.push_back(d.path);
    struct stat st {};
    contents.push_back(::stat(d.path.c_str(), &st) == 0 && S_ISREG(st.st_mode) ? json(file_content_hash(d.path)) : json());
  }
  return {{"base_model", cfg.base_model},
          {"base_model_identity", base_model_identity(cfg)},
          {"adapter", cfg.adapter},
          {"lora_r", cfg.lora_r},
          {"lora_alpha", cfg.lora_alpha},
          {"peft_use_rslora", cfg.peft_use_rslora},
          {"lora_target_modules", cfg.lora_target_modules},
          {"lora_target_parameters", cfg.lora_target_parameters},
          {"peft_layers_to_transform", cfg.peft_layers_to_transform},
          {"lora_dropout", cfg.lora_dropout},
          {"load_in_4bit", cfg.load_in_4bit},
          {"bnb_4bit_blocksize", cfg.bnb_4bit_blocksize},
          {"bnb_4bit_use_double_quant", cfg.bnb_4bit_use_double_quant},
          {"expert_quant", cfg.expert_quant},
          {"sequence_len", cfg.sequence_len},
          {"sample_packing", cfg.sample_packing},
          {"datasets", datasets},
          {"dataset_contents", contents},
          {"micro_batch_size", cfg.micro_batch_size},
          {"gradient_accumulation_steps", cfg.gradient_accumulation_steps},
          {"learning_rate", cfg.learning_rate},
          {"lr_scheduler", cfg.lr_scheduler},
          {"weight_decay", cfg.weight_decay},
          {"seed", cfg.seed},
          // The rest of the run's shape and numerics: a change is allowed and warned about.
          {"num_epochs", cfg.num_epochs},
          {"max_steps", opt(cfg.max_steps)},
          {"warmup_steps", cfg.warmup_steps},
          {"warmup_ratio", opt(cfg.warmup_ratio)},
          {"max_grad_norm", cfg.max_grad_norm},
          {"adam_beta1", cfg.adam_beta1},
          {"adam_beta2", cfg.adam_beta2},
          {"adam_epsilon", cfg.adam_epsilon},
          {"output_router_logits", cfg.output_router_logits},
          {"router_aux_loss_coef", opt(cfg.router_aux_loss_coef)},
          {"bf16", cfg.bf16},
          {"fp16", opt(cfg.fp16)}};
}

std::vector<std::string> check_resume_compatible(const TrainingState& s, const TrainConfig& cfg, int world_size) {
  std::vector<std::string> warnings;
  // The data cursor counts sequences, so another world size resumes at the same row with another
  // global batch (and another number of steps per epoch).
  if (world_size > 0 && s.world_size != world_size)
    warnings.push_back("the world size changed since the checkpoint (" + std::to_string(s.world_size) + " -> " +
                       std::to_string(world_size) + " ranks): the global batch is now " +
                       std::to_string(world_size * cfg.micro_batch_size * cfg.gradient_accumulation_steps) +
                       " sequences a step, so this is not the run the checkpoint continued exactly; resuming");
  if (!s.recorded.is_object())
    return {"the checkpoint records no config (written by an older eo-ddp): cannot check that base_model, lora_r, "
            "lora_alpha, target modules and sequence_len match it"};
  const json now = recorded_config(cfg);
  // Keys whose change makes the saved adapter or the data cursor mean something else.
  static const char* kRefuse[] = {"adapter",        "lora_r",          "lora_alpha",         "peft_use_rslora",
                                  "lora_target_modules", "lora_target_parameters", "peft_layers_to_transform",
                                  "load_in_4bit", "bnb_4bit_blocksize",
                                  "bnb_4bit_use_double_quant", "expert_quant", "sequence_len",   "sample_packing"};
  std::vector<std::string> problems;
  auto differs = [&](const char* key) { return s.recorded.contains(key) && s.recorded[key] != now[key]; };
  // Checkpoints of earlier eo-ddp recorded a sampled fingerprint instead of the full identity.
  const bool legacy = !s.recorded.contains("base_model_identity") && s.recorded.contains("base_model_fingerprint");
  const std::string id_key = legacy ? "base_model_fingerprint" : "base_model_identity";
  const json id_now = legacy ? json(legacy_sampled_fingerprint(cfg)) : now["base_model_identity"];
  if (s.recorded.contains(id_key) && s.recorded[id_key] != id_now) {
    problems.push_back("base_model: the checkpoint was trained on " + show(s.recorded.value("base_model", json("?"))) +
                       " (contents " + show(s.recorded[id_key]) + "), this config's " + cfg.base_model +
                       " has other contents (" + show(id_now) + ")");
  } else if (differs("base_model")) {
    warnings.push_back("base_model moved from " + show(s.recorded["base_model"]) + " to " + cfg.base_model +
                       " (same contents); resuming");
  }
  for (const char* key : kRefuse)
    if (differs(key))
      problems.push_back(std::string(key) + ": the checkpoint has " + show(s.recorded[key]) + ", this config " + show(now[key]));
  if (!problems.empty()) {
    std::string msg = "cannot resume from checkpoint at step " + std::to_string(s.step) + ": the config differs from the one "
                      "it was trained with in " + std::to_string(problems.size()) + (problems.size() == 1 ? " key" : " keys") + ":";
    for (const auto& p : problems) msg += "\n  - " + p;
    msg += "\nSet those keys back to the checkpoint's values, or start a fresh run (another output_dir, without "
           "resume_from_checkpoint).";
    throw UsageError(msg);
  }
  if (differs("dataset_contents") && !differs("datasets"))
    warnings.push_back("a dataset was edited since the checkpoint (its contents differ; datasets: " + show(now["datasets"]) +
                       "): the data cursor continues at the same rows of the new data, so this is not the run the "
                       "checkpoint continued exactly");
  for (auto it = now.begin(); it != now.end(); ++it) {
    const std::string& key = it.key();
    if (key == "base_model" || key == "base_model_identity" || key == "dataset_contents" || !s.recorded.contains(key)) continue;
    if (std::find(std::begin(kRefuse), std::end(kRefuse), key) != std::end(kRefuse)) continue;
    if (s.recorded[key] != it.value())
      warnings.push_back(key + " changed since the checkpoint (" + show(s.recorded[key]) + " -> " + show(it.value()) +
                         "); resuming with the new value");
  }
  return warnings;
}


}  // namespace eo
