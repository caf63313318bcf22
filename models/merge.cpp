#include "models/merge.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <cstdio>
#if defined(__GLIBC__)
#include <malloc.h>
#endif
#include <filesystem>
#include <functional>
#include <map>
#include <set>

#include "common/error.h"
#include "common/files.h"
#include "common/log.h"
#include "common/text.h"
#include "models/hf_config.h"
#include "models/lora.h"
#include "models/mxfp4.h"
#include "models/nf4.h"
#include "models/nf4_bnb.h"
#include "models/quantized_weight.h"
#include "models/safetensors.h"

#include <nlohmann/json.hpp>

namespace eo::model {

namespace fs = std::filesystem;

namespace {

constexpr const char* kPeftPrefix = "base_model.model.";

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// How a checkpoint tensor holds eo-ddp's [out, in] matrices: one plain linear, or transformers'
// fused experts [E, ...] (gate_up_proj holding gate and up, down_proj), in the family's layout.
enum class Storage { Linear, GateUp, GateUpT, GateUpTInterleaved, Down, DownT, Other };

// One [out, in] matrix inside a checkpoint tensor: the whole (Linear), or expert e's gate (0),
// up (1) or down (2).
struct Slot {
  int expert = -1;
  int matrix = -1;
  bool operator<(const Slot& o) const { return std::tie(expert, matrix) < std::tie(o.expert, o.matrix); }
};

// A LoRA matrix to add to one slot of one checkpoint tensor; `delta` gives ΔW [out, in] in fp32.
struct Delta {
  Slot slot;
  std::string source;  // the adapter tensor it comes from, for errors
  std::function<at::Tensor()> delta;  // float64: the merge adds it to the weight in float64
};

struct TensorEntry {
  st::TensorInfo info;
  std::size_t shard = 0;  // index into the input shards
  // MXFP4 experts: the stored `<name>_blocks` / `<name>_scales` this dequantised tensor comes from.
  std::string blocks, scales;
  // A bitsandbytes NF4 module: its prefix (`<prefix>.weight` U8 and its quant state), dequantised.
  std::string bnb;
};

class Merger {
 public:
  explicit Merger(const MergeOptions& o) : opts_(o), cfg_(load_config(o.base_dir)) {}

  MergeSummary run() {
    c10::NoGradGuard no_grad;
    read_index();
    refuse_quantised();
    place_adapter();
    return write();
  }

 private:
  const MergeOptions& opts_;
  const ModelConfig cfg_;
  std::vector<std::string> shards_;                // input shard paths
  std::map<std::string, TensorEntry> tensors_;     // every tensor of the base
  std::vector<std::string> order_;                 // shard by shard, as stored
  std::string decoder_;                            // the checkpoint's decoder prefix
  std::map<std::string, std::vector<Delta>> deltas_;  // checkpoint tensor → its deltas
  std::size_t placed_ = 0;

