// MoeModel's LoRA: the LoRA-able sites of its blocks, fresh adapters (peft init), peft adapter
// folders read and written, and the nvfp4_merge_aware switch.
#include <ATen/ATen.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <set>

#include "common/error.h"
#include "models/lora_targets.h"
#include "models/moe_model.h"
#include "models/safetensors.h"

namespace eo::model {

FrozenLinear& BlockWeights::attention_linear(const std::string& name) {
  // Qwen3.5's in_proj_qkv / in_proj_b share Qwen3-Next's in_proj_qkvz / in_proj_ba slots (a layer
  // has one set or the other); out_proj is the layer's output projection, o.
  if (name == "q_proj" || name == "q_b_proj") return q;
  if (name == "k_proj") return k;
  if (name == "v_proj") return v;
  if (name == "o_proj" || name == "out_proj") return o;
  if (name == "q_a_proj") return q_a;
  if (name == "kv_a_proj_with_mqa") return kv_a;
  if (name == "kv_b_proj") return kv_b;
  if (name == "in_proj_qkvz" || name == "in_proj_qkv") return in_qkvz;
  if (name == "in_proj_ba" || name == "in_proj_b") return in_ba;
  if (name == "in_proj_z") return in_z;
  if (name == "in_proj_a") return in_a;
  throw UsageError("no attention linear named '" + name + "' in layer " + std::to_string(index));
}

std::vector<LoraSite> MoeModel::lora_sites() const {
  std::vector<LoraSite> sites;
  auto add = [&](const std::string& module, const std::string& short_name, FrozenLinear& l) {
    sites.push_back({module, short_name, l.in, l.out, &l.lora});
  };
  const std::size_t first = sites.size();
  const ModelConfig& c = cfg_;
  for (const auto& bp : blocks_) {
    BlockWeights& b = bp->weights();
    const std::string p = c.decoder_prefix() + "layers." + std::to_string(b.index) + ".";
    // This layer's attention (or delta-rule) linears under peft's names, in model order.
    for (const auto& l : c.attention_shapes(b.index)) add(p + l.module + "." + l.name, l.name, b.attention_linear(l.name));
    auto add_mlp = [&](const std::string& prefix, Mlp& mm) {
      add(prefix + ".gate_proj", "gate_proj", mm.gate);
      add(prefix + ".up_proj", "up_proj", mm.up);
      add(prefix + ".down_proj", "down_proj", mm.down);
    };
    if (!b.moe || c.dense_beside_experts()) add_mlp(p + c.mlp_prefix(), b.dense);
    if (!b.moe) continue;
    if (!lora_spec_.target_parameters.empty()) {
      // lora_target_parameters: peft's ParamWrapper on transformers 5's fused expert parameters,
      // named under its module path (`mlp.experts` in every family, Mixtral included; Gemma 4's
      // `experts`); the experts are adapted only this way (as in peft, target_modules reach no
      // fused expert).
      const std::string fp = p + c.fused_experts_path();
      auto fused = [&](const char* param, const char* short_name, std::int64_t in, std::int64_t out,
                       std::shared_ptr<ExpertLora>* stack) {
        LoraSite s{fp + "." + short_name, short_name, in, out};
        s.stack = stack;
        s.experts = static_cast<int>(c.experts);
        s.stack_prefix = fp;
        s.param = param;
        sites.push_back(std::move(s));
      };
      fused(kGateUpParam, "gate_up_proj", c.hidden, 2 * c.expert_width, &b.gate_up_lora);
      fused(kDownParam, "down_proj", c.expert_width, c.hidden, &b.expert_lora[static_cast<int>(ExpertMatrix::Down)]);
      if (b.has_shared) add_mlp(p + c.mlp_prefix() + "." + c.shared_expert_name(), b.shared);
      if (c.shared_expert_gated) add(p + c.moe_prefix() + ".shared_expert_gate", "shared_expert_gate", b.shared_gate);
      continue;
    }
    // peft names experts under the checkpoint's module path (Mixtral: block_sparse_moe, w1/w3/w2).
    const std::string ep = p + c.experts_path() + ".";
    const std::int64_t in[3] = {c.hidden, c.hidden, c.expert_width}, out[3] = {c.expert_width, c.expert_width, c.hidden};
    for (int e = 0; e < (c.experts_lora_ok() ? c.experts : 0); ++e)  // gpt-oss: no per-expert modules
      for (int mi = 0; mi < 3; ++mi) {
        const std::string short_name = c.family().expert_linears[mi];
        LoraSite s{ep + std::to_string(e) + "." + short_name, short_name, in[mi], out[mi]};
        s.stack = &b.expert_lora[mi];
        s.expert = e;
        s.experts = static_cast<int>(c.experts);
        s.stack_prefix = p + c.experts_path();
        sites.push_back(std::move(s));
      }
    if (b.has_shared) add_mlp(p + c.mlp_prefix() + "." + c.shared_expert_name(), b.shared);
    if (c.shared_expert_gated) add(p + c.moe_prefix() + ".shared_expert_gate", "shared_expert_gate", b.shared_gate);
  }
  // Each site's layer, from its name (every site is under <decoder prefix>layers.{i}.; a multimodal
  // checkpoint's decoder prefix is model.language_model.).
  const std::size_t layer_at = c.decoder_prefix().size() + sizeof("layers.") - 1;
  for (std::size_t i = first; i < sites.size(); ++i) sites[i].layer = std::stoi(sites[i].module.substr(layer_at));
  return sites;
}

std::pair<int, int> MoeModel::enable_merge_aware() {
  int linears = 0, experts = 0;
  for (auto& bp : blocks_) {
    BlockWeights& b = bp->weights();
    for (FrozenLinear* l : {&b.q, &b.k, &b.v, &b.o, &b.q_a, &b.kv_a, &b.kv_b, &b.in_qkvz, &b.in_ba, &b.in_z, &b.in_a,
                            &b.dense.gate, &b.dense.up, &b.dense.down, &b.shared.gate, &b.shared.up, &b.shared.down, &b.shared_gate}) {
      l->merge_aware = nullptr;
      if (!l->lora || !l->nvfp4_grid().defined()) continue;  // plain LoRA on a weight that is not NVFP4, as axolotl
      l->merge_aware = merge_aware_on_.get();
      ++linears;
    }
    bp->set_merge_aware(nullptr);
    if (!b.moe || !b.nvfp4_experts) continue;
    int n = b.gate_up_lora ? 2 : 0;
    for (const auto& l : b.expert_lora) n += l ? 1 : 0;
    if (n == 0) continue;
    // The snapped banks carry the whole delta, so no dropout can act on the low-rank branch alone.
    if (lora_spec_.dropout > 0)
      throw UsageError("nvfp4_merge_aware: the expert LoRA snaps its delta into the experts' weights, where lora_dropout (" +
                       std::to_string(lora_spec_.dropout) + ") cannot act; set lora_dropout: 0");
    bp->set_merge_aware(merge_aware_on_.get());
    experts += n;
  }
  if (linears + experts == 0)
    throw UsageError("nvfp4_merge_aware: no LoRA-carrying weight of this " + cfg_.model_type + " model is NVFP4 (it snaps the "
                     "LoRA delta onto an NVFP4 base's grid: base_model must be an NVFP4 (modelopt) checkpoint whose adapted "
                     "linears or experts are NVFP4, and expert_quant must not re-quantise the experts to nf4)");
  return {linears, experts};
}

void MoeModel::add_lora(const LoraSpec& spec) {
  EO_CHECK(spec.r > 0, "LoRA rank must be positive");
  for (const auto& p : spec.target_parameters)
    if (canonical_target_parameter(p) != p)
      throw UsageError("LoRA target parameter '" + p + "' is not " + kGateUpParam + " or " + kDownParam);
  const bool moe = std::any_of(blocks_.begin(), blocks_.end(), [](const auto& b) { return b->is_moe(); });
  if (!spec.target_parameters.empty() && !cfg_.fused_expert_lora_ok())
    throw UsageError("lora_target_parameters is not implemented for " + cfg_.model_type + "; use lora_target_modules");
  if (!spec.target_parameters.empty() && !moe)
    throw UsageError("lora_target_parameters needs MoE blocks with fused experts; this " + cfg_.model_type +
                     " model has none");
  for (int l : spec.layers)
    if (l < 0 || l >= num_layers())
      throw UsageError("LoRA layers_to_transform: " + std::to_string(l) + " is no layer of this " + cfg_.model_type +
                       " model (layers 0 to " + std::to_string(num_layers() - 1) + ")");
  lora_spec_ = spec;
  std::set<std::string> matched;
  for (auto& b : blocks_) {  // every block's stacked expert LoRA is made afresh below
    for (auto& l : b->weights().expert_lora) l.reset();
    b->weights().gate_up_lora.reset();
  }
  const auto sites = lora_sites();
  for (std::size_t i = 0; i < sites.size(); ++i) {
    const auto& s = sites[i];
    if (!s.param.empty()) {
      if (!spec.targets_parameter(s.param) || !spec.targets_layer(s.layer)) continue;
      // In peft's layout for this family; one generator per fused parameter, as peft draws one
      // lora_A per ParamWrapper.
      FusedExpertLayout layout = cfg_.family().fused_layout;
      layout.gate_up_interleaved &= s.param == kGateUpParam;
      *s.stack = std::make_shared<ExpertLora>(s.experts, s.in, s.out, spec, opts_.device, layout);
      (*s.stack)->init_fused(spec.seed * 1000003ULL + i);
      continue;
    }
    // The model's targets are names already (lora_target_linear resolved to its linears).
    if (!adapts_module(spec, false, s.short_name, s.layer)) {
      if (s.slot) s.slot->reset();
      continue;
    }
    matched.insert(s.short_name);
    // One generator per module, seeded from (seed, module index): stable across runs and ranks,
    // and the same for an expert's slice of the stacked adapter as for a per-expert adapter.
    const std::uint64_t gen_seed = spec.seed * 1000003ULL + i;
    if (s.slot) {
      *s.slot = std::make_shared<LoraAdapter>(s.in, s.out, spec, gen_seed, opts_.device);
      continue;
    }
    if (!*s.stack) *s.stack = std::make_shared<ExpertLora>(s.experts, s.in, s.out, spec, opts_.device);
    (*s.stack)->init_expert(s.expert, gen_seed);
  }
  const std::vector<std::string>& expert_names = expert_linear_names();
  for (const auto& t : spec.targets)
    // With target_parameters an expert matrix name may match only the experts, which it does
    // not reach (peft on transformers 5 likewise): not an error.
    if (!matched.count(t) && !(!spec.target_parameters.empty() && moe &&
                                std::find(expert_names.begin(), expert_names.end(), t) != expert_names.end())) {
      std::string names;
      for (const auto& n : cfg_.linear_modules()) names += (names.empty() ? "" : ", ") + n;
      throw UsageError("LoRA target module '" + t + "' matches no linear of this " + cfg_.model_type + " model (" + names + ")" +
                       (cfg_.experts_lora_ok() ? "" : "; its experts exist only fused, which peft adapts through "
                                                      "target_parameters (lora_target_parameters)"));
    }
}

std::vector<std::pair<std::string, at::Tensor>> MoeModel::lora_parameters() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& s : lora_sites()) {
    if (!s.param.empty()) {
      if (!*s.stack) continue;
      const std::string prefix = "base_model.model." + s.stack_prefix;
      out.emplace_back(fused_lora_name(prefix, s.short_name, 'A'), (*s.stack)->A());
      out.emplace_back(fused_lora_name(prefix, s.short_name, 'B'), (*s.stack)->B());
      continue;
    }
    if (s.stack) {
      // Once per block and matrix (at expert 0's site): the stacked leaves, gate, up, down.
      if (s.expert != 0 || !*s.stack) continue;
      const std::string prefix = "base_model.model." + s.stack_prefix;
      out.emplace_back(stacked_lora_name(prefix, s.short_name, 'A'), (*s.stack)->A());
      out.emplace_back(stacked_lora_name(prefix, s.short_name, 'B'), (*s.stack)->B());
      continue;
    }
    if (!*s.slot) continue;
    out.emplace_back("base_model.model." + s.module + ".lora_A.weight", (*s.slot)->A());
    out.emplace_back("base_model.model." + s.module + ".lora_B.weight", (*s.slot)->B());
  }
  return out;
}

