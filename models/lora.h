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
#include <utility>
#include <vector>

#include "models/fused_expert_layout.h"

namespace eo::model {

struct LoraSpec {
  int r = 8;
  double alpha = 16;
  double dropout = 0.0;
  bool use_rslora = false;
  std::vector<std::string> targets;  // module short names: q_proj, gate_proj, w1, ...
  // peft's target_parameters: the fused expert parameters of transformers 5, canonical names
  // kGateUpParam / kDownParam (canonical_target_parameter). When set, the experts are adapted
  // only through them (target_modules names reach no expert, as in peft on transformers 5).
  std::vector<std::string> target_parameters;
  // peft's layers_to_transform: the decoder layers (model.layers.{i}) whose modules and fused
  // parameters are adapted; empty = every layer.
  std::vector<int> layers;
  std::uint64_t seed = 0;

  double scaling() const;
  bool targets_module(const std::string& short_name) const;
  bool targets_layer(int layer) const;
  bool targets_parameter(const std::string& canonical) const;
};

// The fused expert parameters peft's ParamWrapper adapts (transformers 5's gate_up_proj and
// down_proj; their layout per family: Family::fused_layout).
inline constexpr const char* kGateUpParam = "mlp.experts.gate_up_proj";
inline constexpr const char* kDownParam = "mlp.experts.down_proj";
// "mlp.experts.gate_up_proj", "experts.gate_up_proj", "gate_up_proj" or Llama 4's
// "feed_forward.experts.gate_up_proj" → kGateUpParam (likewise down); others: "".
std::string canonical_target_parameter(const std::string& name);

class LoraAdapter {
 public:
  // Creates A (initialised from `gen_seed`, a per-module seed) and B = 0 on `device`.
  LoraAdapter(std::int64_t in, std::int64_t out, const LoraSpec& spec, std::uint64_t gen_seed, const at::Device& device);
  // y + B(A(dropout(x))) · scaling in x's dtype, the scale and the sum in the second GEMM's
  // epilogue (addmm: one rounding, no [tokens, out] elementwise pass either way). Dropout only
  // when `training`.
  at::Tensor add_to(const at::Tensor& y, const at::Tensor& x, bool training) const;

  at::Tensor& A() { return a_; }
  at::Tensor& B() { return b_; }
  const at::Tensor& A() const { return a_; }
  const at::Tensor& B() const { return b_; }
  double scaling() const { return scaling_; }
  double dropout() const { return dropout_; }

 private:
  at::Tensor a_, b_;
  double scaling_;
  double dropout_;
};

// LoRA on one matrix (gate, up or down) of every expert of a MoE block, stacked so all experts
// run as two grouped GEMMs beside the base grouped GEMM: A [E, r, in], B [E, out, r], fp32
// master leaves. Slice e is exactly peft's per-expert adapter `experts.{e}.<matrix>` (same
// init, same math); peft_lora_tensors() gives those names back.
// On a fused parameter (lora_target_parameters) the leaves are peft's ParamWrapper factors in
// the family's `layout`: swapped, A [E, r, out] and B [E, in, r] (y += x·Bᵉ·Aᵉ); gate_up
// interleaved, B's rows alternate gate and up. The forward reads A [E, r, in] and B [E, out, r]
// (gate rows first) out of them.
class ExpertLora {
 public:
  // A and B zero; init_expert fills expert e's A as a LoraAdapter seeded `gen_seed` would.
  ExpertLora(int experts, std::int64_t in, std::int64_t out, const LoraSpec& spec, const at::Device& device,
             FusedExpertLayout layout = {});
  void init_expert(int e, std::uint64_t gen_seed);
  // peft's ParamWrapper init: its lora_A is one Linear(in, r·E) whose weight [r·E, in] is A
  // viewed as [E·r, in] (expert e = rows [e·r, (e+1)·r)), drawn as one kaiming_uniform(a=√5)
  // = U(±1/√in) tensor from a generator seeded `gen_seed` (swapped: peft's in is the output).
  void init_fused(std::uint64_t gen_seed);

  // Per-expert views for one forward (the loop path), A [r, in] and B [out, r] each. unbind is
  // one autograd node whose backward stacks the experts' gradients into one [E, ...] gradient
  // (zeros for experts without rows), instead of E full-size select gradients.
  struct Slices {
    std::vector<at::Tensor> a, b;
  };
  Slices slices() const;
  // Expert e on its rows: LoraAdapter::add_to's math with A[e], B[e].
  at::Tensor add_to(const Slices& s, int e, const at::Tensor& y, const at::Tensor& x, bool training) const;
  // Every expert's delta on token-sorted rows, scaling · (dropout(x) · A^T) · B^T: rows
  // [offsets[e-1], offsets[e]) through expert e, as two grouped GEMMs over the same int32 device
  // offsets as the base (no host sync, no loop), the scaling folded into B's cast. The caller
  // adds it where the sum is read anyway (swiglu's deltas, combine_rows' addend), so
  // no [N, out] sum is written. Needs grouped_ok().
  at::Tensor delta_grouped(const at::Tensor& x_sorted, const at::Tensor& offsets, bool training) const;
  // A fused [gate; up] adapter's delta as its two halves (gate rows first, each [N, out / 2] and
  // contiguous): one A GEMM, then B's gate rows and B's up rows as two GEMMs. The SwiGLU kernel
  // reads contiguous deltas, and the halves' gradients reach the A GEMM as two [N, r] products
  // instead of slices of one [N, out] tensor (which autograd would zero-fill, copy and add).
  std::pair<at::Tensor, at::Tensor> delta_grouped_halves(const at::Tensor& x_sorted, const at::Tensor& offsets,
                                                         bool training) const;
  // Two adapters over the same rows (a block's gate and up): both A's as one grouped GEMM, so x
  // is read once and backward runs one dX and one dA GEMM for the two; then each B. Only where
  // no dropout applies (peft draws each module its own mask): see can_pair_with.
  static std::pair<at::Tensor, at::Tensor> delta_grouped_pair(const ExpertLora& l1, const ExpertLora& l2,
                                                              const at::Tensor& x_sorted, const at::Tensor& offsets,
                                                              bool training);
  bool can_pair_with(const ExpertLora& other, bool training) const;
  // Whether the grouped forms can run: the grouped GEMM needs 16-byte aligned rows, so r must be a
  // multiple of 8 in bf16 (in and out are the base GEMM's, already aligned).
  bool grouped_ok() const { return a_.size(1) % 8 == 0; }
  // Every expert's ΔW [E, out, in] in `dtype`: B·(A·scaling), both cast first (axolotl's merge-aware
  // delta), gate rows first.
  at::Tensor delta_weight(at::ScalarType dtype) const;

