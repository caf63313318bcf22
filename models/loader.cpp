// Building a MoeModel from a Hugging Face checkpoint: the parts of every block, handed to its
// constructor (the LoRA adapters are moe_model_lora.cpp's).
//
// Per-expert (`experts.{e}.gate_proj.weight`, Mixtral `experts.{e}.w1.weight`) and fused
// (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]; gpt-oss and Llama 4 [E, H, 2I] /
// [E, I, H]; Llama 4 per expert as axolotl's linearized `experts.gate_projs.{e}`) checkpoints map onto
// one internal layout. load_in_4bit quantises every decoder-block linear; embeddings, norms,
// routers, the shared-expert gate and lm_head stay unquantised.
//
// Checkpoints bitsandbytes already quantised (transformers' save_pretrained of a 4-bit model:
// `P.weight` U8 + `P.weight.quant_state.bitsandbytes__nf4` ..., see nf4_bnb.h) are taken as
// they are: a stored NF4 linear becomes the QuantizedWeight with the file's bytes and absmax
// (never re-quantised, so the stored blocksize / double quantisation win over LoadOptions);
// without load_in_4bit it is dequantised to the compute dtype. Any linear may be stored either
// way (mixed checkpoints).
//
// modelopt NVFP4 checkpoints (`P.weight` U8 + `P.weight_scale` F8_E4M3 + `P.weight_scale_2`, see
// nvfp4.h) likewise: routed experts keep their NVFP4 bytes (with or without load_in_4bit; with
// expert_quant: nf4 they are re-quantised), other decoder-block linears keep them with
// load_in_4bit and are dequantised to the compute dtype without it, as is any other NVFP4 tensor.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#ifdef EO_WITH_CUDA
#include <ATen/cuda/CUDAGeneratorImpl.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <optional>
#include <sstream>

#include "common/error.h"
#include "common/log.h"
#include "common/progress_meter.h"
#include "common/text.h"
#include "models/load_checks.h"
#include "models/moe_model.h"
#include "models/mxfp4.h"
#include "models/nf4.h"
#include "models/nf4_bnb.h"
#include "models/nvfp4.h"
#include "models/safetensors.h"