  // ---- the base: its shards and tensors (headers only; no shard stays mapped)
  void read_index() {
    const fs::path dir(opts_.base_dir), index = dir / "model.safetensors.index.json";
    if (fs::exists(index)) {
      std::string text;
      read_file_nofollow(index.string(), text);
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(text);
      } catch (const std::exception& e) {
        throw UsageError("merge: " + index.string() + " is not JSON (" + e.what() + ")");
      }
      if (!j.contains("weight_map") || !j["weight_map"].is_object())
        throw UsageError("merge: " + index.string() + " has no weight_map object");
      std::set<std::string> seen;
      for (const auto& [name, file] : j["weight_map"].items())
        if (file.is_string() && seen.insert(file.get<std::string>()).second) shards_.push_back((dir / file.get<std::string>()).string());
      std::sort(shards_.begin(), shards_.end());
    } else if (fs::exists(dir / "model.safetensors")) {
      shards_.push_back((dir / "model.safetensors").string());
    } else {
      throw UsageError("merge: --model " + opts_.base_dir + " has neither model.safetensors nor model.safetensors.index.json");
    }
    for (std::size_t s = 0; s < shards_.size(); ++s) {
      const auto f = st::File::open(shards_[s]);
      for (const auto& t : f->tensors()) {
        if (!tensors_.emplace(t.name, TensorEntry{t, s}).second)
          throw UsageError("merge: tensor '" + t.name + "' is stored twice in " + opts_.base_dir);
        order_.push_back(t.name);
      }
    }
    // gpt-oss's MXFP4 experts: `<name>_blocks` [E, rows, cols/32, 16] and `<name>_scales` become
    // `<name>` [E, cols, rows] in bf16, where the blocks were.
    for (auto it = order_.begin(); it != order_.end(); ++it) {
      const std::string blocks = *it;
      if (!ends_with(blocks, "_blocks")) continue;
      const std::string name = blocks.substr(0, blocks.size() - 7), scales = name + "_scales";
      const auto s = tensors_.find(scales);
      const TensorEntry& b = tensors_.at(blocks);
      if (s == tensors_.end() || b.info.dtype != st::DType::U8 || b.info.shape.size() != 4) continue;
      if (s->second.shard != b.shard)
        throw UsageError("merge: MXFP4 tensor '" + blocks + "' and its '" + scales + "' are in different shards");
      TensorEntry v{b.info, b.shard, blocks, scales};
      v.info.name = name;
      v.info.dtype = st::DType::BF16;
      v.info.shape = {b.info.shape[0], b.info.shape[2] * 32, b.info.shape[1]};
      tensors_.erase(s);
      tensors_.erase(blocks);
      tensors_.emplace(name, v);
      *it = name;
    }
    // bitsandbytes NF4 modules (transformers' save of a 4-bit model, nf4_bnb.h): `P.weight` U8 and
    // `P.weight.*` (absmax, code books, the quant state) become `P.weight` dequantised, where it was.
    const std::string kState = ".quant_state.bitsandbytes__nf4";
    for (const auto& name : order_) {
      if (!ends_with(name, ".weight") || tensors_.at(name).info.dtype != st::DType::U8 || !tensors_.count(name + kState))
        continue;
      TensorEntry& w = tensors_.at(name);
      const auto f = st::File::open(shards_[w.shard]);
      const st::TensorInfo* state = f->find(name + kState);
      if (!state)
        throw UsageError("merge: bitsandbytes module '" + name + "' has its quant state in another shard; not supported");
      const at::Tensor bytes = f->load(name + kState);
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(std::string(reinterpret_cast<const char*>(bytes.data_ptr<std::uint8_t>()),
                                              static_cast<std::size_t>(bytes.numel())));
      } catch (const std::exception& e) {
        throw UsageError("merge: the quant state of bitsandbytes module '" + name + "' is not JSON (" + e.what() + ")");
      }
      if (!j.contains("shape") || !j["shape"].is_array())
        throw UsageError("merge: the quant state of bitsandbytes module '" + name + "' has no shape");
      w.bnb = name.substr(0, name.size() - 7);
      w.info.dtype = st::DType::F32;
      w.info.shape = j["shape"].get<std::vector<std::int64_t>>();
      for (auto it = tensors_.begin(); it != tensors_.end();)  // its quant state
        it = it->first.rfind(name + ".", 0) == 0 ? tensors_.erase(it) : std::next(it);
    }
    order_.erase(std::remove_if(order_.begin(), order_.end(), [&](const std::string& n) { return !tensors_.count(n); }),
                 order_.end());
    decoder_ = "model.";
    if (cfg_.multimodal)
      for (const auto& l : cfg_.multimodal->layouts)
        if (tensors_.count(l.decoder + "embed_tokens.weight")) {
          decoder_ = l.decoder;
          break;
        }
  }

  void refuse_quantised() const {
    for (const auto& name : order_) {
      const st::DType d = tensors_.at(name).info.dtype;
      const bool packed = d == st::DType::U8 || d == st::DType::I8 || d == st::DType::F8_E4M3 || d == st::DType::F8_E5M2;
      if (packed || name.find("quant_state") != std::string::npos)
        throw UsageError("merge: --model " + opts_.base_dir + " is a quantised checkpoint (tensor '" + name + "' is " +
                         st::dtype_name(d) + "); merge into the float checkpoint it was made from (the base_model "
                         "you would train on with load_in_4bit)");
    }
  }

