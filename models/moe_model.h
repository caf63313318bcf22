// The MoE decoder (qwen3_moe, olmoe, mixtral, qwen2_moe, glm4_moe, deepseek_v2/v3, gpt_oss, glm4_moe_lite,
// mistral4, gemma4, llama4, qwen3_next, qwen3_5_moe) on libtorch, with frozen base weights
// (dense or NF4), LoRA adapters and transformers-compatible loss and router aux loss.
//
// Each DecoderBlock::forward can run on its own so a checkpointing wrapper can drive the blocks
// one at a time: embed() → context() → block(i).forward(...) for every i → head() → loss.
// A MoE block reads its experts through a WeightProvider; whoever runs the block stages it first
// (MoeModel::forward does; the training step follows its schedule, runtime/schedule.h).
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "models/hf_config.h"
#include "models/linear4bit.h"
#include "models/lora.h"
#include "models/nf4.h"
#include "models/weights.h"

namespace eo::model {

class KvCache;  // models/kv_cache.h

// How load_in_4bit holds the routed experts. Auto: MXFP4 where the checkpoint's experts are
// MXFP4 (kept as stored: lossless), else NF4. Nf4: always NF4 (MXFP4 experts are dequantised to
// bf16 first, as transformers' Mxfp4Config(dequantize=True) does, then quantised). Mxfp4: keep the
// checkpoint's MXFP4 experts; an error for a checkpoint without them.
enum class ExpertQuant { Auto, Nf4, Mxfp4 };
// The config key's names "auto", "nf4", "mxfp4"; UsageError for any other.
ExpertQuant expert_quant_named(const std::string& name);

struct LoadOptions {
  at::ScalarType dtype = at::kFloat;  // compute dtype of the frozen weights (fp32 or bf16)
  bool load_in_4bit = false;          // NF4 for every decoder-block linear (the experts: expert_quant)
  int blocksize = 64;
  bool double_quant = false;
  ExpertQuant expert_quant = ExpertQuant::Auto;  // with load_in_4bit
  at::Device device = at::kCPU;
  // Keep the experts' NF4 weights in CPU memory (the offload engine moves them into its homes),
  // so device memory never holds every expert at once, not even while loading.
  bool experts_on_host = false;
  // Seeded random weights from config.json alone (no safetensors read): NF4 bytes drawn
  // uniformly on the device with absmax scaled to the config's initializer_range, norms 1
  // (MXFP4 experts: uniform codes, scales for the same spread).
  std::optional<std::uint64_t> random_seed;
  // Draw them with the CPU's generator whatever the device, then copy: a GPU model then equals the
  // CPU model of the same seed (tests that hold a GPU path to the CPU's); slow for large models.
  bool random_on_cpu = false;
  // On a GPU, keep the input embedding table (frozen, read a few rows per step) in host memory
  // and copy only the gathered rows: vocab x hidden of device memory saved. Not with tied
  // embeddings (the lm_head needs the table on the device).
  bool embeddings_on_host = true;
  // NF4 experts on a GPU: dequantise each grouped GEMM's bank in slices of at most this many
  // bytes (linear4bit.h, ExpertBank::max_bytes); 0 = the whole bank at once.
  std::int64_t expert_bank_bytes = 0;
};

// A frozen linear: dense or module-owned NF4 weight, optional bias, optional LoRA.
struct FrozenLinear {
  at::Tensor weight;                           // dense [out, in]; undefined when quantised
  std::unique_ptr<QuantizedWeight> q;     // NF4; heap-held so handles stay valid
  at::Tensor bias;
  std::shared_ptr<LoraAdapter> lora;
  std::int64_t in = 0, out = 0;
  // A dense weight decoded from the checkpoint's NVFP4: its global scale (weight_scale_2, fp32 [1]),
  // the grid nvfp4_merge_aware snaps to; undefined otherwise.
  at::Tensor nvfp4_global;
  // nvfp4_merge_aware (MoeModel::enable_merge_aware): while *merge_aware is true the forward is
  // x · Q(W + scaling · B A)^T (models/merge_aware.h); null = plain LoRA.
  const std::atomic<bool>* merge_aware = nullptr;
  at::Tensor forward(const at::Tensor& x, bool training) const;
  // The global scale the merge-aware forward snaps to (q's for an NVFP4-held weight); undefined
  // when the weight is not NVFP4.
  at::Tensor nvfp4_grid() const;
};

struct Mlp {
  FrozenLinear gate, up, down;
  Activation act = Activation::Silu;
  at::Tensor forward(const at::Tensor& x, bool training) const;  // down(act(gate(x)) * up(x))
};

// act(gate) · up for the activation of the family (the fused SwiGLU, or GELU's tanh form).
at::Tensor gated_activation(const at::Tensor& gate, const at::Tensor& up, Activation act);

// Per-forward inputs shared by every block.
struct BlockContext {
  // [B, T, rotary dims] in the compute dtype (models/fused.h: rope). Gemma 4: the sliding layers'
  // table, then the full layers' along the last dim (one tensor, so a graph takes it as one input).
  at::Tensor cos, sin;
  at::Tensor attn_mask;  // bool [B, 1, T, T], true = attend; undefined = plain causal
  // Packed rows where flash's variable-length form runs (models/attention_path.h): int32 document
  // starts over the B·T tokens, which the layers whose path is Varlen read instead of attn_mask.
  at::Tensor document_starts;
  // Sliding layers (no sinks) attend through flash's local window (models/attention_path.h): flash
  // runs here, and no padding mask or packing mask applies to them. False: the window as a mask.
  bool flash_windows = false;
  at::Tensor q_scale;    // [B, 1, T, 1] per-position query factor (Mistral 4; Llama 4's NoPE layers, fp32); undefined = none
  at::Tensor chunk_mask;  // Llama 4's chunked layers: attn_mask within chunks; undefined = attn_mask
  bool training = false;
  std::vector<at::Tensor>* router_logits = nullptr;  // when set, MoE blocks append [B*T, E]
  // Delta-rule layers (Qwen3-Next, Qwen3.5): the packed rows' document ids (int64 [B, T]; undefined:
  // one document per row), where the conv1d's window and the recurrent state restart, and the
  // padding mask ([B, T, 1] in the compute dtype, 0 at padding; undefined: none), which zeroes
  // padded tokens' input as transformers' apply_mask_to_padding_states.
  at::Tensor segment_ids, token_mask;
  // Incremental decoding (models/kv_cache.h): each attention layer appends its keys and values
  // (delta-rule layers: carry their conv and recurrent state) and attends over the cached ones;
  // attn_mask is then [1, 1, T, cached + T]. Null: the forward sees the whole sequence.
  KvCache* cache = nullptr;
};

// One decoder layer as the loader assembles it (models/loader.cpp) and MoeModel's constructor
// hands it to its DecoderBlock; MoeModel's LoRA code fills the adapters later.
struct BlockWeights {
  int index = 0;
  bool moe = false;
  bool quantized = false;
  bool nvfp4_experts = false;  // the experts are held in the checkpoint's NVFP4
  std::int64_t bank_bytes = 0;  // LoadOptions::expert_bank_bytes
  at::Tensor input_norm, post_norm, q_norm, k_norm;
  FrozenLinear q, k, v, o;  // q: q_proj, or MLA's q_b_proj when q_lora_rank is set
  FrozenLinear q_a, kv_a, kv_b;     // MLA: q_a_proj, kv_a_proj_with_mqa, kv_b_proj
  at::Tensor q_a_norm, kv_a_norm;   // MLA: q_a_layernorm, kv_a_layernorm
  Mlp dense;                        // dense layers
  at::Tensor router;                // [E, H] (fp32 when the family keeps its router in fp32)
  at::Tensor router_bias;           // [E] fp32 e_score_correction_bias (sigmoid routers)
  at::Tensor router_b;              // [E] the router linear's bias (gpt-oss)
  at::Tensor sinks;                 // [heads] attention sink logits (gpt-oss)
  std::array<at::Tensor, 3> expert_bias;  // per ExpertMatrix [E, out] (gpt-oss); undefined without
  std::array<at::Tensor, 3> experts;  // dense mode: [E, out, in] per ExpertMatrix
  std::array<std::shared_ptr<ExpertLora>, 3> expert_lora;  // per ExpertMatrix, all experts stacked
  // lora_target_parameters' gate_up_proj: one LoRA on the fused [gate; up] matrix, B [E, 2I, r]
  // (rows [0, I) gate, [I, 2I) up), so gate and up share A [E, r, H], as peft's ParamWrapper on
  // transformers 5's gate_up_proj defines it. Its down_proj is expert_lora[Down] (the same math
  // as a per-expert down_proj LoRA; only the saved layout differs).
  std::shared_ptr<ExpertLora> gate_up_lora;
  bool has_shared = false;
  Mlp shared;
  FrozenLinear shared_gate;  // shared_expert_gate [1, H] (qwen2_moe, Qwen3-Next, Qwen3.5); never quantised
  // Gemma 4 (ModelConfig::Gemma4Block): the feed-forward norms, router scales and layer scalar.
  at::Tensor pre_ff_norm, post_ff_norm, post_ff_norm_1, pre_ff_norm_2, post_ff_norm_2;
  at::Tensor router_scale, per_expert_scale, layer_scalar;
  // A gated delta-rule layer (ModelConfig::linear_attn): Qwen3-Next's in_proj_qkvz and in_proj_ba,
  // or Qwen3.5's in_proj_qkv (in in_qkvz), in_proj_z, in_proj_b (in in_ba) and in_proj_a; out_proj is o.
  FrozenLinear in_qkvz, in_ba, in_z, in_a;
  at::Tensor conv_w;           // [conv width, kernel] (conv1d.weight without its middle dim)
  at::Tensor dt_bias, a_log;   // [value heads]
  at::Tensor gated_norm;       // [value head dim]: the gated RMSNorm's weight (not zero-centred)
  // The linear named `name` (attention_shapes' names) of this layer's attention or delta-rule
  // layer; UsageError for a name it has none of.
  FrozenLinear& attention_linear(const std::string& name);
};

class DecoderBlock {
 public:
  // cfg outlives the block (its MoeModel's).
  DecoderBlock(const ModelConfig& cfg, BlockWeights w) : cfg_(&cfg), w_(std::move(w)) {}
  at::Tensor forward(const at::Tensor& hidden, const BlockContext& ctx) const;
  int index() const { return w_.index; }
  bool is_moe() const { return w_.moe; }
  // Whether the expert LoRA (if any) can run as grouped GEMMs beside the base grouped GEMM.
  bool expert_lora_grouped_ok() const;