namespace eo::model {

namespace {

std::string shape_str(at::IntArrayRef s) {
  std::ostringstream os;
  os << "[";
  for (std::size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  return os.str() + "]";
}

QuantizedWeight to_device(QuantizedWeight q, const at::Device& d) {
  q.packed = q.packed.to(d);
  if (q.absmax.defined()) q.absmax = q.absmax.to(d);
  if (q.scales.defined()) q.scales = q.scales.to(d);
  if (q.global_scale.defined()) q.global_scale = q.global_scale.to(d);
  if (q.nested) {
    q.nested->absmax_codes = q.nested->absmax_codes.to(d);
    q.nested->nested_absmax = q.nested->nested_absmax.to(d);
    q.nested->nested_code = q.nested->nested_code.to(d);
  }
  return q;
}

// Seeded random base weights for synthetic models (benchmarks on real shapes, no download).
class RandomWeights {
 public:
  // `on_cpu`: drawn by the CPU's generator (then copied to `device`), the same numbers on any device.
  RandomWeights(std::uint64_t seed, const at::Device& device, double init_range, bool on_cpu)
      : device_(on_cpu ? at::Device(at::kCPU) : device), target_(device), init_range_(init_range) {
#ifdef EO_WITH_CUDA
    if (device_.is_cuda()) {
      gen_ = at::make_generator<at::CUDAGeneratorImpl>(device.index());
      gen_.set_current_seed(seed);
      return;
    }
#endif
    gen_ = at::make_generator<at::CPUGeneratorImpl>(seed);
  }
  // norms 1 (Gemma's layernorm_1 / _2 too), scales 1 (Gemma's router scales, layer_scalar), biases 0
  // (e_score_correction_bias too), everything else N(0, init_range).
  at::Tensor dense(const std::string& name, const std::vector<std::int64_t>& shape, at::ScalarType dtype) {
    const auto o = at::TensorOptions().dtype(dtype).device(device_);
    if (ends_with(name, "norm.weight") || name.find("layernorm") != std::string::npos || ends_with(name, "scale") ||
        ends_with(name, "layer_scalar"))
      return at::ones(shape, o.device(target_));
    if (ends_with(name, "bias")) return at::zeros(shape, o.device(target_));
    return at::randn(shape, gen_, o.dtype(at::kFloat)).mul_(init_range_).to(target_, dtype);
  }
  // Uniform NF4 codes; absmax varies ±25% around the value that gives the weights a standard
  // deviation of init_range (the codes' RMS is about 0.52).
  QuantizedWeight nf4(const std::vector<std::int64_t>& shape, int blocksize, at::ScalarType dtype) {
    double sq = 0;
    for (float c : nf4::kCode) sq += double(c) * c;
    const double scale = init_range_ / std::sqrt(sq / 16.0);
    QuantizedWeight q;
    q.shape = shape;
    q.blocksize = blocksize;
    q.dtype = dtype;
    const auto u8 = at::TensorOptions().dtype(at::kByte).device(device_);
    q.packed = at::randint(0, 256, {(q.numel() + 1) / 2, 1}, gen_, u8);
    q.absmax = at::rand({q.nblocks()}, gen_, u8.dtype(at::kFloat)).mul_(0.5).add_(0.75).mul_(scale);
    return q;
  }
  // Uniform MXFP4 codes; per group a scale 2^(s - 127) of the nearest power of two to the one that
  // gives the weights a standard deviation of init_range (the codes' RMS is sqrt(8.5625)), or half
  // of it (one random bit per group).
  QuantizedWeight mxfp4(const std::vector<std::int64_t>& shape) {
    const std::int64_t groups = shape[1] / mxfp4::kGroup;
    const auto u8 = at::TensorOptions().dtype(at::kByte).device(device_);
    const int top = std::clamp(127 + static_cast<int>(std::lround(std::log2(init_range_ / std::sqrt(8.5625)))), 1, 254);
    const at::Tensor blocks = at::randint(0, 256, {shape[0], groups, 16}, gen_, u8);
    const at::Tensor scales = at::randint(top - 1, top + 1, {shape[0], groups}, gen_, u8);  // top - 1 or top
    return mxfp4::weight(blocks, scales);
  }
  // Uniform NVFP4 codes; a global scale of 1/448 and per 16 values an E4M3 scale within ±25% of
  // the one that gives the weights a standard deviation of init_range (the codes' RMS is sqrt(8.5625)).
  QuantizedWeight nvfp4(const std::vector<std::int64_t>& shape) {
    const auto u8 = at::TensorOptions().dtype(at::kByte).device(device_);
    const double scale = init_range_ * 448.0 / std::sqrt(8.5625);
    const at::Tensor codes = at::randint(0, 256, {shape[0], shape[1] / 2}, gen_, u8);
    const at::Tensor scales = at::rand({shape[0], shape[1] / nvfp4::kGroup}, gen_, u8.dtype(at::kFloat))
                                  .mul_(0.5).add_(0.75).mul_(scale).to(at::kFloat8_e4m3fn);
    return nvfp4::weight(codes, scales, at::full({1}, 1.0f / 448.0f, u8.dtype(at::kFloat)));
  }

 private:
  static bool ends_with(const std::string& s, const std::string& tail) {
    return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
  }
  at::Device device_;  // where the numbers are drawn
  at::Device target_;  // where dense() puts them (the 4-bit ones the loader moves)
  double init_range_;
  at::Generator gen_;
};

struct ModelLoader {
  const st::Checkpoint* ck;  // null: random weights
  RandomWeights* random;
  const LoadOptions& opts;
  const ModelConfig& cfg;
  // Stored bitsandbytes modules seen, for the summary log lines at the end.
  mutable int stored_nf4 = 0, stored_dequantised = 0, stored_other_layout = 0, mxfp4_dequantised = 0, mxfp4_kept = 0;
  mutable int nvfp4_kept = 0, nvfp4_dequantised = 0, nvfp4_requantised = 0;
  // The loading line: layers done, matrices quantised to NF4 so far.
  mutable ProgressMeter meter{ProgressMeter::kPlainEvery};
  mutable int layers_done = 0, quantised = 0;
  std::uint64_t checkpoint_bytes = 0;  // every tensor's bytes, all shards (ck->total_bytes())

  // "loading  layer 12/48  shard 3/13  read 9.80 GiB of 57.00 GiB  2.1 GB/s  quantised 1536 matrices to NF4"
  std::string progress_line(bool done) const {
    std::string line = std::string(done ? "loaded " : "loading") + "  layer " + std::to_string(layers_done) + "/" +
                       std::to_string(cfg.layers);
    if (ck) {
      const double read = double(ck->bytes_read());
      line += "  shard " + std::to_string(ck->shards_read()) + "/" + std::to_string(ck->shards()) + "  read " +
              human_bytes(read) + " of " + human_bytes(double(checkpoint_bytes)) + "  " + rate_text(read, meter.elapsed_s());
    } else {
      line += "  synthetic weights";
    }
    if (quantised > 0) line += "  quantised " + std::to_string(quantised) + " matrices to NF4";
    return line;
  }
  void show_progress() const {
    if (meter.due()) meter.show(progress_line(false));
  }

  at::Tensor raw(const std::string& name, std::vector<std::int64_t> shape) const {
    if (!ck) return random->dense(name, shape, opts.dtype);
    if (!ck->has(name))
      throw Error("checkpoint " + ck->folder() + ": tensor '" + name + "' is missing (expected shape " + shape_str(shape) +
                  "); does config.json match the weights?");
    at::Tensor t = ck->load(name);
    // modelopt's NVFP4 linear that lost its global scale: say so, not that it is no bitsandbytes module.
    const std::string module = name.size() > 7 && name.compare(name.size() - 7, 7, ".weight") == 0 ? name.substr(0, name.size() - 7) : "";
    if (t.scalar_type() == at::kByte && !module.empty() && ck->has(module + ".weight_scale"))
      throw Error("checkpoint " + ck->folder() + ": NVFP4 module '" + module + "' has '" + module + ".weight' and '" +
                  module + ".weight_scale' but no '" + module + ".weight_scale_2' (its float32 global scale): the "
                  "checkpoint is incomplete; download or export it again");
    if (!at::isFloatingType(t.scalar_type()))
      throw Error("checkpoint " + ck->folder() + ": tensor '" + name + "' is " + std::string(at::toString(t.scalar_type())) +
                  ", not floating point, and carries no bitsandbytes nf4 quant state ('" + name +
                  ".quant_state.bitsandbytes__nf4'); only float weights and bitsandbytes 4-bit modules can be loaded");
    if (t.sizes() != at::IntArrayRef(shape))
      throw Error("checkpoint " + ck->folder() + ": tensor '" + name + "' has shape " + shape_str(t.sizes()) +
                  ", expected " + shape_str(shape));
    check_finite_input(ck->folder(), name, t);
    return t;
  }

  // Module `prefix` as stored by bitsandbytes (CPU tensors), or nullopt when its weight is a
  // plain float tensor. fp4 and damaged quant states throw (nf4_bnb names the module).
  std::optional<QuantizedWeight> stored_4bit(const std::string& prefix, const std::vector<std::int64_t>& shape) const {
    if (!ck) return std::nullopt;
    const nf4::TensorExists has = [this](const std::string& n) { return ck->has(n); };
    if (!nf4::is_bitsandbytes_4bit(has, prefix)) return std::nullopt;
    QuantizedWeight q = nf4::from_bitsandbytes([this](const std::string& n) { return ck->load(n); }, has, prefix);
    if (q.shape != shape)
      throw Error("checkpoint " + ck->folder() + ": bitsandbytes module '" + prefix + "' has shape " + shape_str(q.shape) +
                  ", expected " + shape_str(shape) + "; does config.json match the weights?");
    return q;
  }

  // Module `prefix` as modelopt stores an NVFP4 linear (CPU tensors, shapes checked), or nullopt
  // when it has no `prefix.weight_scale_2`.
  std::optional<QuantizedWeight> stored_nvfp4(const std::string& prefix, const std::vector<std::int64_t>& shape) const {
    if (!ck || !ck->has(prefix + ".weight_scale_2")) return std::nullopt;
    const std::int64_t out = shape[0], in = shape[1];
    auto load = [&](const std::string& n, at::ScalarType dt, const std::vector<std::int64_t>& want) {
      if (!ck->has(n)) throw Error("checkpoint " + ck->folder() + ": NVFP4 module '" + prefix + "' has no tensor '" + n + "'");
      at::Tensor t = ck->load(n);
      if (t.scalar_type() != dt || t.sizes() != at::IntArrayRef(want))
        throw Error("checkpoint " + ck->folder() + ": NVFP4 tensor '" + n + "' is " + std::string(at::toString(t.scalar_type())) +
                    " " + shape_str(t.sizes()) + ", expected " + std::string(at::toString(dt)) + " " + shape_str(want) +
                    " (modelopt's layout for a [" + std::to_string(out) + ", " + std::to_string(in) + "] linear)");
      return t;
    };
    if (in % nvfp4::kGroup != 0)
      throw Error("checkpoint " + ck->folder() + ": NVFP4 module '" + prefix + "' has " + std::to_string(in) +
                  " input features, not a multiple of 16");
    const at::Tensor global = ck->load(prefix + ".weight_scale_2");
    if (global.scalar_type() != at::kFloat || global.numel() != 1)
      throw Error("checkpoint " + ck->folder() + ": NVFP4 tensor '" + prefix + ".weight_scale_2' is " +
                  std::string(at::toString(global.scalar_type())) + " " + shape_str(global.sizes()) +
                  ", expected one float32 (the global scale)");
    check_nvfp4_global_scale(ck->folder(), prefix + ".weight_scale_2", global.item<float>());
    const at::Tensor scales = load(prefix + ".weight_scale", at::kFloat8_e4m3fn, {out, in / nvfp4::kGroup});
    check_e4m3_scales(ck->folder(), prefix + ".weight_scale", scales);
    return nvfp4::weight(load(prefix + ".weight", at::kByte, {out, in / 2}), scales, global);
  }

  // Frozen tensor in the compute dtype on the device; `P.weight` of a bitsandbytes module is
  // dequantised (e.g. a router someone chose to quantise), as is an NVFP4 one.
  // `dtype` overrides the compute dtype (routers some families keep in fp32).
  at::Tensor get(const std::string& name, std::vector<std::int64_t> shape, std::optional<at::ScalarType> dtype = {}) const {
    const at::ScalarType dt = dtype.value_or(opts.dtype);
    static const std::string kWeight = ".weight";
    if (name.size() > kWeight.size() && name.compare(name.size() - kWeight.size(), kWeight.size(), kWeight) == 0)
      if (auto q = stored_4bit(name.substr(0, name.size() - kWeight.size()), shape)) {
        ++stored_dequantised;
        return eo::dequantize(*q, dt).to(opts.device).contiguous();
      } else if (auto n = stored_nvfp4(name.substr(0, name.size() - kWeight.size()), shape)) {
        ++nvfp4_dequantised;
        return eo::dequantize(*n, dt).to(opts.device).contiguous();
      }
    if (!ck) return random->dense(name, shape, dt);
    return raw(name, std::move(shape)).to(opts.device, dt).contiguous();
  }
  // An RMSNorm's weight as the decoder multiplies by it: the stored one, or 1 + it where the family's
  // norms are zero-centred (ModelConfig::norm_plus_one; added in fp32, then the compute dtype).
  // Synthetic weights: 1 either way.
  at::Tensor norm(const std::string& name, std::int64_t dim) const {
    if (!cfg.norm_plus_one || !ck) return get(name, {dim});
    return (get(name, {dim}, at::kFloat) + 1.0).to(opts.dtype);
  }
  QuantizedWeight quantize(const at::Tensor& w, bool on_host = false) const {
    ++quantised;
    show_progress();
    // On the target device: a GPU quantises with the CUDA kernel (same bytes as the CPU path).
    return to_device(nf4::quantize(w.to(opts.device, opts.dtype).contiguous(), opts.blocksize, opts.double_quant),
                     on_host ? at::Device(at::kCPU) : opts.device);
  }
  // The NF4 weight of decoder-block linear `prefix`: the stored bitsandbytes bytes as they are,
  // else the float weight quantised with LoadOptions' settings.
  // A stored NVFP4 linear keeps its bytes (the 4-bit weight eo-ddp holds may be NVFP4).
  QuantizedWeight nf4_weight(const std::string& prefix, const std::vector<std::int64_t>& shape, bool on_host = false) const {
    if (auto q = stored_nvfp4(prefix, shape)) {
      ++nvfp4_kept;
      return to_device(std::move(*q), on_host ? at::Device(at::kCPU) : opts.device);
    }
    if (auto q = stored_4bit(prefix, shape)) {
      ++stored_nf4;
      if (q->blocksize != opts.blocksize || q->nested.has_value() != opts.double_quant) ++stored_other_layout;
      return to_device(std::move(*q), on_host ? at::Device(at::kCPU) : opts.device);
    }
    if (!ck) return to_device(random->nf4(shape, opts.blocksize, opts.dtype), on_host ? at::Device(at::kCPU) : opts.device);
    return quantize(raw(prefix + ".weight", shape), on_host);
  }
  FrozenLinear linear(const std::string& prefix, std::int64_t in, std::int64_t out, bool bias, bool quantizable) const {
    FrozenLinear l;
    l.in = in;
    l.out = out;
    if (opts.load_in_4bit && quantizable) {
      l.q = std::make_unique<QuantizedWeight>(nf4_weight(prefix, {out, in}));
    } else {
      l.weight = get(prefix + ".weight", {out, in});
      // Decoded from NVFP4: its global scale is the grid nvfp4_merge_aware snaps to.
      if (ck && ck->has(prefix + ".weight_scale_2"))
        l.nvfp4_global = ck->load(prefix + ".weight_scale_2").to(at::kFloat).reshape({1}).to(opts.device);
    }
    if (bias) l.bias = get(prefix + ".bias", {out});
    return l;
  }
  Mlp mlp(const std::string& prefix, std::int64_t width) const {
    const auto H = cfg.hidden;
    const bool b = cfg.mlp_bias;
    return Mlp{linear(prefix + ".gate_proj", H, width, b, true), linear(prefix + ".up_proj", H, width, b, true),
               linear(prefix + ".down_proj", width, H, b, true), cfg.act};
  }
  // Where the checkpoint stores the decoder and lm_head: model.* and lm_head.weight, or one of a
  // multimodal wrapper's layouts (the first whose embeddings it has).
  mutable std::optional<MultimodalWrapper::Layout> layout_;
  const MultimodalWrapper::Layout& layout() const {
    if (layout_) return *layout_;
    layout_ = MultimodalWrapper::Layout{"model.", "lm_head.weight"};
    if (const auto& w = cfg.multimodal) {
      layout_ = w->layouts.front();
      for (const auto& l : w->layouts)
        if (ck && ck->has(l.decoder + "embed_tokens.weight")) {
          layout_ = l;
          break;
        }
    }
    return *layout_;
  }
  // Layer i's tensor name prefix, "model.layers.{i}." (multimodal checkpoints: under the text model).
  std::string layer_prefix(int i) const { return layout().decoder + "layers." + std::to_string(i) + "."; }

  // A gated delta-rule layer (ModelConfig::LinearAttention), its linears under linear_attn.
  void linear_attention(BlockWeights& b, const std::string& p) const {
    const LinearAttention& a = *cfg.linear_attn;
    const std::string la = p + "linear_attn.";
    for (const auto& l : cfg.attention_shapes(b.index))
      b.attention_linear(l.name) = linear(la + l.name, l.in, l.out, false, true);
    b.conv_w = get(la + "conv1d.weight", {a.conv_width(), 1, a.conv_kernel}).squeeze(1);
    // Kept in fp32 as transformers reads them (A_log.float(), and softplus(a.float() + dt_bias)).
    b.dt_bias = get(la + "dt_bias", {a.v_heads}, at::kFloat);
    b.a_log = get(la + "A_log", {a.v_heads}, at::kFloat);
    b.gated_norm = get(la + "norm.weight", {a.v_dim});
  }

  // Attention of one block: q/k/v/o (with the family's norms), or DeepSeek's latent attention.
  void attention(BlockWeights& b, const std::string& p) const {
    const ModelConfig& c = cfg;
    const auto H = c.hidden, D = c.head_dim;
    if (c.is_linear_attention_layer(b.index)) return linear_attention(b, p);
    if (c.mla) {
      const Mla& a = *c.mla;
      if (a.q_lora_rank > 0) {
        b.q_a = linear(p + "self_attn.q_a_proj", H, a.q_lora_rank, c.qkv_bias, true);
        b.q_a_norm = get(p + "self_attn.q_a_layernorm.weight", {a.q_lora_rank});
        b.q = linear(p + "self_attn.q_b_proj", a.q_lora_rank, c.heads * a.qk_dim(), false, true);
      } else {
        b.q = linear(p + "self_attn.q_proj", H, c.heads * a.qk_dim(), false, true);
      }
      b.kv_a = linear(p + "self_attn.kv_a_proj_with_mqa", H, a.kv_lora_rank + a.rope_dim, c.qkv_bias, true);
      b.kv_a_norm = get(p + "self_attn.kv_a_layernorm.weight", {a.kv_lora_rank});
      b.kv_b = linear(p + "self_attn.kv_b_proj", a.kv_lora_rank, c.heads * (a.nope_dim + a.v_dim), false, true);
      b.o = linear(p + "self_attn.o_proj", c.heads * a.v_dim, H, c.o_bias, true);
      return;
    }
    if (c.gemma) {  // per layer type: its head_dim and key-value heads, v_proj unless attention_k_eq_v
      const int i = b.index;
      const std::int64_t d = c.head_dim_at(i), kv = c.kv_heads_at(i);
      b.q = linear(p + "self_attn.q_proj", H, c.heads * d, false, true);
      b.k = linear(p + "self_attn.k_proj", H, kv * d, false, true);
      if (c.has_v_proj(i)) b.v = linear(p + "self_attn.v_proj", H, kv * d, false, true);
      b.o = linear(p + "self_attn.o_proj", c.heads * d, H, false, true);
      b.q_norm = get(p + "self_attn.q_norm.weight", {d});
      b.k_norm = get(p + "self_attn.k_norm.weight", {d});
      return;
    }
    b.q = linear(p + "self_attn.q_proj", H, c.heads * D * (c.attn_output_gate ? 2 : 1), c.qkv_bias, true);
    b.k = linear(p + "self_attn.k_proj", H, c.kv_heads * D, c.qkv_bias, true);
    b.v = linear(p + "self_attn.v_proj", H, c.kv_heads * D, c.qkv_bias, true);
    b.o = linear(p + "self_attn.o_proj", c.heads * D, H, c.o_bias, true);
    if (c.attention_sinks) b.sinks = get(p + "self_attn.sinks", {c.heads});
    if (c.qk_norm == QkNorm::PerHead) {
      b.q_norm = norm(p + "self_attn." + c.family().q_norm + ".weight", D);
      b.k_norm = norm(p + "self_attn." + c.family().k_norm + ".weight", D);
    } else if (c.qk_norm == QkNorm::Whole) {
      b.q_norm = get(p + "self_attn.q_norm.weight", {c.heads * D});
      b.k_norm = get(p + "self_attn.k_norm.weight", {c.kv_heads * D});
    }
  }

  // A module path of the architecture table (under layer i) as this checkpoint names it: Mixtral
  // checkpoints use block_sparse_moe, transformers v5's runtime names use mlp; accept either.
  std::string in_checkpoint(int i, const std::string& path) const {
    const std::string base = layer_prefix(i), block = cfg.moe_prefix();
    if (ck && block != "mlp" && path.rfind(block, 0) == 0 && !ck->has(base + cfg.router_path() + ".weight") &&
        ck->has(base + "mlp" + cfg.router_path().substr(block.size()) + ".weight"))
      return base + "mlp" + path.substr(block.size());
    return base + path;
  }
  std::string moe_prefix(int i) const { return in_checkpoint(i, cfg.moe_prefix()); }
  // Where layer i's routed experts are: "<moe prefix>.experts", Gemma 4 "layers.{i}.experts".
  std::string experts_prefix(int i) const { return in_checkpoint(i, cfg.experts_path()); }

  // An MXFP4 expert tensor as stored: `name`_blocks [E, rows, cols/32, 16] and `name`_scales
  // [E, rows, cols/32] (uint8, checked).
  std::pair<at::Tensor, at::Tensor> mxfp4_tensors(const std::string& name, std::int64_t E, std::int64_t rows,
                                                  std::int64_t cols) const {
    if (cols % 32 != 0)
      throw Error("checkpoint " + ck->folder() + ": MXFP4 tensor '" + name + "_blocks' needs a multiple of 32 columns, not " +
                  std::to_string(cols));
    // Blocks and scales are read as MXFP4 only where config.json says so: another format with the
    // same tensor names (mxfp8) would decode to other numbers without a word.
    if (!cfg.mxfp4_experts)
      throw UsageError("checkpoint " + ck->folder() + ": '" + name + "_blocks' / '_scales' are block-quantised, but "
                       "config.json's quantization_config does not say quant_method: mxfp4, the only such format eo-ddp "
                       "reads; use a checkpoint in MXFP4 or in float");
    if (ck->has(name))
      throw UsageError("checkpoint " + ck->folder() + ": '" + name + "' is stored both in float and as MXFP4 ('" + name +
                       "_blocks'); which one is the model is ambiguous: remove one");
    const auto load_u8 = [&](const std::string& n, const std::vector<std::int64_t>& shape) {
      if (!ck->has(n)) throw Error("checkpoint " + ck->folder() + ": tensor '" + n + "' is missing (MXFP4 experts)");
      at::Tensor t = ck->load(n);
      if (t.scalar_type() != at::kByte || t.sizes() != at::IntArrayRef(shape))
        throw Error("checkpoint " + ck->folder() + ": tensor '" + n + "' is " + std::string(at::toString(t.scalar_type())) +
                    " " + shape_str(t.sizes()) + ", expected uint8 " + shape_str(shape));
      return t;
    };
    at::Tensor scales = load_u8(name + "_scales", {E, rows, cols / 32});
    check_e8m0_scales(ck->folder(), name + "_scales", scales);
    return {load_u8(name + "_blocks", {E, rows, cols / 32, 16}), std::move(scales)};
  }
  // The same dequantised and transposed as transformers does: bf16 [E, cols, rows].
  at::Tensor mxfp4_experts(const std::string& name, std::int64_t E, std::int64_t rows, std::int64_t cols) const {
    const auto [blocks, scales] = mxfp4_tensors(name, E, rows, cols);
    ++mxfp4_dequantised;
    return mxfp4::dequantize(blocks, scales).transpose(1, 2).contiguous();
  }

  // Whether layer i's experts stay in MXFP4 (LoadOptions::expert_quant): they must be stored so
  // (random weights: config.json says so), and load_in_4bit must be on.
  bool keep_mxfp4(int i) const {
    if (!opts.load_in_4bit || opts.expert_quant == ExpertQuant::Nf4) return false;
    const std::string p = experts_prefix(i);
    const bool stored = cfg.family().expert_storage == ExpertStorage::GptOss &&
                        (ck ? ck->has(p + ".gate_up_proj_blocks") && ck->has(p + ".down_proj_blocks") : cfg.mxfp4_experts);
    if (!stored && opts.expert_quant == ExpertQuant::Mxfp4)
      throw UsageError((ck ? "checkpoint " + ck->folder() : std::string("the synthetic weights")) +
                       ": expert_quant: mxfp4 keeps experts in MXFP4 as the checkpoint stores them, but layer " +
                       std::to_string(i) + "'s experts are not MXFP4 (no '" + p +
                       ".gate_up_proj_blocks' / '.down_proj_blocks'); use expert_quant: nf4 or auto");
    return stored;
  }
  // Layer i's experts as the checkpoint's MXFP4 bytes, re-arranged losslessly into eo-ddp's
  // [out, in] matrices (models/mxfp4.h): gate = the even rows of gate_up_proj, up = the odd rows,
  // down = down_proj; each row keeps its 32-groups along `in`.
  std::vector<std::array<QuantizedWeight, 3>> mxfp4_bank(int i) const {
    const auto E = cfg.experts, H = cfg.hidden, I = cfg.expert_width;
    const at::Device home = opts.experts_on_host ? at::Device(at::kCPU) : opts.device;
    std::vector<std::array<QuantizedWeight, 3>> out(E);
    if (!ck) {
      if (H % mxfp4::kGroup || I % mxfp4::kGroup)
        throw UsageError("synthetic MXFP4 experts need hidden_size and intermediate_size multiples of 32, got " +
                         std::to_string(H) + " and " + std::to_string(I) + "; use expert_quant: nf4");
      for (auto& e : out)
        for (int mi = 0; mi < 3; ++mi) e[mi] = to_device(random->mxfp4(expert_shape(mi)), home);
      mxfp4_kept += 2;
      return out;
    }
    const std::string p = experts_prefix(i);
    const auto [gu_blocks, gu_scales] = mxfp4_tensors(p + ".gate_up_proj", E, 2 * I, H);
    const auto [down_blocks, down_scales] = mxfp4_tensors(p + ".down_proj", E, H, I);
    for (int e = 0; e < E; ++e) {
      out[e][0] = to_device(mxfp4::weight(gu_blocks[e].slice(0, 0, 2 * I, 2), gu_scales[e].slice(0, 0, 2 * I, 2)), home);
      out[e][1] = to_device(mxfp4::weight(gu_blocks[e].slice(0, 1, 2 * I, 2), gu_scales[e].slice(0, 1, 2 * I, 2)), home);
      out[e][2] = to_device(mxfp4::weight(down_blocks[e], down_scales[e]), home);
    }
    mxfp4_kept += 2;
    return out;
  }

  // Whether layer i's routed experts are stored in NVFP4 (expert 0's gate projection says; the
  // others must agree) and stay so: always, unless load_in_4bit with expert_quant: nf4.
  // Synthetic weights: NVFP4 when config.json says so.
  bool stored_nvfp4_experts(int i) const {
    if (!ck) return cfg.nvfp4 && !(opts.load_in_4bit && opts.expert_quant == ExpertQuant::Nf4);
    return cfg.family().expert_storage != ExpertStorage::GptOss && ck->has(expert_prefix(i, 0, 0) + ".weight_scale_2");
  }
  // Layer i's experts as the checkpoint's NVFP4 bytes, on their home (the device, or host RAM with
  // expert offload); expert_quant: nf4 re-quantises them from their fp32 values.
  std::vector<std::array<QuantizedWeight, 3>> nvfp4_bank(int i) const {
    const at::Device home = opts.experts_on_host ? at::Device(at::kCPU) : opts.device;
    const bool requantise = opts.load_in_4bit && opts.expert_quant == ExpertQuant::Nf4;
    std::vector<std::array<QuantizedWeight, 3>> out(cfg.experts);
    for (int e = 0; e < cfg.experts; ++e)
      for (int mi = 0; mi < 3; ++mi) {
        const std::string prefix = expert_prefix(i, e, mi);
        if (!ck) {
          if (expert_shape(mi)[1] % nvfp4::kGroup)
            throw UsageError("synthetic NVFP4 experts need hidden_size and moe_intermediate_size multiples of 16");
          out[e][mi] = to_device(random->nvfp4(expert_shape(mi)), home);
          ++nvfp4_kept;
          continue;
        }
        auto q = stored_nvfp4(prefix, expert_shape(mi));
        if (!q)
          throw Error("checkpoint " + ck->folder() + ": layer " + std::to_string(i) + "'s experts are NVFP4 ('" +
                      expert_prefix(i, 0, 0) + ".weight_scale_2'), but '" + prefix + "' is not (no '.weight_scale_2')");
        if (requantise) {
          out[e][mi] = quantize(eo::dequantize(*q, at::kFloat), opts.experts_on_host);
          ++nvfp4_requantised;
        } else {
          out[e][mi] = to_device(std::move(*q), home);
          ++nvfp4_kept;
        }
      }
    return out;
  }

  // Experts of layer i. Fused layout: [E][matrix] float views (CPU, checkpoint dtype). Per-expert
  // layout: empty; the matrices load one by one through expert_prefix (they may be bnb-quantised).
  std::vector<std::array<at::Tensor, 3>> fused_experts(int i) const {
    const ModelConfig& c = cfg;
    const auto E = c.experts, H = c.hidden, I = c.expert_width;
    const std::string p = experts_prefix(i);
    if (cfg.family().expert_storage == ExpertStorage::GptOss) {
      // gpt-oss's own layout, the only one it has: transposed [E, H, 2I] with gate and up
      // interleaved (gate = columns 0, 2, 4, ...), down [E, I, H]; or MXFP4 as the Hub ships it.
      if (!ck) return {};
      const at::Tensor gu = ck->has(p + ".gate_up_proj_blocks") ? mxfp4_experts(p + ".gate_up_proj", E, 2 * I, H)
                                                                : raw(p + ".gate_up_proj", {E, H, 2 * I});
      const at::Tensor down = ck->has(p + ".down_proj_blocks") ? mxfp4_experts(p + ".down_proj", E, H, I)
                                                               : raw(p + ".down_proj", {E, I, H});
      std::vector<std::array<at::Tensor, 3>> out(E);
      for (int e = 0; e < E; ++e)
        out[e] = {gu[e].slice(1, 0, 2 * I, 2).t(), gu[e].slice(1, 1, 2 * I, 2).t(), down[e].t()};
      return out;
    }
    if (!ck || !ck->has(p + ".gate_up_proj")) return {};  // per-expert names (experts.{e}.gate_proj ...)
    for (const char* name : {".gate_up_proj", ".down_proj"}) {
      // transformers saves bnb 4-bit experts per expert; a quantised fused tensor is not a format we know.
      const bool bnb_keys = ck->has(p + name + ".absmax") || ck->has(p + name + ".quant_state.bitsandbytes__nf4") ||
                            ck->has(p + name + ".quant_state.bitsandbytes__fp4");
      if (bnb_keys || (ck->has(p + name) && ck->info(p + name).dtype == st::DType::U8))
        throw UsageError("checkpoint " + ck->folder() + ": fused expert tensor '" + p + name +
                         "' is quantised; bitsandbytes checkpoints store experts per expert (experts.{e}.gate_proj...), "
                         "a quantised fused layout is not supported. Use the original float weights with load_in_4bit");
    }
    std::vector<std::array<at::Tensor, 3>> out(E);
    if (c.llama4) {
      // Llama4TextExperts: x @ gate_up_proj [E, H, 2I] (gate = columns [0, I), up = [I, 2I)),
      // then @ down_proj [E, I, H].
      const at::Tensor gu = raw(p + ".gate_up_proj", {E, H, 2 * I}), down = raw(p + ".down_proj", {E, I, H});
      for (int e = 0; e < E; ++e) out[e] = {gu[e].narrow(1, 0, I).t(), gu[e].narrow(1, I, I).t(), down[e].t()};
      return out;
    }
    const at::Tensor gu = raw(p + ".gate_up_proj", {E, 2 * I, H}), down = raw(p + ".down_proj", {E, H, I});
    for (int e = 0; e < E; ++e) out[e] = {gu[e].narrow(0, 0, I), gu[e].narrow(0, I, I), down[e]};
    return out;
  }
  std::string expert_prefix(int i, int e, int mi) const {
    // Llama 4 per expert: axolotl's linearized checkpoints (Llama4TextExperts as ModuleLists,
    // experts.gate_projs.{e}, up_projs, down_projs; bitsandbytes-quantised as they ship).
    static const char* kLinearized[3] = {"gate_projs", "up_projs", "down_projs"};
    if (cfg.llama4) return experts_prefix(i) + "." + kLinearized[mi] + "." + std::to_string(e);
    return experts_prefix(i) + "." + std::to_string(e) + "." + cfg.family().expert_linears[mi];
  }
  // gpt-oss's expert biases, [E, out] per matrix (gate, up interleaved in gate_up_proj_bias).
  std::array<at::Tensor, 3> expert_biases(int i) const {
    const auto E = cfg.experts, H = cfg.hidden, I = cfg.expert_width;
    const std::string p = experts_prefix(i);
    const at::Tensor gu = get(p + ".gate_up_proj_bias", {E, 2 * I}), down = get(p + ".down_proj_bias", {E, H});
    return {gu.slice(1, 0, 2 * I, 2).contiguous(), gu.slice(1, 1, 2 * I, 2).contiguous(), down};
  }
  // A router's e_score_correction_bias [E] (Family::correction_bias says where); ERNIE-4.5 stores it
  // [1, E], one row per expert group, of which it has one.
  at::Tensor correction_bias(int i, const std::string& router) const {
    const char* at_row = cfg.family().correction_bias;
    const std::string name = at_row ? in_checkpoint(i, at_row) : router + ".e_score_correction_bias";
    if (ck && ck->has(name) && ck->info(name).shape.size() == 2) return get(name, {1, cfg.experts}, at::kFloat).reshape({cfg.experts});
    return get(name, {cfg.experts}, at::kFloat);
  }
  std::vector<std::int64_t> expert_shape(int mi) const {
    const auto H = cfg.hidden, I = cfg.expert_width;
    return mi == 2 ? std::vector<std::int64_t>{H, I} : std::vector<std::int64_t>{I, H};
  }

  ModelWeights run() {
    const ModelConfig& c = cfg;
    const auto H = c.hidden;
    if (opts.expert_quant != ExpertQuant::Auto && !opts.load_in_4bit)
      throw UsageError("expert_quant applies with load_in_4bit: true; without it the experts are loaded in " +
                       std::string(at::toString(opts.dtype)));
    const std::string mp = layout().decoder;
    if (c.multimodal)
      log::info((ck ? ck->folder() : std::string("synthetic weights")) + ": a multimodal " + c.model_type + " checkpoint (" +
                c.multimodal->class_name + "); its " + c.multimodal->text_model_type + " text model (" + mp +
                "*) is loaded and trained, its " + c.other_towers +
                " not loaded and not trained (the adapter covers the text model only)");
    if (ck) checkpoint_bytes = ck->total_bytes();
    ModelWeights w;
    w.embed = get(mp + "embed_tokens.weight", {c.vocab, H});
    if (opts.embeddings_on_host && opts.device.is_cuda() && !c.tie_word_embeddings) w.embed = w.embed.to(at::kCPU);
    w.final_norm = norm(mp + "norm.weight", H);
    w.lm_head = c.tie_word_embeddings ? w.embed : get(layout().lm_head, {c.vocab, H});
    ResidentWeights::Bank bank(c.layers);
    for (int i = 0; i < c.layers; ++i) {
      BlockWeights b;
      b.index = i;
      b.moe = c.is_moe_layer(i);
      b.quantized = opts.load_in_4bit;
      b.bank_bytes = opts.expert_bank_bytes;
      const std::string p = layer_prefix(i);
      b.input_norm = norm(p + "input_layernorm.weight", H);
      b.post_norm = norm(p + "post_attention_layernorm.weight", H);
      attention(b, p);
      if (c.gemma) {  // the dense MLP and norms beside the experts, the router's scales, the layer scalar
        b.dense = mlp(p + "mlp", c.dense_width);
        b.pre_ff_norm = get(p + "pre_feedforward_layernorm.weight", {H});
        b.post_ff_norm = get(p + "post_feedforward_layernorm.weight", {H});
        b.post_ff_norm_1 = get(p + "post_feedforward_layernorm_1.weight", {H});
        b.pre_ff_norm_2 = get(p + "pre_feedforward_layernorm_2.weight", {H});
        b.post_ff_norm_2 = get(p + "post_feedforward_layernorm_2.weight", {H});
        b.router_scale = get(p + "router.scale", {H});
        b.per_expert_scale = get(p + "router.per_expert_scale", {c.experts});
        b.layer_scalar = get(p + "layer_scalar", {1});
      }
      if (!b.moe) {
        b.dense = mlp(p + c.mlp_prefix(), c.dense_width);
      } else {
        // fp16 keeps the router in fp32 too: its logits feed a softmax whose range fp16 lacks.
        const std::optional<at::ScalarType> router_dtype =
            c.router.fp32 || opts.dtype == at::kHalf ? std::optional<at::ScalarType>(at::kFloat) : std::nullopt;
        const std::string router = in_checkpoint(i, c.router_path());
        b.router = get(router + ".weight", {c.experts, H}, router_dtype);
        if (c.router.bias) b.router_b = get(router + ".bias", {c.experts}, router_dtype);
        if (c.router.correction_bias) b.router_bias = correction_bias(i, router);
        if (c.expert_bias) b.expert_bias = expert_biases(i);
        if (keep_mxfp4(i)) {
          bank[i] = mxfp4_bank(i);
        } else if (stored_nvfp4_experts(i)) {
          bank[i] = nvfp4_bank(i);
          b.quantized = true;  // held 4-bit even without load_in_4bit: the checkpoint's bytes
          b.nvfp4_experts = !bank[i].empty() && bank[i][0][0].format == QuantFormat::Nvfp4;  // not re-quantised to NF4
        } else if (const auto fused = fused_experts(i); opts.load_in_4bit) {
          bank[i].resize(c.experts);
          for (int e = 0; e < c.experts; ++e)
            for (int mi = 0; mi < 3; ++mi)
              bank[i][e][mi] = fused.empty() ? nf4_weight(expert_prefix(i, e, mi), expert_shape(mi), opts.experts_on_host)
                                             : quantize(fused[e][mi], opts.experts_on_host);
        } else {
          for (int mi = 0; mi < 3; ++mi) {
            std::vector<at::Tensor> per;
            for (int e = 0; e < c.experts; ++e)
              per.push_back(fused.empty() ? get(expert_prefix(i, e, mi) + ".weight", expert_shape(mi)) : fused[e][mi]);
            b.experts[mi] = at::stack(per).to(opts.device, opts.dtype).contiguous();
          }
        }
        if (c.shared_expert_width > 0) {
          b.has_shared = true;
          b.shared = mlp(p + c.mlp_prefix() + "." + c.shared_expert_name(), c.shared_expert_width);
          if (c.shared_expert_gated) b.shared_gate = linear(p + "mlp.shared_expert_gate", H, 1, false, /*quantizable=*/false);
        }
      }
      w.blocks.push_back(std::move(b));
      ++layers_done;
      show_progress();
    }
    char took[32];
    std::snprintf(took, sizeof took, "  in %.1f s", meter.elapsed_s());
    meter.finish(progress_line(true) + took);
    w.provider = std::make_shared<ResidentWeights>(std::move(bank));
    const std::string source = ck ? ck->folder() : std::string("synthetic weights");
    if (mxfp4_kept > 0 && !ck)
      log::info(source + ": experts held in MXFP4 (random codes and scales: config.json's quant_method is mxfp4)");
    else if (mxfp4_kept > 0)
      log::info(source + ": experts held in MXFP4, the checkpoint's own bytes (" + std::to_string(mxfp4_kept) +
                " expert tensors, 4.25 bits per weight: lossless with respect to the checkpoint), dequantised to bf16 on "
                "the fly; expert_quant: nf4 would re-quantise them to NF4");
    if (mxfp4_dequantised > 0)
      log::info(source + ": " + std::to_string(mxfp4_dequantised) + " MXFP4 expert tensors dequantised to bf16" +
                (opts.load_in_4bit ? ", then quantised to NF4 (expert_quant: nf4); experts held in NF4" : ""));
    if (nvfp4_kept > 0 && !ck)
      log::info(source + ": experts held in NVFP4 (random codes and scales: config.json's quant_method is modelopt NVFP4)");
    else if (nvfp4_kept > 0)
      log::info(source + ": " + std::to_string(nvfp4_kept) + " NVFP4 linears held in NVFP4, the checkpoint's own bytes (4.5 bits "
                "per weight: lossless with respect to the checkpoint), dequantised on the fly");
    if (nvfp4_requantised > 0)
      log::info(source + ": " + std::to_string(nvfp4_requantised) + " NVFP4 expert matrices dequantised and quantised to NF4 "
                "(expert_quant: nf4)");
    if (nvfp4_dequantised > 0)
      log::info(source + ": " + std::to_string(nvfp4_dequantised) + " NVFP4 tensors dequantised to " +
                std::string(at::toString(opts.dtype)) + (opts.load_in_4bit ? " (they are not decoder-block linears)" : ""));
    if (stored_nf4 > 0)
      log::info(ck->folder() + ": " + std::to_string(stored_nf4) + " linears are bitsandbytes nf4 already; using their "
                "stored bytes (no re-quantisation)");
    if (stored_other_layout > 0)
      log::info(ck->folder() + ": " + std::to_string(stored_other_layout) + " bitsandbytes 4-bit modules keep their stored "
                "blocksize / double quantisation, which differ from the requested blocksize " +
                std::to_string(opts.blocksize) + (opts.double_quant ? " with" : " without") + " double quantisation");
    if (stored_dequantised > 0)
      log::info(ck->folder() + ": " + std::to_string(stored_dequantised) + " bitsandbytes 4-bit modules dequantised to " +
                std::string(at::toString(opts.dtype)) +
                (opts.load_in_4bit ? " (they are not decoder-block linears)" : " because load_in_4bit is off"));
    return w;
  }
};

}  // namespace

ExpertQuant expert_quant_named(const std::string& name) {
  if (name == "auto") return ExpertQuant::Auto;
  if (name == "nf4") return ExpertQuant::Nf4;
  if (name == "mxfp4") return ExpertQuant::Mxfp4;
  throw UsageError("expert_quant must be auto, nf4 or mxfp4, got '" + name + "'");
}

std::unique_ptr<MoeModel> MoeModel::load(const std::string& model_dir, const LoadOptions& opts) {
  return load(model_dir, load_config(model_dir), opts);
}

std::unique_ptr<MoeModel> MoeModel::load(const std::string& model_dir, const ModelConfig& config, const LoadOptions& opts) {
  if (opts.dtype != at::kFloat && opts.dtype != at::kBFloat16 && opts.dtype != at::kHalf)
    throw UsageError("model dtype must be fp32, bf16 or fp16");
  if (opts.random_seed) {
    if (opts.double_quant) log::warn("synthetic weights are drawn as plain NF4 (no double quantisation)");
    RandomWeights random(*opts.random_seed, opts.device, config.initializer_range, opts.random_on_cpu);
    return std::make_unique<MoeModel>(config, opts, ModelLoader{nullptr, &random, opts, config}.run());
  }
  const st::Checkpoint ck = st::Checkpoint::open(model_dir);
  return std::make_unique<MoeModel>(config, opts, ModelLoader{&ck, nullptr, opts, config}.run());
}

}  // namespace eo::model