std::vector<std::shared_ptr<ExpertLora>> MoeModel::expert_loras(int layer) const {
  const BlockWeights& w = blocks_.at(static_cast<std::size_t>(layer))->weights();
  std::vector<std::shared_ptr<ExpertLora>> out;
  for (const auto& l : w.expert_lora)
    if (l) out.push_back(l);
  if (w.gate_up_lora) out.push_back(w.gate_up_lora);
  return out;
}

void MoeModel::load_adapter(const std::string& adapter_dir) {
  add_lora(read_adapter_config(adapter_dir));
  load_adapter_weights(adapter_dir);
}

void MoeModel::load_adapter_weights(const std::string& adapter_dir) {
  const LoraSpec& spec = lora_spec_;
  const std::string path = adapter_dir + "/adapter_model.safetensors";
  if (!std::filesystem::exists(path)) throw UsageError(path + ": missing (only safetensors adapters are supported)");
  const auto file = st::File::open(path);
  std::set<std::string> used;
  // The file's tensors under peft's names and shapes (per-expert slices, ParamWrapper layouts),
  // then taken back to the trained form and copied into the leaves.
  std::vector<std::pair<std::string, at::Tensor>> leaves, loaded;
  for (const auto& [name, p] : lora_parameters()) leaves.emplace_back(name, p.detach());
  for (auto& [name, param] : peft_lora_tensors(leaves)) {
    const st::TensorInfo* info = file->find(name);
    if (!info)
      throw UsageError(path + ": tensor '" + name + "' is missing although adapter_config.json's target_modules "
                       "select that module; was the adapter made for another model?");
    at::Tensor t = file->load(name);
    if (t.sizes() != param.sizes())
      throw UsageError(path + ": tensor '" + name + "' has shape " + c10::str(t.sizes()) + ", expected " +
                       c10::str(param.sizes()) + " (r=" + std::to_string(spec.r) + ")");
    loaded.emplace_back(name, t.to(at::kFloat));
    used.insert(name);
  }
  for (const auto& info : file->tensors())
    if (!used.count(info.name))
      throw UsageError(path + ": tensor '" + info.name + "' does not belong to any targeted module of this model");
  std::map<std::string, at::Tensor> trained;
  for (auto& [name, t] : stack_expert_lora(loaded, &spec)) trained.emplace(name, t);
  for (auto& [name, leaf] : leaves) leaf.copy_(trained.at(name));  // a detached alias: the leaf keeps requires_grad
}

void MoeModel::save_adapter(const std::string& adapter_dir, const std::string& base_model) const {
  std::filesystem::create_directories(adapter_dir);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (auto& [name, t] : lora_parameters()) tensors.emplace_back(name, t.detach().to(at::kCPU));
  tensors = peft_lora_tensors(tensors);  // peft's per-expert / ParamWrapper names and shapes
  for (auto& [name, t] : tensors) t = t.contiguous();
  st::save(adapter_dir + "/adapter_model.safetensors", tensors);
  write_adapter_config(adapter_dir, lora_spec_, base_model, cfg_.decoder_prefix(), cfg_.fused_experts_path());
}

}  // namespace eo::model