  // For the owning MoeModel (the world sees blocks as const): the weights and adapter slots, and
  // the settings MoeModel's setters pass on.
  BlockWeights& weights() { return w_; }
  void set_weight_provider(WeightProvider* provider) { provider_ = provider; }
  void set_bank_reuse(BankReuse reuse) { bank_reuse_ = reuse; }
  void set_merge_aware(const std::atomic<bool>* on) { merge_aware_ = on; }

 private:
  at::Tensor attention(const at::Tensor& x, const BlockContext& ctx) const;
  at::Tensor latent_attention(const at::Tensor& x, const BlockContext& ctx) const;  // DeepSeek MLA
  at::Tensor linear_attention(const at::Tensor& x, const BlockContext& ctx) const;  // models/linear_attention.cpp
  // Routed experts (and shared ones) on x; the router reads router_in (Gemma 4: the un-normed
  // residual), x when undefined.
  at::Tensor moe(const at::Tensor& x, const BlockContext& ctx, const at::Tensor& router_in = at::Tensor()) const;
  at::Tensor gemma_forward(const at::Tensor& hidden, const BlockContext& ctx) const;
  // The router on flat tokens [N, H]: top-k weights (fp32) and expert indices, both [N, k].
  std::pair<at::Tensor, at::Tensor> route(const at::Tensor& flat, const BlockContext& ctx) const;
  // Per ExpertMatrix, then the fused gate_up LoRA at index 3; empty without LoRA.
  using ExpertLoraSlices = std::array<ExpertLora::Slices, 4>;
  at::Tensor expert(int e, const at::Tensor& x, bool training, const ExpertLoraSlices& lora) const;
  // Every expert on its slice of token-sorted rows x_sorted (expert_of: the expert of each
  // (token, slot) pair, any order; only its counts are used). The output is y + delta, where the
  // grouped path leaves the down LoRA's delta apart for the combine to add (undefined otherwise).
  // The grouped path's expert LoRA reads x_lora, the same rows as x_sorted (gather_rows_twice:
  // its gradient is summed in the dispatch's backward); the loop reads x_sorted only.
  struct ExpertsOutput {
    at::Tensor y, delta;
  };
  ExpertsOutput experts_forward(const at::Tensor& x_sorted, const at::Tensor& x_lora, const at::Tensor& expert_of,
                                bool training) const;
  // nvfp4_merge_aware on (this block's NVFP4 experts carry LoRA and the model's switch is on).
  bool merge_aware_now() const;
  // The merge-aware experts: each LoRA-carrying NVFP4 matrix bank dequantised, its delta added and
  // snapped (Q, straight-through), then every expert on its rows (host counts, like the loop).
  at::Tensor experts_merge_aware(const at::Tensor& x_sorted, const at::Tensor& expert_of, bool training) const;