  bool has(const std::string& name) const { return tensors_.count(name) > 0; }

  Storage storage(const std::string& name) const {
    const auto& shape = tensors_.at(name).info.shape;
    if (shape.size() == 2) return Storage::Linear;
    if (shape.size() != 3) return Storage::Other;
    const bool gpt_oss = cfg_.family().expert_storage == ExpertStorage::GptOss;
    if (ends_with(name, ".gate_up_proj"))
      return gpt_oss ? Storage::GateUpTInterleaved : cfg_.llama4 ? Storage::GateUpT : Storage::GateUp;
    if (ends_with(name, ".down_proj")) return gpt_oss || cfg_.llama4 ? Storage::DownT : Storage::Down;
    return Storage::Other;
  }

  // The [out, in] view of `slot` inside `w` (the tensor as stored, fp32).
  at::Tensor view(const at::Tensor& w, Storage s, const Slot& slot) const {
    const std::int64_t I = cfg_.expert_width;
    switch (s) {
      case Storage::Linear: return w;
      case Storage::GateUp: return w.select(0, slot.expert).narrow(0, slot.matrix * I, I);
      case Storage::GateUpT: return w.select(0, slot.expert).t().narrow(0, slot.matrix * I, I);
      case Storage::GateUpTInterleaved: return w.select(0, slot.expert).t().slice(0, slot.matrix, 2 * I, 2);
      case Storage::Down: return w.select(0, slot.expert);
      case Storage::DownT: return w.select(0, slot.expert).t();
      case Storage::Other: break;
    }
    EO_FAIL("merge: no matrix view of a tensor of unknown storage");
  }

  std::vector<Slot> slots(const std::string& name) const {
    const Storage s = storage(name);
    if (s == Storage::Linear) return {Slot{}};
    std::vector<Slot> out;
    const auto E = tensors_.at(name).info.shape[0];
    for (int e = 0; e < E; ++e) {
      if (s == Storage::Down || s == Storage::DownT) out.push_back({e, 2});
      else if (s != Storage::Other) out.insert(out.end(), {{e, 0}, {e, 1}});
    }
    return out;
  }

  // The loader's rule (models/loader.cpp): with load_in_4bit every decoder-block linear is NF4
  // (attention, dense MLP, shared and routed experts); embeddings, norms, routers, gates and
  // lm_head are not, nor any layer the decoder does not run (a multi-token-prediction layer).
  bool block_linear(const std::string& name) const {
    const std::string layers = decoder_ + "layers.";
    if (name.rfind(layers, 0) != 0) return false;
    const std::size_t dot = name.find('.', layers.size());
    if (dot == std::string::npos) return false;
    const std::string index = name.substr(layers.size(), dot - layers.size());
    if (index.empty() || index.find_first_not_of("0123456789") != std::string::npos || std::stoll(index) >= cfg_.layers)
      return false;
    const Storage s = storage(name);
    if (s == Storage::Other) return false;
    if (s != Storage::Linear) return true;  // fused routed experts
    if (!ends_with(name, ".weight")) return false;
    const std::string module = name.substr(0, name.size() - 7);
    const std::string leaf = module.substr(module.rfind('.') + 1);
    static const std::set<std::string> kLinears = {"q_proj",    "k_proj",    "v_proj",    "o_proj",
                                                   "q_a_proj",  "q_b_proj",  "kv_a_proj_with_mqa", "kv_b_proj",
                                                   "gate_proj", "up_proj",   "down_proj"};
    if (kLinears.count(leaf)) return true;
    for (const auto& l : cfg_.family().expert_linears)
      if (leaf == l) return true;
    return false;
  }

