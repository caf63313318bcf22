#include "models/lora.h"

#include <unistd.h>
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ScalarOps.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <tuple>

#include "common/error.h"
#include "common/files.h"
#include "models/grouped_mm.h"

namespace eo::model {

double LoraSpec::scaling() const { return use_rslora ? alpha / std::sqrt(static_cast<double>(r)) : alpha / r; }

bool LoraSpec::targets_module(const std::string& short_name) const {
  for (const auto& t : targets)
    if (t == short_name) return true;
  return false;
}

bool LoraSpec::targets_layer(int layer) const {
  return layers.empty() || std::find(layers.begin(), layers.end(), layer) != layers.end();
}

bool LoraSpec::targets_parameter(const std::string& canonical) const {
  for (const auto& t : target_parameters)
    if (t == canonical) return true;
  return false;
}

std::string canonical_target_parameter(const std::string& name) {
  // Llama 4's experts are feed_forward.experts (what its adapters' target_parameters say).
  if (name == kGateUpParam || name == "experts.gate_up_proj" || name == "gate_up_proj" ||
      name == "feed_forward.experts.gate_up_proj")
    return kGateUpParam;
  if (name == kDownParam || name == "experts.down_proj" || name == "down_proj" || name == "feed_forward.experts.down_proj")
    return kDownParam;
  return "";
}

namespace {

// peft's init of A [r, in]: kaiming_uniform_(a=√5): gain = √(2/(1+5)), bound = gain·√(3/fan_in)
// = 1/√fan_in, drawn on the CPU from a per-module generator (stable across devices and ranks).
at::Tensor peft_init_a(std::int64_t r, std::int64_t in, std::uint64_t gen_seed) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(gen_seed);
  const double bound = 1.0 / std::sqrt(static_cast<double>(in));
  return at::empty({r, in}, at::kFloat).uniform_(-bound, bound, gen);
}

// The compute copy of a LoRA master (fp32 leaf), scale · master in `dtype`, as one kernel that
// rounds once; its backward adds scale · grad into master.grad in place (one fp32 kernel,
// allocating it on first use), so no fp32 copy of the gradient is made and AccumulateGrad has
// nothing left to add. Under CUDA graphs the gradients sit at fixed addresses, which is where
// the add lands. The result is the same as (master * scale).to(dtype) under autograd.
struct MasterCastFunction : public torch::autograd::Function<MasterCastFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& master, at::ScalarType dtype,
                            double scale) {
    ctx->saved_data["master"] = master;  // a parameter, not an activation: no saved-tensor hooks
    ctx->saved_data["scale"] = scale;
    at::Tensor out = at::empty(master.sizes(), master.options().dtype(dtype));
    if (scale == 1.0) return out.copy_(master);
    return at::mul_out(out, master, c10::scalar_to_tensor(scale));
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    at::Tensor master = ctx->saved_data["master"].toTensor();
    const double scale = ctx->saved_data["scale"].toDouble();
    at::Tensor& g = master.mutable_grad();
    if (!g.defined()) {
      g = at::empty_like(master, at::MemoryFormat::Contiguous);
      if (scale == 1.0) g.copy_(grads[0]);
      else at::mul_out(g, grads[0], c10::scalar_to_tensor(scale));
    } else {
      g.add_(grads[0], scale);
    }
    return {at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// scale · master in dtype for a GEMM. A leaf master under autograd goes through
// MasterCastFunction; a view (the per-expert loop's slices) or no-grad use is a plain cast.
at::Tensor compute_copy(const at::Tensor& master, at::ScalarType dtype, double scale = 1.0) {
  if (scale == 1.0 && master.scalar_type() == dtype) return master;
  if (master.is_leaf() && master.requires_grad() && at::GradMode::is_enabled())
    return MasterCastFunction::apply(master, dtype, scale);
  return scale == 1.0 ? master.to(dtype) : (master * scale).to(dtype);
}

// y + B(A(dropout(x))) · scaling in x's dtype, the one formula of both adapter forms: the
// scale and the sum ride in the second GEMM (addmm's alpha and beta), one rounding and no
// elementwise pass over [tokens, out] in forward or backward.
at::Tensor lora_add(const at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, double scaling,
                    double dropout, bool training) {
  const at::Tensor h = (training && dropout > 0) ? at::dropout(x, dropout, true) : x;
  const auto dt = x.scalar_type();
  const at::Tensor down = at::linear(h, compute_copy(a, dt));  // [..., r]
  const auto out = y.size(-1), r = a.size(0);
  return at::addmm(y.reshape({-1, out}), down.reshape({-1, r}), compute_copy(b, dt).t(), 1, scaling).view(y.sizes());
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

ExpertLora::ExpertLora(int experts, std::int64_t in, std::int64_t out, const LoraSpec& spec, const at::Device& device,
                       FusedExpertLayout layout)
    : scaling_(spec.scaling()), dropout_(spec.dropout), layout_(layout) {
  const auto opts = at::TensorOptions().dtype(at::kFloat).device(device);
  if (layout_.factors_swapped) std::swap(in, out);  // peft's in and out
  a_ = at::zeros({experts, spec.r, in}, opts).set_requires_grad(true);
  b_ = at::zeros({experts, out, spec.r}, opts).set_requires_grad(true);
}

void ExpertLora::init_expert(int e, std::uint64_t gen_seed) {
  at::NoGradGuard ng;
  a_.select(0, e).copy_(peft_init_a(a_.size(1), a_.size(2), gen_seed));
}

void ExpertLora::init_fused(std::uint64_t gen_seed) {
  at::NoGradGuard ng;
  const auto E = a_.size(0), r = a_.size(1), in = a_.size(2);
  a_.copy_(peft_init_a(E * r, in, gen_seed).view({E, r, in}));
}

std::pair<at::Tensor, at::Tensor> ExpertLora::factors(at::ScalarType dtype, double b_scale) const {
  if (!layout_.factors_swapped && !layout_.gate_up_interleaved) return {compute_copy(a_, dtype), compute_copy(b_, dtype, b_scale)};
  at::Tensor a = layout_.factors_swapped ? compute_copy(b_, dtype).transpose(1, 2) : compute_copy(a_, dtype);
  at::Tensor b = layout_.factors_swapped ? compute_copy(a_, dtype, b_scale).transpose(1, 2) : compute_copy(b_, dtype, b_scale);
  if (layout_.gate_up_interleaved) {  // rows (gate 0, up 0, gate 1, ...) → (gate 0, gate 1, ..., up 0, ...)
    const auto E = b.size(0), out = b.size(1), r = b.size(2);
    b = b.reshape({E, out / 2, 2, r}).transpose(1, 2).reshape({E, out, r});
  }
  return {a.contiguous(), b.contiguous()};
}

ExpertLora::Slices ExpertLora::slices() const {
  const auto [a, b] = factors(at::kFloat);
  return {a.unbind(0), b.unbind(0)};
}

at::Tensor ExpertLora::delta_weight(at::ScalarType dtype) const {
  const auto [a, b] = factors(at::kFloat);
  return at::bmm(b.to(dtype), a.to(dtype) * scaling_);
}

at::Tensor ExpertLora::add_to(const Slices& s, int e, const at::Tensor& y, const at::Tensor& x, bool training) const {
  return lora_add(y, x, s.a.at(e), s.b.at(e), scaling_, dropout_, training);
}

namespace {
// The fp32 masters are cast once per forward (compute_copy: the gradients land in fp32);
// grouped_mm's backward gives dX (2-D x 3-D) and dA, dB (2-D x 2-D over the same offsets), so no
// count reaches the host. Its small-K kernel runs the B GEMM forward and the A GEMM's dX.
// `a` [E, r, in] in x's dtype.
at::Tensor grouped_down(const at::Tensor& x, const at::Tensor& a, const at::Tensor& offsets) {
  return grouped_mm(x, a.transpose(1, 2), offsets);  // [N, r]
}
// The scaling rides in B's cast (B is [E, out, r], small), not in a pass over the [N, out] delta:
// the delta leaves the GEMM scaled, and its gradient reaches the GEMM as it is. `bs` [E, out, r]
// scaled, in down's dtype.
at::Tensor grouped_up(const at::Tensor& down, const at::Tensor& bs, const at::Tensor& offsets) {
  return grouped_mm(down, bs.transpose(1, 2), offsets);  // [N, out]
}
// The paired A's output [N, r1 + r2] as its two column blocks, one per B GEMM, each copied
// contiguous ([N, r]: small). With the blocks read in place (a row stride of r1 + r2) the model
// gave wrong gradients on the H200 and with the copies it matches the per-expert loop
// (Cuda.GroupedExpertLoraModelMatchesThePerExpertLoop), although torch's grouped GEMM alone reads
// such a slice exactly (docs/benchmarks-history.md, "timings, and a wrong gradient found" and
// "a small-K grouped GEMM that was no faster"): the copies stay until the cause is known.
// Autograd's narrow would hand each block's gradient back as a zero-filled [N, r1 + r2] and add
// the two; this backward writes both into one tensor (one cat).
struct SplitColumnsFunction : public torch::autograd::Function<SplitColumnsFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& t,
                                                std::int64_t first) {
    ctx->saved_data["first"] = first;
    ctx->saved_data["rest"] = t.size(1) - first;
    return {t.narrow(1, 0, first).contiguous(), t.narrow(1, first, t.size(1) - first).contiguous()};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const std::int64_t widths[2] = {ctx->saved_data["first"].toInt(), ctx->saved_data["rest"].toInt()};
    const at::Tensor& like = grads[0].defined() ? grads[0] : grads[1];
    std::vector<at::Tensor> parts;
    for (int i = 0; i < 2; ++i)
      parts.push_back(grads[i].defined() ? grads[i] : at::zeros({like.size(0), widths[i]}, like.options()));
    return {at::cat(parts, 1), at::Tensor()};
  }
};
}  // namespace

std::pair<at::Tensor, at::Tensor> ExpertLora::grouped_down_rows(const at::Tensor& x_sorted, const at::Tensor& offsets,
                                                                bool training) const {
  EO_CHECK(grouped_ok(), "grouped expert LoRA needs r divisible by 8, got r=", a_.size(1));
  const at::Tensor x = x_sorted.contiguous();
  // Dropout on the whole sorted input: each row still gets its own mask, as peft's per-module
  // dropout gives it (gate and up draw independent masks, as their two peft modules do).
  const at::Tensor h = (training && dropout_ > 0) ? at::dropout(x, dropout_, true) : x;
  const auto [a, bs] = factors(x.scalar_type(), scaling_);
  return {grouped_down(h, a, offsets), bs};
}

at::Tensor ExpertLora::delta_grouped(const at::Tensor& x_sorted, const at::Tensor& offsets, bool training) const {
  const auto [down, bs] = grouped_down_rows(x_sorted, offsets, training);
  return grouped_up(down, bs, offsets);
}

std::pair<at::Tensor, at::Tensor> ExpertLora::delta_grouped_halves(const at::Tensor& x_sorted, const at::Tensor& offsets,
                                                                   bool training) const {
  const auto [down, bs] = grouped_down_rows(x_sorted, offsets, training);  // one mask, as peft's one module
  const std::int64_t half = bs.size(1) / 2;
  EO_CHECK(bs.size(1) == 2 * half, "delta_grouped_halves: B has ", bs.size(1), " rows, not two halves");
  return {grouped_up(down, bs.narrow(1, 0, half).contiguous(), offsets),
          grouped_up(down, bs.narrow(1, half, half).contiguous(), offsets)};
}

bool ExpertLora::can_pair_with(const ExpertLora& other, bool training) const {
  const bool masks = training && (dropout_ > 0 || other.dropout_ > 0);
  // Per-expert adapters only (the fused ones have no partner), so A is [E, r, in] in both.
  const bool plain = !layout_.factors_swapped && !layout_.gate_up_interleaved && !other.layout_.factors_swapped &&
                     !other.layout_.gate_up_interleaved;
  return !masks && plain && grouped_ok() && other.grouped_ok() && a_.size(0) == other.a_.size(0) &&
         a_.size(2) == other.a_.size(2) && a_.device() == other.a_.device();
}

std::pair<at::Tensor, at::Tensor> ExpertLora::delta_grouped_pair(const ExpertLora& l1, const ExpertLora& l2,
                                                                 const at::Tensor& x_sorted, const at::Tensor& offsets,
                                                                 bool training) {
  EO_CHECK(l1.can_pair_with(l2, training), "delta_grouped_pair: these adapters cannot share one A GEMM (dropout, shapes or r)");
  const at::Tensor x = x_sorted.contiguous();
  const std::int64_t r1 = l1.a_.size(1), r2 = l2.a_.size(1);
  const auto dt = x.scalar_type();
  const at::Tensor a = at::cat({compute_copy(l1.a_, dt), compute_copy(l2.a_, dt)}, 1);
  const at::Tensor down = grouped_down(x, a, offsets);  // [N, r1 + r2]
  EO_CHECK(down.size(1) == r1 + r2, "delta_grouped_pair: A GEMM gave ", down.size(1), " columns for r ", r1, " + ", r2);
  const torch::autograd::variable_list halves = SplitColumnsFunction::apply(down, r1);
  return {grouped_up(halves[0], compute_copy(l1.b_, dt, l1.scaling_), offsets),
          grouped_up(halves[1], compute_copy(l2.b_, dt, l2.scaling_), offsets)};
}

std::string stacked_lora_name(const std::string& experts_prefix, const std::string& matrix, char ab) {
  return experts_prefix + "." + matrix + ".lora_" + ab + ".stacked";
}

std::string fused_lora_name(const std::string& experts_prefix, const std::string& param, char ab) {
  return experts_prefix + "." + param + ".lora_" + ab + ".fused";
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

// "<head>.experts.<param>.lora_A.fused" → {head.experts, "<param>", 'A'}.
std::optional<std::tuple<std::string, std::string, char>> parse_fused(const std::string& name) {
  std::string head;
  std::vector<std::string> p;
  if (!split_tail(name, 3, head, p) || p[2] != "fused" || !is_lora_factor(p[1])) return std::nullopt;
  if (p[0] != "gate_up_proj" && p[0] != "down_proj") return std::nullopt;
  return std::make_tuple(head, p[0], p[1].back());
}

// peft's ParamWrapper layout (peft/tuners/lora/layer.py, get_delta_weight): lora_A [r·E, in]
// read as A.reshape(E, r, in), lora_B [out, r·E] read as B.reshape(out, r, E), expert e's
// ΔW_e = scaling · B[:, :, e] @ A[e].
at::Tensor fused_to_peft(const at::Tensor& t, char ab) {
  const auto E = t.size(0);
  if (ab == 'A') return t.reshape({E * t.size(1), t.size(2)});
  return t.permute({1, 2, 0}).reshape({t.size(1), t.size(2) * E});  // [E, out, r] → [out, r, E]
}

at::Tensor fused_from_peft(const at::Tensor& t, char ab, std::int64_t r, const std::string& name) {
  EO_CHECK(t.dim() == 2, name, ": expected a 2-D ParamWrapper tensor, got shape ", t.sizes());
  if (ab == 'A') {
    EO_CHECK(t.size(0) % r == 0, name, ": ", t.size(0), " rows are not a multiple of r=", r);
    return t.reshape({t.size(0) / r, r, t.size(1)});
  }
  EO_CHECK(t.size(1) % r == 0, name, ": ", t.size(1), " columns are not a multiple of r=", r);
  return t.reshape({t.size(0), r, t.size(1) / r}).permute({2, 0, 1}).contiguous();
}

// peft's ParamWrapper names: "<head>.experts.lora_A.weight" → {head.experts, 'A', false},
// "<head>.experts.base_layer.lora_A.weight" (the inner of two nested wrappers) → {..., true}.
std::optional<std::tuple<std::string, char, bool>> parse_param_wrapper(const std::string& name) {
  std::string head;
  std::vector<std::string> p;
  if (split_tail(name, 2, head, p) && p[1] == "weight" && is_lora_factor(p[0]))
    return std::make_tuple(head, p[0].back(), false);
  if (split_tail(name, 3, head, p) && p[0] == "base_layer" && p[2] == "weight" && is_lora_factor(p[1]))
    return std::make_tuple(head, p[1].back(), true);
  return std::nullopt;
}

}  // namespace

NamedLora peft_lora_tensors(const NamedLora& params) {
  NamedLora out;
  for (std::size_t i = 0; i < params.size();) {
    if (const auto f = parse_fused(params[i].first)) {
      const auto& [head, param, ab] = *f;
      // Nested wrappers: gate_up_proj is the inner one when down_proj is adapted too.
      bool nested = false;
      if (param == "gate_up_proj")
        for (const auto& [n, t] : params) nested |= n == fused_lora_name(head, "down_proj", 'A');
      EO_CHECK(params[i].second.defined(), params[i].first, ": undefined tensor");
      out.emplace_back(head + (nested ? ".base_layer" : "") + ".lora_" + ab + ".weight", fused_to_peft(params[i].second, ab));
      ++i;
      continue;
    }
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

NamedLora stack_expert_lora(const NamedLora& peft, const LoraSpec* spec) {
  NamedLora out;
  std::map<std::string, std::map<long, at::Tensor>> groups;  // stacked name → expert → slice
  const bool gate_up = spec && spec->targets_parameter(kGateUpParam), down = spec && spec->targets_parameter(kDownParam);
  for (const auto& [name, t] : peft) {
    if (const auto w = (gate_up || down) ? parse_param_wrapper(name) : std::nullopt) {
      const auto& [head, ab, inner] = *w;
      // The outer (or only) wrapper is down_proj when it is adapted; the inner one gate_up_proj.
      if (!inner || (gate_up && down)) {
        const std::string param = (!inner && down) ? "down_proj" : "gate_up_proj";
        out.emplace_back(fused_lora_name(head, param, ab), fused_from_peft(t, ab, spec->r, name));
        continue;
      }
    }
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

namespace {

// peft's exclude_modules (re.fullmatch on module names) for every module outside `prefix`.
std::string exclude_outside(const std::string& prefix) {
  std::string escaped;
  for (char ch : prefix) {
    if (ch == '.') escaped += '\\';
    escaped += ch;
  }
  return "(?!" + escaped + ").*";
}

}  // namespace

LoraSpec read_adapter_config(const std::string& adapter_dir) {
  const std::string path = adapter_dir + "/adapter_config.json";
  if (const int fd = open_input_file(path, "adapter_config.json", kMaxTextFileBytes); fd >= 0) ::close(fd);
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
  nlohmann::json t = j.value("target_modules", nlohmann::json::array());
  if (t.is_null()) t = nlohmann::json::array();  // peft writes null when only target_parameters are set
  if (!t.is_array()) throw UsageError(path + ": 'target_modules' must be a list of module names");
  for (const auto& x : t) {
    if (!x.is_string()) throw UsageError(path + ": 'target_modules' must be a list of module names");
    s.targets.push_back(x.get<std::string>());
  }
  // peft's target_parameters (ParamWrapper): only the fused expert parameters are supported.
  const auto& tp = j.value("target_parameters", nlohmann::json());
  if (!tp.is_null()) {
    if (!tp.is_array()) throw UsageError(path + ": 'target_parameters' must be a list of parameter names");
    for (const auto& x : tp) {
      const std::string c = x.is_string() ? canonical_target_parameter(x.get<std::string>()) : "";
      if (c.empty())
        throw UsageError(path + ": target_parameters entry " + x.dump() + " is not supported (only " + kGateUpParam +
                         " and " + kDownParam + ")");
      if (!s.targets_parameter(c)) s.target_parameters.push_back(c);
    }
    // One order (peft writes a set): gate_up_proj, then down_proj.
    std::sort(s.target_parameters.begin(), s.target_parameters.end(),
              [](const std::string& a, const std::string& b) { return (a == kGateUpParam) > (b == kGateUpParam); });
    if (!s.target_parameters.empty() && s.dropout > 0)
      throw UsageError(path + ": lora_dropout must be 0 with target_parameters (peft's ParamWrapper refuses dropout)");
  }
  if (s.targets.empty() && s.target_parameters.empty())
    throw UsageError(path + ": 'target_modules' and 'target_parameters' are empty");
  // exclude_modules: only the exclusion of everything outside a multimodal checkpoint's text model
  // (what write_adapter_config writes); any other would drop modules eo-ddp adapts.
  // (Gemma 4's model.language_model., Llama 4's language_model.model.)
  if (j.contains("exclude_modules") && !j["exclude_modules"].is_null() &&
      !(j["exclude_modules"].is_array() && j["exclude_modules"].empty()) &&
      j["exclude_modules"] != exclude_outside("model.language_model.") &&
      j["exclude_modules"] != exclude_outside("language_model.model."))
    throw UsageError(path + ": exclude_modules " + j["exclude_modules"].dump() + " is not supported (only " +
                     nlohmann::json(exclude_outside("model.language_model.")).dump() +
                     ", the modules outside a multimodal checkpoint's text model)");
  // peft's layers_to_transform (an int or a list) under layers_pattern, which eo-ddp's module
  // names (model.layers.{i}) match as "layers" or peft's default (null: its common patterns).
  const auto& lt = j.value("layers_to_transform", nlohmann::json());
  if (lt.is_number_integer()) s.layers.push_back(lt.get<int>());
  else if (lt.is_array())
    for (const auto& x : lt) {
      if (!x.is_number_integer()) throw UsageError(path + ": 'layers_to_transform' must be a layer index or a list of them");
      s.layers.push_back(x.get<int>());
    }
  else if (!lt.is_null()) throw UsageError(path + ": 'layers_to_transform' must be a layer index or a list of them");
  std::sort(s.layers.begin(), s.layers.end());
  s.layers.erase(std::unique(s.layers.begin(), s.layers.end()), s.layers.end());
  const auto& lp = j.value("layers_pattern", nlohmann::json());
  const bool pattern_ok = lp.is_null() || lp == "layers" || (lp.is_array() && (lp.empty() || lp == nlohmann::json::array({"layers"})));
  if (!pattern_ok)
    throw UsageError(path + ": layers_pattern " + lp.dump() + " is not supported (the decoder layers are model.layers)");
  return s;
}

std::string lora_decoder_prefix(const NamedLora& lora) {
  static const std::string kHead = "base_model.model.";
  for (const auto& [name, t] : lora) {
    const auto at = name.find("layers.");
    if (name.rfind(kHead, 0) == 0 && at != std::string::npos && at >= kHead.size())
      return name.substr(kHead.size(), at - kHead.size());
  }
  return "model.";
}

std::string lora_fused_experts_path(const NamedLora& lora) {
  for (const auto& [name, t] : lora) {
    const auto w = parse_param_wrapper(name);
    const auto at = name.find("layers.");
    if (!w || at == std::string::npos) continue;
    const std::string& head = std::get<0>(*w);  // <...>layers.N.<path>
    const auto dot = head.find('.', at + sizeof("layers.") - 1);
    if (dot != std::string::npos) return head.substr(dot + 1);
  }
  return "mlp.experts";
}

void write_adapter_config(const std::string& adapter_dir, const LoraSpec& spec, const std::string& base_model,
                          const std::string& decoder_prefix, const std::string& fused_experts_path) {
  // Only peft_type is required to load; the rest documents the run as peft's LoraConfig does.
  nlohmann::json j;
  j["peft_type"] = "LORA";
  j["task_type"] = "CAUSAL_LM";
  j["r"] = spec.r;
  j["lora_alpha"] = spec.alpha;
  j["lora_dropout"] = spec.dropout;
  j["target_modules"] = spec.targets;
  // Under the family's module path, which peft matches them by (Gemma 4: experts.gate_up_proj).
  if (!spec.target_parameters.empty()) {
    std::vector<std::string> params;
    for (const auto& p : spec.target_parameters)
      params.push_back(fused_experts_path + (p == kGateUpParam ? ".gate_up_proj" : ".down_proj"));
    j["target_parameters"] = params;
  }
  if (decoder_prefix != "model.") j["exclude_modules"] = exclude_outside(decoder_prefix);
  if (!spec.layers.empty()) {
    j["layers_to_transform"] = spec.layers;
    j["layers_pattern"] = "layers";
  }
  j["bias"] = "none";
  j["use_rslora"] = spec.use_rslora;
  j["fan_in_fan_out"] = false;
  j["base_model_name_or_path"] = base_model;
  j["inference_mode"] = true;
  j["init_lora_weights"] = true;
  j["modules_to_save"] = nullptr;
  write_file_atomic(adapter_dir + "/adapter_config.json", j.dump(2) + "\n");
}

}  // namespace eo::model
