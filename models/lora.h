// LoRA adapters as peft defines them (design.md §3.4).
//
// y = base(x) + B(A(dropout(x))) · scaling, scaling = alpha / r (rsLoRA: alpha / √r).
// A [r, in] ~ kaiming_uniform(a=√5) = U(±1/√in), B [out, r] = 0 (peft's init, from a seeded
// generator). A and B are fp32 master parameters; the delta is computed in the input's dtype.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace eo::model {

struct LoraSpec {
  int r = 8;
  double alpha = 16;
  double dropout = 0.0;
  bool use_rslora = false;
  std::vector<std::string> targets;  // module short names: q_proj, gate_proj, w1, ...
  std::uint64_t seed = 0;

  double scaling() const;
  bool targets_module(const std::string& short_name) const;
};

class LoraAdapter {
 public:
  // Creates A (initialised from `gen_seed`, a per-module seed) and B = 0 on `device`.
  LoraAdapter(std::int64_t in, std::int64_t out, const LoraSpec& spec, std::uint64_t gen_seed, const at::Device& device);
  // The low-rank delta B(A(dropout(x))) · scaling in x's dtype. Dropout only when `training`.
  at::Tensor delta(const at::Tensor& x, bool training) const;

  at::Tensor& A() { return a_; }
  at::Tensor& B() { return b_; }
  const at::Tensor& A() const { return a_; }
  const at::Tensor& B() const { return b_; }

 private:
  at::Tensor a_, b_;
  double scaling_;
  double dropout_;
};

// peft's adapter_config.json, the subset we read and write.
LoraSpec read_adapter_config(const std::string& adapter_dir);
void write_adapter_config(const std::string& adapter_dir, const LoraSpec& spec, const std::string& base_model);

}  // namespace eo::model