  // An adapter module path (transformers' runtime names) as the checkpoint names it: the
  // decoder under the checkpoint's prefix, and the MoE block under either name a family's
  // checkpoints use (Mixtral: block_sparse_moe or mlp).
  std::vector<std::string> candidates(const std::string& module, const std::string& source) const {
    const std::string adapter_decoder = cfg_.decoder_prefix();
    if (module.rfind(adapter_decoder, 0) != 0)
      throw UsageError("merge: adapter tensor '" + source + "' adapts '" + module + "', which is outside the decoder (" +
                       adapter_decoder + "*) of this " + cfg_.model_type + " checkpoint; it cannot be placed");
    const std::string path = decoder_ + module.substr(adapter_decoder.size());
    std::vector<std::string> out{path};
    const std::string block = cfg_.moe_prefix();
    for (const auto& [from, to] : {std::pair<std::string, std::string>{".mlp.", "." + block + "."},
                                   std::pair<std::string, std::string>{"." + block + ".", ".mlp."}})
      if (from != to)
        if (const auto at = path.find(from); at != std::string::npos)
          out.push_back(path.substr(0, at) + to + path.substr(at + from.size()));
    return out;
  }

  void add(const std::string& tensor, Slot slot, const std::string& source, std::function<at::Tensor()> delta) {
    deltas_[tensor].push_back({slot, source, std::move(delta)});
    ++placed_;
  }

  // A plain LoRA module: `<module>.weight`, or a routed expert's linear (experts.{e}.<linear>)
  // inside a fused checkpoint tensor.
  void place_module(const std::string& module, const at::Tensor& A, const at::Tensor& B, double scaling,
                    const std::string& source) {
    auto delta = [A, B, scaling] { return at::matmul(B.to(at::kDouble), A.to(at::kDouble)) * scaling; };
    const auto names = candidates(module, source);
    for (const auto& c : names)
      if (has(c + ".weight") && storage(c + ".weight") == Storage::Linear) return add(c + ".weight", Slot{}, source, delta);
    // experts.{e}.<linear> in a checkpoint that stores the experts fused
    for (const auto& c : names) {
      const auto tail = c.rfind('.'), mid = tail == std::string::npos ? tail : c.rfind('.', tail - 1);
      if (mid == std::string::npos) continue;
      const std::string leaf = c.substr(tail + 1), index = c.substr(mid + 1, tail - mid - 1), experts = c.substr(0, mid);
      if (index.empty() || index.find_first_not_of("0123456789") != std::string::npos) continue;
      const auto& lin = cfg_.family().expert_linears;
      const int mi = static_cast<int>(std::find(lin.begin(), lin.end(), leaf) - lin.begin());
      if (mi >= 3) continue;
      const std::string fused = experts + (mi == 2 ? ".down_proj" : ".gate_up_proj");
      if (has(fused) && storage(fused) != Storage::Other) return add(fused, Slot{std::stoi(index), mi}, source, delta);
    }
    throw UsageError("merge: adapter tensor '" + source + "' adapts '" + module + "', but the base checkpoint has no '" +
                     names.front() + ".weight' (nor a fused expert tensor holding it); the adapter was trained on "
                     "another model, or this layout is not one eo-ddp merges");
  }