  const ModelConfig* cfg_ = nullptr;
  BlockWeights w_;
  const std::atomic<bool>* merge_aware_ = nullptr;  // MoeModel::enable_merge_aware; null = plain LoRA
  BankReuse bank_reuse_ = BankReuse::None;  // MoeModel::set_bank_reuse
  WeightProvider* provider_ = nullptr;
};

struct Batch {
  at::Tensor input_ids;       // int64 [B, T]
  at::Tensor labels;          // int64 [B, T], -100 = ignore; undefined = no loss
  at::Tensor attention_mask;  // [B, T] 1 = token, 0 = padding; optional
  at::Tensor positions;       // int64 [B, T]; optional (default 0..T-1)
  at::Tensor segment_ids;     // int64 [B, T] document ids of packed sequences; optional
  // model::packed_document_starts of the host segment ids, on the device; optional. Used where
  // flash's variable-length form runs; the packing mask is built only for layers that need it.
  at::Tensor document_starts;
};

struct ForwardOptions {
  bool training = false;
  bool aux_loss = false;  // compute transformers' load_balancing_loss over all MoE layers
};

struct ForwardOutput {
  at::Tensor logits;      // [B, T, V] compute dtype
  at::Tensor loss_sum;    // fp32 scalar: summed shifted CE over counted tokens (if labels)
  std::int64_t tokens = 0;  // counted tokens (label != -100 after the shift)
  at::Tensor aux_loss;    // raw load-balancing loss (transformers' outputs.aux_loss); the
                          // training loss adds config().router_aux_loss_coef × aux_loss
};

// One LoRA-able linear: its peft module name and where its adapter lives (its own adapter, or
// slice `expert` of its MoE block's stacked adapter for that matrix).
struct LoraSite {
  std::string module;      // e.g. model.layers.0.self_attn.q_proj, model.layers.0.mlp.experts.3.up_proj
  std::string short_name;  // e.g. q_proj, gate_proj, w1
  std::int64_t in = 0, out = 0;
  std::shared_ptr<LoraAdapter>* slot = nullptr;
  std::shared_ptr<ExpertLora>* stack = nullptr;  // experts: the block's stacked adapter
  int expert = -1, experts = 0;
  std::string stack_prefix;  // experts: model.layers.{i}.<moe prefix>.experts
  std::string param;         // a fused expert parameter (kGateUpParam / kDownParam): the whole stack
  int layer = -1;            // the decoder layer (model.layers.{layer})
};

// What the loader assembles (models/loader.cpp), handed to MoeModel's constructor.
struct ModelWeights {
  at::Tensor embed, final_norm, lm_head;
  std::vector<BlockWeights> blocks;
  std::shared_ptr<WeightProvider> provider;  // the experts' weights (models/weights.h)
};

class MoeModel {
 public:
  // Reads config.json (load_config) and the checkpoint in model_dir (random weights with
  // opts.random_seed).
  static std::unique_ptr<MoeModel> load(const std::string& model_dir, const LoadOptions& opts);
  // The same with model_dir's config.json already parsed (a run parses it once).
  static std::unique_ptr<MoeModel> load(const std::string& model_dir, const ModelConfig& config, const LoadOptions& opts);
  MoeModel(ModelConfig cfg, LoadOptions opts, ModelWeights w);
  MoeModel(const MoeModel&) = delete;  // the blocks point at cfg_
  MoeModel& operator=(const MoeModel&) = delete;

