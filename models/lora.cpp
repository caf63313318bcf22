#include "models/lora.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/error.h"

namespace eo::model {

double LoraSpec::scaling() const { return use_rslora ? alpha / std::sqrt(static_cast<double>(r)) : alpha / r; }

bool LoraSpec::targets_module(const std::string& short_name) const {
  for (const auto& t : targets)
    if (t == short_name) return true;
  return false;
}

LoraAdapter::LoraAdapter(std::int64_t in, std::int64_t out, const LoraSpec& spec, std::uint64_t gen_seed,
                         const at::Device& device)
    : scaling_(spec.scaling()), dropout_(spec.dropout) {
  // kaiming_uniform_(a=√5): gain = √(2/(1+5)), bound = gain·√(3/fan_in) = 1/√fan_in.
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(gen_seed);
  const double bound = 1.0 / std::sqrt(static_cast<double>(in));
  a_ = at::empty({spec.r, in}, at::kFloat).uniform_(-bound, bound, gen).to(device).set_requires_grad(true);
  b_ = at::zeros({out, spec.r}, at::TensorOptions().dtype(at::kFloat).device(device)).set_requires_grad(true);
}

at::Tensor LoraAdapter::delta(const at::Tensor& x, bool training) const {
  const at::Tensor h = (training && dropout_ > 0) ? at::dropout(x, dropout_, true) : x;
  const at::Tensor down = at::linear(h, a_.to(x.scalar_type()));
  return at::linear(down, b_.to(x.scalar_type())) * scaling_;
}

LoraSpec read_adapter_config(const std::string& adapter_dir) {
  const std::string path = adapter_dir + "/adapter_config.json";
  std::ifstream in(path);
  if (!in) throw UsageError(path + ": cannot open (is --adapter a peft adapter folder?)");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw UsageError(path + ": invalid JSON: " + e.what());
  }
  if (!j.is_object() || !j.contains("peft_type") || j["peft_type"] != "LORA")
    throw UsageError(path + ": 'peft_type' must be \"LORA\"");
  LoraSpec s;
  auto num = [&](const char* key, double fallback) {
    if (!j.contains(key) || j[key].is_null()) return fallback;
    if (!j[key].is_number()) throw UsageError(path + ": '" + key + "' must be a number");
    return j[key].get<double>();
  };
  s.r = static_cast<int>(num("r", 8));
  s.alpha = num("lora_alpha", 8);
  s.dropout = num("lora_dropout", 0.0);
  if (s.r <= 0) throw UsageError(path + ": 'r' must be positive");
  if (j.contains("use_rslora") && j["use_rslora"].is_boolean()) s.use_rslora = j["use_rslora"].get<bool>();
  if (j.contains("bias") && j["bias"].is_string() && j["bias"] != "none")
    throw UsageError(path + ": bias '" + j["bias"].get<std::string>() + "' is not supported (only \"none\")");
  if (j.contains("fan_in_fan_out") && j["fan_in_fan_out"] == true)
    throw UsageError(path + ": fan_in_fan_out adapters are not supported");
  if (j.contains("rank_pattern") && j["rank_pattern"].is_object() && !j["rank_pattern"].empty())
    throw UsageError(path + ": rank_pattern is not supported (one r for every module)");
  if (j.contains("alpha_pattern") && j["alpha_pattern"].is_object() && !j["alpha_pattern"].empty())
    throw UsageError(path + ": alpha_pattern is not supported (one lora_alpha for every module)");
  const auto& t = j.value("target_modules", nlohmann::json());
  if (!t.is_array()) throw UsageError(path + ": 'target_modules' must be a list of module names");
  for (const auto& x : t) {
    if (!x.is_string()) throw UsageError(path + ": 'target_modules' must be a list of module names");
    s.targets.push_back(x.get<std::string>());
  }
  if (s.targets.empty()) throw UsageError(path + ": 'target_modules' is empty");
  return s;
}

void write_adapter_config(const std::string& adapter_dir, const LoraSpec& spec, const std::string& base_model) {
  nlohmann::json j = {{"peft_type", "LORA"},        {"task_type", "CAUSAL_LM"},  {"r", spec.r},
                      {"lora_alpha", spec.alpha},   {"lora_dropout", spec.dropout}, {"target_modules", spec.targets},
                      {"bias", "none"},             {"use_rslora", spec.use_rslora}, {"fan_in_fan_out", false},
                      {"base_model_name_or_path", base_model}, {"inference_mode", true}};
  const std::string path = adapter_dir + "/adapter_config.json";
  std::ofstream out(path);
  EO_CHECK(out, path, ": cannot write");
  out << j.dump(2) << "\n";
  EO_CHECK(out.good(), path, ": write failed");
}

}  // namespace eo::model