  // peft's ParamWrapper on a fused expert parameter (lora_target_parameters): expert e's ΔW in
  // eo-ddp's [out, in] form (gate rows first) through ExpertLora, the layout's one reader.
  void place_fused(const std::string& head, const std::string& param, const at::Tensor& A, const at::Tensor& B,
                   const LoraSpec& spec, const std::string& source) {
    const bool gate_up = param == "gate_up_proj";
    const std::int64_t H = cfg_.hidden, I = cfg_.expert_width;
    const std::int64_t in = gate_up ? H : I, out = gate_up ? 2 * I : H;
    FusedExpertLayout layout = cfg_.family().fused_layout;
    layout.gate_up_interleaved &= gate_up;  // down_proj's rows are H plain outputs (as MoeModel::add_lora)
    const int E = static_cast<int>(A.size(0));
    auto expert_delta = [A, B, spec, in, out, layout](int e) {
      ExpertLora l(1, in, out, spec, at::Device(at::kCPU), layout);
      l.A() = A.narrow(0, e, 1).to(at::kFloat);
      l.B() = B.narrow(0, e, 1).to(at::kFloat);
      return l.delta_weight(at::kDouble).select(0, 0);
    };
    // The experts module as the checkpoint names it: the fused parameters' path, or the
    // family's experts path (Mixtral's block_sparse_moe.experts).
    std::vector<std::string> heads = candidates(head, source);
    const std::string fp = cfg_.fused_experts_path(), ep = cfg_.experts_path();
    if (fp != ep && ends_with(head, "." + fp))
      for (const auto& c : candidates(head.substr(0, head.size() - fp.size()) + ep, source)) heads.push_back(c);
    for (const auto& h : heads) {
      const std::string fused = h + "." + param;
      if (has(fused) && storage(fused) != Storage::Other) {
        for (int e = 0; e < E; ++e)
          for (int mi : gate_up ? std::vector<int>{0, 1} : std::vector<int>{2})
            add(fused, Slot{e, mi}, source, [expert_delta, e, mi, I] {
              const at::Tensor d = expert_delta(e);
              return mi == 2 ? d : d.narrow(0, mi * I, I);
            });
        return;
      }
      const auto& lin = cfg_.family().expert_linears;
      if (!has(h + ".0." + lin[gate_up ? 0 : 2] + ".weight")) continue;
      for (int e = 0; e < E; ++e)
        for (int mi : gate_up ? std::vector<int>{0, 1} : std::vector<int>{2}) {
          const std::string name = h + "." + std::to_string(e) + "." + lin[mi] + ".weight";
          if (!has(name))
            throw UsageError("merge: adapter tensor '" + source + "' adapts expert " + std::to_string(e) +
                             ", but the base checkpoint has no '" + name + "'");
          add(name, Slot{}, source, [expert_delta, e, mi, I] {
            const at::Tensor d = expert_delta(e);
            return mi == 2 ? d : d.narrow(0, mi * I, I);
          });
        }
      return;
    }
    throw UsageError("merge: adapter tensor '" + source + "' adapts the fused expert parameter '" + head + "." + param +
                     "', but the base checkpoint has neither '" + heads.front() + "." + param + "' nor per-expert '" +
                     heads.front() + ".{e}." + cfg_.family().expert_linears[gate_up ? 0 : 2] + ".weight' tensors");
  }

  void place_adapter() {
    const LoraSpec spec = read_adapter_config(opts_.adapter_dir);
    const fs::path file = fs::path(opts_.adapter_dir) / "adapter_model.safetensors";
    if (!fs::exists(file))
      throw UsageError("merge: --adapter " + opts_.adapter_dir + " has no adapter_model.safetensors (a peft adapter folder)");
    NamedLora peft;
    {
      const auto f = st::File::open(file.string());
      for (const auto& t : f->tensors()) peft.emplace_back(t.name, f->load(t.name));
    }
    const double scaling = spec.scaling();
    // Factors by module: the lone lora_A / lora_B of peft's names, or the stacked / fused forms.
    std::map<std::string, std::pair<at::Tensor, at::Tensor>> plain, stacked, fused;
    std::map<std::string, std::string> source;
    for (const auto& [name, t] : stack_expert_lora(peft, &spec)) {
      if (name.rfind(kPeftPrefix, 0) != 0)
        throw UsageError("merge: adapter tensor '" + name + "' is not named as peft names LoRA (base_model.model.*)");
      const std::string rest = name.substr(std::string(kPeftPrefix).size());
      bool matched = false;
      const std::pair<const char*, std::map<std::string, std::pair<at::Tensor, at::Tensor>>*> forms[] = {
          {".weight", &plain}, {".stacked", &stacked}, {".fused", &fused}};
      for (const auto& [tail, into] : forms)
        for (const char ab : {'A', 'B'}) {
          const std::string suffix = std::string(".lora_") + ab + tail;
          if (matched || !ends_with(rest, suffix)) continue;
          const std::string module = rest.substr(0, rest.size() - suffix.size());
          (ab == 'A' ? (*into)[module].first : (*into)[module].second) = t;
          source[module] = name;
          matched = true;
        }
      if (!matched)
        throw UsageError("merge: adapter tensor '" + name + "' is not a LoRA factor (lora_A / lora_B) eo-ddp can merge");
    }
    auto both = [&](const std::string& module, const std::pair<at::Tensor, at::Tensor>& f) {
      if (!f.first.defined() || !f.second.defined())
        throw UsageError("merge: adapter tensor '" + source[module] + "' has no " + (f.first.defined() ? "lora_B" : "lora_A") +
                         " partner; the adapter file is incomplete");
    };
    for (const auto& [module, f] : plain) {
      both(module, f);
      place_module(module, f.first, f.second, scaling, source[module]);
    }
    for (const auto& [key, f] : stacked) {  // <experts>.<linear>: [E, r, in], [E, out, r]
      both(key, f);
      const std::string experts = key.substr(0, key.rfind('.')), linear = key.substr(key.rfind('.') + 1);
      for (std::int64_t e = 0; e < f.first.size(0); ++e)
        place_module(experts + "." + std::to_string(e) + "." + linear, f.first[e], f.second[e], scaling, source[key]);
    }
    for (const auto& [key, f] : fused) {  // <experts>.<param>
      both(key, f);
      place_fused(key.substr(0, key.rfind('.')), key.substr(key.rfind('.') + 1), f.first, f.second, spec, source[key]);
    }
    if (placed_ == 0) throw UsageError("merge: adapter " + opts_.adapter_dir + " holds no LoRA tensor");
  }