  const ModelConfig& config() const { return cfg_; }
  const LoadOptions& options() const { return opts_; }
  int num_layers() const { return static_cast<int>(blocks_.size()); }
  const DecoderBlock& block(int i) const { return *blocks_.at(i); }

  // Forward pieces (for checkpointing wrappers) and the whole thing.
  at::Tensor embed(const at::Tensor& input_ids) const;
  BlockContext context(const Batch& batch, bool training) const;
  at::Tensor head(const at::Tensor& hidden) const;  // final norm + lm_head → logits
  // Training loss: summed shifted cross entropy (fp32) of head(hidden) against labels, in
  // chunks, so the [B, T, V] logits never exist (lm_loss.h). Ignored labels are -100.
  at::Tensor loss_sum(const at::Tensor& hidden, const at::Tensor& labels) const;
  ForwardOutput forward(const Batch& batch, const ForwardOptions& opts = {}) const;

  // LoRA: fresh adapters (peft init), an existing peft adapter folder, and saving one.
  void add_lora(const LoraSpec& spec);
  void load_adapter(const std::string& adapter_dir);
  // A peft adapter's tensors into the LoRA already added (add_lora), whose spec must be the
  // adapter's; every tensor must belong to a targeted module and every module have its tensors.
  void load_adapter_weights(const std::string& adapter_dir);
  void save_adapter(const std::string& adapter_dir, const std::string& base_model) const;
  const LoraSpec& lora_spec() const { return lora_spec_; }
  // Whether every block's expert LoRA (if any) can run as grouped GEMMs beside the base ones
  // (r a multiple of 8); false sends those blocks through the per-expert loop on a GPU too.
  bool expert_lora_grouped_ok() const;
  // The trainable leaves, in order of use in forward. peft names (base_model.model.<module>.
  // lora_{A,B}.weight), except each MoE block's expert LoRA: one stacked tensor per matrix and
  // factor, base_model.model.model.layers.{i}.<moe>.experts.<matrix>.lora_{A,B}.stacked [E, ...]
  // (peft_lora_tensors() turns a list into peft's per-expert names; save_adapter writes those).
  std::vector<std::pair<std::string, at::Tensor>> lora_parameters() const;
  // Block `layer`'s expert LoRA (per matrix, then the fused gate_up), for whoever holds its state
  // elsewhere (runtime/expert_lora_offload.h): it may point their leaves at other tensors.
  std::vector<std::shared_ptr<ExpertLora>> expert_loras(int layer) const;