  int experts() const { return static_cast<int>(a_.size(0)); }
  at::Tensor& A() { return a_; }
  at::Tensor& B() { return b_; }
  const at::Tensor& A() const { return a_; }
  const at::Tensor& B() const { return b_; }
  double scaling() const { return scaling_; }
  double dropout() const { return dropout_; }

 private:
  // The grouped path's first half: dropout(x) · A^T on the sorted rows [N, r], and B scaled [E, out, r]
  // (gate rows first) in x's dtype.
  std::pair<at::Tensor, at::Tensor> grouped_down_rows(const at::Tensor& x_sorted, const at::Tensor& offsets,
                                                      bool training) const;
  // The forward's A [E, r, in] and B·b_scale [E, out, r] (gate rows first) in `dtype`: the
  // masters' compute copies, rearranged from the layout's leaves (contiguous then, as the
  // grouped GEMM reads plain leaves).
  std::pair<at::Tensor, at::Tensor> factors(at::ScalarType dtype, double b_scale = 1.0) const;

  at::Tensor a_, b_;
  double scaling_;
  double dropout_;
  FusedExpertLayout layout_;
};

// Stacked expert LoRA under internal names: `<P>.experts.<matrix>.lora_{A,B}.stacked`, with P
// e.g. base_model.model.model.layers.3.mlp (the block index stays in every name).
std::string stacked_lora_name(const std::string& experts_prefix, const std::string& matrix, char ab);
using NamedLora = std::vector<std::pair<std::string, at::Tensor>>;
// LoRA on a fused expert parameter (lora_target_parameters) under internal names:
// `<P>.experts.<param>.lora_{A,B}.fused` with <param> gate_up_proj or down_proj, P e.g.
// base_model.model.model.layers.3.mlp; A [E, r, in], B [E, out, r] like ExpertLora.
std::string fused_lora_name(const std::string& experts_prefix, const std::string& param, char ab);
// peft's per-expert form of a parameter list: every stacked tensor becomes its E slices (views,
// sharing storage) under `<P>.experts.{e}.<matrix>.lora_{A,B}.weight`, in the per-expert order
// (expert-major, then the run's matrices in order, A before B). Every fused tensor becomes
// peft's ParamWrapper tensor: A [r·E, in] (A viewed), B [out, r·E] with column k·E + e =
// B[e][:, k] (a copy), named `<P>.experts.lora_{A,B}.weight`; when both parameters of a block are
// adapted peft nests the wrappers, gate_up_proj's inner, so its names gain `.base_layer`.
// Other entries pass through.
NamedLora peft_lora_tensors(const NamedLora& params);
// The inverse on names (checkpoints, load_adapter): per-expert peft tensors are stacked over
// e = 0..E-1; with `spec` naming target_parameters, ParamWrapper tensors are taken back to the
// fused form (which parameter `<P>.experts.lora_A.weight` is, and E = rows / r, come from spec);
// other entries pass through. Throws if an expert index is missing.
NamedLora stack_expert_lora(const NamedLora& peft, const LoraSpec* spec = nullptr);

// peft's adapter_config.json, the subset we read and write. write_adapter_config is its one
// writer (final adapters, checkpoints, MoeModel::save_adapter), atomic (common/files.h): a crash
// or a full drive leaves the previous file or the new one, never half of one, and a link in its
// place is replaced, not written through.
// `decoder_prefix`: where the adapted decoder is ("model." or, in a multimodal checkpoint,
// "model.language_model."); for a multimodal one the config excludes every module outside it
// (exclude_modules, peft's regular expression), so that peft adapts no vision-tower linear of the
// same short name. read_adapter_config accepts exclude_modules only in that form.
LoraSpec read_adapter_config(const std::string& adapter_dir);
// `fused_experts_path`: the module of the fused expert parameters under a layer ("mlp.experts",
// Gemma 4's "experts"); target_parameters are written under it, as peft matches them.
void write_adapter_config(const std::string& adapter_dir, const LoraSpec& spec, const std::string& base_model,
                          const std::string& decoder_prefix = "model.",
                          const std::string& fused_experts_path = "mlp.experts");
// The decoder prefix of peft-named LoRA tensors (base_model.model.<prefix>layers.N...), "model."
// when none names a layer.
std::string lora_decoder_prefix(const NamedLora& lora);
// The fused experts' module path of peft-named ParamWrapper tensors (<...>layers.N.<path>.lora_A.weight),
// "mlp.experts" when there are none.
std::string lora_fused_experts_path(const NamedLora& lora);

}  // namespace eo::model