  // ---- the merged tensors, written shard by shard
  at::Tensor merged(const st::File& f, const std::string& name, MergeSummary& sum) const {
    const TensorEntry& entry = tensors_.at(name);
    const bool mxfp4 = !entry.blocks.empty();
    const bool bnb = !entry.bnb.empty();
    at::Tensor t;
    if (mxfp4) {
      t = mxfp4::dequantize(f.load(entry.blocks), f.load(entry.scales)).transpose(1, 2).contiguous();
    } else if (bnb) {  // as the loader reads it: the stored bytes are the weight trained on, never re-quantised
      const auto q = nf4::from_bitsandbytes([&f](const std::string& n) { return f.load(n); },
                                            [&f](const std::string& n) { return f.find(n) != nullptr; }, entry.bnb);
      t = eo::dequantize(q, at::kFloat).contiguous();
    } else {
      t = f.load(name);
    }
    sum.mxfp4 += mxfp4 ? 1 : 0;
    const bool floating = at::isFloatingType(t.scalar_type());
    const auto d = deltas_.find(name);
    // As trained, MXFP4 experts are their MXFP4 values unless expert_quant: nf4 re-quantised them.
    const bool requantise =
        opts_.as_trained && floating && block_linear(name) && !bnb && (!mxfp4 || opts_.expert_quant == "nf4");
    if (d == deltas_.end() && !requantise) return floating ? t.to(opts_.dtype).contiguous() : t;
    at::Tensor w = t.to(at::kFloat).contiguous();
    const Storage s = storage(name);
    if (requantise)
      for (const Slot& slot : slots(name)) {
        at::Tensor v = view(w, s, slot);
        v.copy_(nf4::dequantize(nf4::quantize(v.contiguous(), opts_.blocksize, opts_.double_quant), at::kFloat));
        ++sum.requantised;
      }
    if (d != deltas_.end()) {
      for (const Delta& delta : d->second) {
        at::Tensor v = view(w, s, delta.slot);
        const at::Tensor dw = delta.delta();
        if (dw.sizes() != v.sizes())
          throw UsageError("merge: adapter tensor '" + delta.source + "' gives a delta of shape " + shape_text(dw.sizes()) +
                           " for '" + name + "'" + (delta.slot.expert >= 0 ? " expert " + std::to_string(delta.slot.expert) : "") +
                           ", whose matrix is " + shape_text(v.sizes()) + "; the adapter was trained on another model");
        v.copy_(v.to(at::kDouble) + dw);  // W + s·B·A in float64, rounded once
        ++sum.deltas;
      }
      ++sum.merged;
    }
    return w.to(opts_.dtype).contiguous();
  }

