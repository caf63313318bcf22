#include "models/lora.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>

#include <cmath>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <tuple>

#include "common/error.h"

namespace eo::model {

double LoraSpec::scaling() const { return use_rslora ? alpha / std::sqrt(static_cast<double>(r)) : alpha / r; }

bool LoraSpec::targets_module(const std::string& short_name) const {
  for (const auto& t : targets)
    if (t == short_name) return true;
  return false;
}

namespace {

// peft's init of A [r, in]: kaiming_uniform_(a=√5): gain = √(2/(1+5)), bound = gain·√(3/fan_in)
// = 1/√fan_in, drawn on the CPU from a per-module generator (stable across devices and ranks).
at::Tensor peft_init_a(std::int64_t r, std::int64_t in, std::uint64_t gen_seed) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(gen_seed);
  const double bound = 1.0 / std::sqrt(static_cast<double>(in));
  return at::empty({r, in}, at::kFloat).uniform_(-bound, bound, gen);
}

// y + B(A(dropout(x))) · scaling in x's dtype, the one formula of both adapter forms: the
// scale and the sum ride in the second GEMM (addmm's alpha and beta), one rounding and no
// elementwise pass over [tokens, out] in forward or backward.
at::Tensor lora_add(const at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, double scaling,
                    double dropout, bool training) {
  const at::Tensor h = (training && dropout > 0) ? at::dropout(x, dropout, true) : x;
  const auto dt = x.scalar_type();
  const at::Tensor down = at::linear(h, a.to(dt));  // [..., r]
  const auto out = y.size(-1), r = a.size(0);
  return at::addmm(y.reshape({-1, out}), down.reshape({-1, r}), b.to(dt).t(), 1, scaling).view(y.sizes());
}

}  // namespace

LoraAdapter::LoraAdapter(std::int64_t in, std::int64_t out, const LoraSpec& spec, std::uint64_t gen_seed,
                         const at::Device& device)
    : scaling_(spec.scaling()), dropout_(spec.dropout) {
  a_ = peft_init_a(spec.r, in, gen_seed).to(device).set_requires_grad(true);
  b_ = at::zeros({out, spec.r}, at::TensorOptions().dtype(at::kFloat).device(device)).set_requires_grad(true);
}

at::Tensor LoraAdapter::add_to(const at::Tensor& y, const at::Tensor& x, bool training) const {
  return lora_add(y, x, a_, b_, scaling_, dropout_, training);
}

ExpertLora::ExpertLora(int experts, std::int64_t in, std::int64_t out, const LoraSpec& spec, const at::Device& device)
    : scaling_(spec.scaling()), dropout_(spec.dropout) {
  const auto opts = at::TensorOptions().dtype(at::kFloat).device(device);
  a_ = at::zeros({experts, spec.r, in}, opts).set_requires_grad(true);
  b_ = at::zeros({experts, out, spec.r}, opts).set_requires_grad(true);
}

void ExpertLora::init_expert(int e, std::uint64_t gen_seed) {
  at::NoGradGuard ng;
  a_.select(0, e).copy_(peft_init_a(a_.size(1), a_.size(2), gen_seed));
}

ExpertLora::Slices ExpertLora::slices() const { return {a_.unbind(0), b_.unbind(0)}; }

at::Tensor ExpertLora::add_to(const Slices& s, int e, const at::Tensor& y, const at::Tensor& x, bool training) const {
  return lora_add(y, x, s.a.at(e), s.b.at(e), scaling_, dropout_, training);
}

at::Tensor ExpertLora::grouped_delta(const at::Tensor& x_sorted, const at::Tensor& offsets, bool training) const {
  EO_CHECK(grouped_ok(), "grouped expert LoRA needs r divisible by 8, got r=", a_.size(1));
  const at::Tensor x = x_sorted.contiguous();
  // Dropout on the whole sorted input: each row still gets its own mask, as peft's per-module
  // dropout gives it (gate and up draw independent masks, as their two peft modules do).
  const at::Tensor h = (training && dropout_ > 0) ? at::dropout(x, dropout_, true) : x;
  const auto dt = x.scalar_type();
  // The fp32 masters are cast once per forward (autograd casts the gradients back to fp32);
  // libtorch's own _grouped_mm backward gives dX (2-D x 3-D) and dA, dB (2-D x 2-D over the
  // same offsets), so no count reaches the host.
  const at::Tensor down = at::_grouped_mm(h, a_.to(dt).transpose(1, 2), offsets);  // [N, r]
  return at::_grouped_mm(down, b_.to(dt).transpose(1, 2), offsets) * scaling_;
}