  // axolotl's nvfp4_merge_aware: every LoRA-carrying NVFP4 weight (the NVFP4 experts' banks, the
  // linears decoded from NVFP4) then trains through Q(dequant(W) + scaling · B A), Q the NVFP4
  // fake quantiser (nvfp4::fake_quantize) on the weight's own global scale (gate_up_proj: the
  // larger of gate's and up's, per expert), with straight-through gradients; others train plain.
  // Call after the LoRA exists; throws when no LoRA-carrying weight is NVFP4. Off until
  // set_merge_aware_active(true) (nvfp4_merge_aware_start_step); returns the snapped
  // {linears, expert matrices}.
  std::pair<int, int> enable_merge_aware();
  void set_merge_aware_active(bool on) { merge_aware_on_->store(on); }
  bool merge_aware_active() const { return merge_aware_on_->load(); }

  WeightProvider& weight_provider() { return *provider_; }
  void set_weight_provider(std::shared_ptr<WeightProvider> provider);
  // Which dequantised expert banks a forward under grad mode keeps for its backward (BankReuse,
  // models/linear4bit.h). For checkpointed recomputes only, whose backward follows at once: a
  // forward with graphs kept for later would hold every block's banks. Default None.
  void set_bank_reuse(BankReuse reuse);

 private:
  std::vector<LoraSite> lora_sites() const;
  at::Tensor embed_rows(const at::Tensor& input_ids) const;  // the table's rows, before any scale

  ModelConfig cfg_;
  LoadOptions opts_;
  at::Tensor embed_, final_norm_, lm_head_;
  std::vector<std::unique_ptr<DecoderBlock>> blocks_;
  std::shared_ptr<WeightProvider> provider_;
  LoraSpec lora_spec_;
  std::shared_ptr<std::atomic<bool>> merge_aware_on_ = std::make_shared<std::atomic<bool>>(false);
};

// Pieces usable on their own (and by tests).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
// RoPE inverse frequencies [rope.dim / 2] in fp32 (default or YaRN), as transformers computes them.
at::Tensor rope_inv_freq(const Rope& rope, double theta, const at::Device& device);
// Summed next-token cross entropy in fp32 (labels shifted left by one, -100 ignored).
std::pair<at::Tensor, std::int64_t> shifted_cross_entropy(const at::Tensor& logits, const at::Tensor& labels);
// transformers' load_balancing_loss_func: E · Σ_e f_e · P_e over all layers' router logits.
at::Tensor load_balancing_loss(const std::vector<at::Tensor>& router_logits, std::int64_t experts, std::int64_t top_k,
                               const at::Tensor& attention_mask);

}  // namespace eo::model