  static std::string shape_text(at::IntArrayRef s) {
    std::string out = "[";
    for (std::size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
    return out + "]";
  }

  std::uint64_t out_bytes(const st::TensorInfo& t) const {
    std::uint64_t n = 1;
    for (auto x : t.shape) n *= static_cast<std::uint64_t>(x);
    const bool floating = t.dtype == st::DType::F16 || t.dtype == st::DType::BF16 || t.dtype == st::DType::F32 ||
                          t.dtype == st::DType::F64;
    return n * (floating ? c10::elementSize(opts_.dtype) : st::dtype_size(t.dtype));
  }

  MergeSummary write() {
    MergeSummary sum;
    // Output shards planned up front (their count names every file), in stored order.
    std::vector<std::size_t> out_shard(order_.size());
    std::vector<std::uint64_t> shard_bytes{0};
    for (std::size_t i = 0; i < order_.size(); ++i) {
      const std::uint64_t b = out_bytes(tensors_.at(order_[i]).info);
      if (shard_bytes.back() > 0 && shard_bytes.back() + b > opts_.max_shard_bytes) shard_bytes.push_back(0);
      shard_bytes.back() += b;
      out_shard[i] = shard_bytes.size() - 1;
    }
    const std::size_t n = shard_bytes.size();
    auto file_name = [n](std::size_t k) {
      if (n == 1) return std::string("model.safetensors");
      char buf[64];
      std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", k + 1, n);
      return std::string(buf);
    };
    fs::create_directories(opts_.output_dir);
    nlohmann::json weight_map = nlohmann::json::object();
    std::vector<std::pair<std::string, at::Tensor>> batch;
    std::shared_ptr<st::File> in;
    std::size_t in_shard = shards_.size();
    for (std::size_t i = 0; i < order_.size(); ++i) {
      const TensorEntry& entry = tensors_.at(order_[i]);
      if (entry.shard != in_shard) {  // the previous input shard is unmapped here
        in.reset();
        in = st::File::open(shards_[entry.shard]);
        in_shard = entry.shard;
      }
      batch.emplace_back(order_[i], merged(*in, order_[i], sum));
      sum.bytes += batch.back().second.nbytes();
      weight_map[order_[i]] = file_name(out_shard[i]);
      if (i + 1 == order_.size() || out_shard[i + 1] != out_shard[i]) {
        st::save((fs::path(opts_.output_dir) / file_name(out_shard[i])).string(), batch);
        sum.tensors += batch.size();
        batch.clear();
#if defined(__GLIBC__)
        ::malloc_trim(0);  // the shard's freed buffers back to the system, not kept for the next one
#endif
        ++sum.shards;
      }
    }
    in.reset();
    if (n > 1) {
      nlohmann::json index = {{"metadata", {{"total_size", sum.bytes}}}, {"weight_map", weight_map}};
      write_file_atomic((fs::path(opts_.output_dir) / "model.safetensors.index.json").string(), index.dump(2) + "\n");
    }
    write_config();
    return sum;
  }

  // config.json as the base's, with the dtype written and no quantization_config (every weight
  // is written in opts_.dtype).
  void write_config() const {
    std::string text;
    read_file_nofollow((fs::path(opts_.base_dir) / "config.json").string(), text);
    nlohmann::ordered_json j = nlohmann::ordered_json::parse(text);
    const std::string dtype = opts_.dtype == at::kBFloat16 ? "bfloat16" : opts_.dtype == at::kHalf ? "float16" : "float32";
    j.erase("quantization_config");
    j["dtype"] = dtype;
    if (j.contains("torch_dtype")) j["torch_dtype"] = dtype;
    for (const char* sub : {"text_config", "vision_config", "audio_config"})
      if (j.contains(sub) && j[sub].is_object()) {
        j[sub].erase("quantization_config");
        if (j[sub].contains("dtype")) j[sub]["dtype"] = dtype;
        if (j[sub].contains("torch_dtype")) j[sub]["torch_dtype"] = dtype;
      }
    write_file_atomic((fs::path(opts_.output_dir) / "config.json").string(), j.dump(2) + "\n");
  }
};

}  // namespace

MergeSummary merge_adapter(const MergeOptions& options) { return Merger(options).run(); }

}  // namespace eo::model