std::string stacked_lora_name(const std::string& experts_prefix, const std::string& matrix, char ab) {
  return experts_prefix + "." + matrix + ".lora_" + ab + ".stacked";
}

namespace {

// Names are taken apart at their last dots (no regex: these run once per save or load).
// "<head>.experts.<a>.<b>...<last>" split at its last `n` dots: {head + ".experts", parts}.
bool split_tail(const std::string& name, std::size_t n, std::string& head, std::vector<std::string>& parts) {
  parts.assign(n, {});
  std::size_t end = name.size();
  for (std::size_t k = n; k-- > 0;) {
    if (end == 0) return false;
    const std::size_t dot = name.rfind('.', end - 1);
    if (dot == std::string::npos || dot + 1 >= end) return false;
    parts[k] = name.substr(dot + 1, end - dot - 1);
    end = dot;
  }
  head = name.substr(0, end);
  static const std::string kExperts = ".experts";
  return head.size() > kExperts.size() && head.compare(head.size() - kExperts.size(), kExperts.size(), kExperts) == 0;
}

bool is_lora_factor(const std::string& s) { return s == "lora_A" || s == "lora_B"; }

// "<head>.experts.<matrix>.lora_A.stacked" → {head.experts, "<matrix>.lora_A"}.
std::optional<std::pair<std::string, std::string>> parse_stacked(const std::string& name) {
  std::string head;
  std::vector<std::string> p;
  if (!split_tail(name, 3, head, p) || p[2] != "stacked" || !is_lora_factor(p[1])) return std::nullopt;
  return std::make_pair(head, p[0] + "." + p[1]);
}

// "<head>.experts.<e>.<matrix>.lora_A.weight" → {head.experts, e, "<matrix>.lora_A"}.
std::optional<std::tuple<std::string, long, std::string>> parse_peft_expert(const std::string& name) {
  std::string head;
  std::vector<std::string> p;
  if (!split_tail(name, 4, head, p) || p[3] != "weight" || !is_lora_factor(p[2])) return std::nullopt;
  if (p[0].empty() || p[0].size() > 9 || p[0].find_first_not_of("0123456789") != std::string::npos) return std::nullopt;
  return std::make_tuple(head, std::stol(p[0]), p[1] + "." + p[2]);
}

}  // namespace

NamedLora peft_lora_tensors(const NamedLora& params) {
  NamedLora out;
  for (std::size_t i = 0; i < params.size();) {
    const auto first = parse_stacked(params[i].first);
    if (!first) {
      out.push_back(params[i++]);
      continue;
    }
    // The run of stacked tensors of one block's experts (gate A, gate B, up A, ...).
    std::size_t j = i;
    std::vector<std::string> rest;
    for (; j < params.size(); ++j) {
      const auto p = parse_stacked(params[j].first);
      if (!p || p->first != first->first) break;
      EO_CHECK(params[j].second.defined(), params[j].first, ": undefined tensor");
      rest.push_back(p->second);
    }
    const std::int64_t experts = params[i].second.size(0);
    for (std::int64_t e = 0; e < experts; ++e)
      for (std::size_t k = i; k < j; ++k)
        out.emplace_back(first->first + "." + std::to_string(e) + "." + rest[k - i] + ".weight",
                         params[k].second.select(0, e));
    i = j;
  }
  return out;
}

NamedLora stack_expert_lora(const NamedLora& peft) {
  NamedLora out;
  std::map<std::string, std::map<long, at::Tensor>> groups;  // stacked name → expert → slice
  for (const auto& [name, t] : peft) {
    const auto parsed = parse_peft_expert(name);
    if (!parsed) {
      out.emplace_back(name, t);
      continue;
    }
    const auto& [head, e, rest] = *parsed;
    const std::string stacked = head + "." + rest + ".stacked";
    auto [it, fresh] = groups.try_emplace(stacked);
    if (fresh) out.emplace_back(stacked, at::Tensor());  // filled below, at its first expert's place
    it->second[e] = t;
  }
  for (auto& [name, t] : out) {
    if (t.defined()) continue;
    const auto& experts = groups.at(name);
    std::vector<at::Tensor> slices;
    for (const auto& [e, s] : experts) {
      EO_CHECK(e == static_cast<long>(slices.size()), name, ": expert ", slices.size(),
               " is missing (experts must be numbered 0..E-1)");
      slices.push_back(s);
    }
    t = at::stack(slices);
  }
  return out;
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
