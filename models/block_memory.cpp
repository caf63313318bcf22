#include "models/block_memory.h"

#include <algorithm>
#include <array>
#include <cmath>

#include "models/delta_rule.h"

namespace eo::model {
namespace {

double nf4_bytes(double out, double in, int blocksize) {
  const double n = out * in;
  return std::ceil(n / 2) + std::ceil(n / blocksize) * 4;
}

// A frozen linear's bytes: NF4 with its absmax under load_in_4bit, else the compute dtype.
double linear_bytes(const BlockRun& run, double out, double in) {
  return run.load_in_4bit ? nf4_bytes(out, in, run.blocksize) : out * in * run.dtype_bytes;
}

// Parameters of one layer beyond its attention, its two norms and its q/k norms: Gemma 4's
// feed-forward norms, router scales and layer scalar; a delta-rule layer's conv1d, A_log, dt_bias
// and gated norm.
double extra_layer_params(const ModelConfig& c, int layer) {
  const double H = double(c.hidden), E = double(c.experts);
  double extra = c.gemma ? 5 * H + H + E + 1 : 0;
  if (c.linear_attn && c.is_linear_attention_layer(layer)) {
    const LinearAttention& a = *c.linear_attn;
    extra += double(a.conv_width() * a.conv_kernel) + 2 * double(a.v_heads) + double(a.v_dim);
  }
  return extra;
}

// The widest layer's attention (Gemma 4's full layers have their own head_dim and kv heads):
// query and key-value widths.
struct AttentionWidths {
  double q = 0, kv = 0;
};
AttentionWidths widest_attention(const ModelConfig& c) {
  double D = 0, kv = 0;
  for (int i = 0; i < c.layers; ++i) {
    D = std::max(D, double(c.head_dim_at(i)));
    kv = std::max(kv, double(c.kv_heads_at(i) * c.head_dim_at(i)));
  }
  return {double(c.heads) * D, kv};
}

// A gated delta-rule layer (Qwen3-Next, Qwen3.5; models/linear_attention.cpp, models/delta_rule.cpp)
// of a micro-batch of `rows` rows of `seq` tokens: what its recompute saves until its backward, in
// place of attention's, and what the delta rule's chunked backward adds at once (its fp32 chunks,
// their C x C matrices and every chunk's entry state, and as much again for their gradients).
// Both 0 for a family without such layers. `lora_bytes`: one LoRA intermediate's bytes per token.
struct LinearAttentionBytes {
  double saved = 0, backward = 0;
};
LinearAttentionBytes linear_attention_bytes(const ModelConfig& c, double rows, double seq, double dtype_bytes,
                                            double lora_bytes) {
  if (!c.linear_attn) return {};
  const LinearAttention& a = *c.linear_attn;
  const double N = rows * seq, d = dtype_bytes, H = double(c.hidden);
  const double kd = double(a.key_width()), vd = double(a.value_width()), cw = double(a.conv_width());
  const double Hv = double(a.v_heads), dk = double(a.k_dim), dv = double(a.v_dim);
  const double C = double(GatedDeltaRuleOptions{}.chunk_size);
  LinearAttentionBytes b;
  // The normed input (the projections' LoRA A), the projections' outputs, the conv's input, its
  // pre-SiLU sum and q / k / v after it, the decay's fp32 inputs and beta, the delta rule's output,
  // z and the gated norm's fp32 products, out_proj's input, the LoRA intermediates.
  const int linears = a.split_projections ? 5 : 3;
  b.saved = N * (H * d + (2 * kd + 2 * vd) * d + 3 * cw * d + Hv * (8 + d) + vd * (4 * d + 8) + linears * lora_bytes);
  // The backward's fp32 chunks (q, k at every value head, Γq, e k, W; v, U, Ṽ), its C x C matrices
  // (decay, k kᵀ, q kᵀ, the inverse and two more in flight) and the entry state of every chunk.
  const double chunks = N * Hv * (5 * dk + 3 * dv + 6 * C) * 4;
  const double states = rows * Hv * std::ceil(seq / C) * dk * dv * 4;
  b.backward = 2 * (chunks + states);
  return b;
}

// Attention's tensors saved until its own backward, and what the wide heads' repeated kv heads add
// to it and to its backward.
struct AttentionSaved {
  double saved = 0, repeated_kv = 0;
};
AttentionSaved attention_saved(const ModelConfig& c, const BlockRun& run, AttentionWidths w) {
  const double N = run.micro_batch_size * run.sequence_len, H = double(c.hidden), d = run.dtype_bytes;
  const double heads = double(c.heads), r_bytes = run.lora->r * d;
  auto adapts = [&](const char* name) { return adapts_module(*run.lora, run.lora_all_linear, name); };
  const bool lq = adapts("q_proj"), lk = adapts("k_proj"), lv = adapts("v_proj"), lo = adapts("o_proj");
  // The normed input (for the q/k/v LoRA A), the q/k norm inputs and statistics, SDPA's q, k, v,
  // output and log-sum-exp, the post-norm input and statistics, each LoRA's [tokens, r] intermediate.
  AttentionSaved a;
  a.saved = N * 4 + N * H * d + N * 4;  // input norm rstd; post-norm input h and its rstd
  if (lq || lk || lv) a.saved += N * H * d;
  if (c.qk_norm != QkNorm::None) a.saved += N * (w.q + w.kv) * d + N * 4 * (heads + double(c.kv_heads));
  a.saved += N * (w.q + 2 * w.kv) * d + N * w.q * d + N * heads * 4;
  a.saved += N * r_bytes * double(int(lq) + int(lk) + int(lv) + int(lo));
  // Heads wider than flash's 256 on a GPU (Gemma 4's full layers: 512, 2 kv heads) run the
  // memory-efficient kernel with their kv heads repeated to every query head (models/moe_model.cpp:
  // attend): it saves the repeated k and v, and its backward writes their gradients at that size.
  for (int i = 0; run.on_gpu && i < c.layers; ++i) {
    if (c.head_dim_at(i) <= 256) continue;
    const double D = double(c.head_dim_at(i));
    a.repeated_kv = std::max(a.repeated_kv, 2 * N * (heads - double(c.kv_heads_at(i))) * D * d);
  }
  a.saved += a.repeated_kv;
  return a;
}

// Saved by one MoE layer beside the routed experts: the shared expert's gate, up and output and
// its gate's logit, and Gemma 4's dense MLP (gate, up, act) and its five norms' outputs.
double beside_experts_saved_bytes(const ModelConfig& c, double tokens, double dtype_bytes) {
  const double N = tokens, H = double(c.hidden), d = dtype_bytes;
  double bytes = c.shared_expert_width > 0 ? N * (2 * double(c.shared_expert_width) + H) * d + N * d : 0;
  if (c.dense_beside_experts()) bytes += N * (3 * double(c.dense_width) + 5 * H) * d;
  return bytes;
}

// The bank: every expert's matrix dequantised at once, or the largest slice of it
// (expert_dequant_chunk; GPU only: the CPU runs the per-expert loop). Streamed in groups, a bank is
// one group's experts (models/moe_model.cpp: experts_forward). 0 without 4-bit experts.
double expert_bank_bytes(const ModelConfig& c, const BlockRun& run, int moe_layers) {
  const double E = double(c.experts), I = double(c.expert_width), H = double(c.hidden), d = run.dtype_bytes;
  const double Eb = run.group_size > 0 ? double(run.group_size) : E;
  double bank = moe_layers > 0 && run.experts_quantised ? Eb * I * H * d : 0;
  if (const std::int64_t max = run.bank_bytes; bank > 0 && max > 0 && run.on_gpu) {
    const auto e = std::int64_t(Eb), h = std::int64_t(H), i = std::int64_t(I), el = std::int64_t(d);
    bank = std::max(Eb * H * d * double(bank_slice(i, e, h, el, max)),
                    Eb * I * d * double(bank_slice(h, e, i, el, max)));
  }
  return bank;
}

// Whether the GPU's fused SwiGLU takes the expert LoRA's deltas and gradients apart from the base
// GEMMs' (models/fused.h: swiglu_twice), keeping them for its backward: not under gpt-oss's
// clamped activation, whose clamps read the sums, formed first (models/moe_model.cpp).
bool fused_swiglu_lora(const ModelConfig& c) { return !c.swiglu_clamp; }

// The peak's phases, the larger kept with its name.
struct Phases {
  double bytes = 0;
  std::string name;
  void add(const char* phase, double b) {
    if (b > bytes) bytes = b, name = phase;
  }
};

// An MoE layer's backward, phase by phase (models/moe_model.cpp, linear4bit.cpp; GPU path:
// grouped experts), on top of `attn` (attention's or the delta rule's saved tensors).
void moe_phases(const ModelConfig& c, const BlockRun& run, double attn, double bank, Phases& ph) {
  const double N = run.micro_batch_size * run.sequence_len, NK = N * double(c.top_k);
  const double H = double(c.hidden), E = double(c.experts), I = double(c.expert_width), d = run.dtype_bytes;
  const double r_bytes = run.lora->r * d;
  const bool gpu = run.on_gpu;
  const ExpertLoraReach reach = expert_lora_reach(c, *run.lora, run.lora_all_linear);
  // Saved: router probabilities (fp32), top-k indices and weights, the dispatch's three int64
  // permutations (Llama 4 scales the experts' input rows by their routing weights: the unscaled
  // rows are saved too), gate and up (swiglu), the routed outputs in expert order (the combine's,
  // for the weights' gradient), and with expert LoRA its inputs, [pairs, r] intermediates, the
  // gate/up deltas and down's delta (the combine's too).
  const double routed_input = c.llama4 ? NK * H * d : 0;
  const double moe_small = N * E * 4 + NK * (8 + 4 + d) + 3 * NK * 8 + routed_input;
  const double gate_up = 2 * NK * I * d, routed_out = NK * H * d;
  // With LoRA on both gate and up (or on gate_up_proj) the GPU's SwiGLU adds their deltas itself,
  // so it keeps the two deltas beside gate and up (models/fused.h).
  const double gate_up_deltas = gpu && reach.gate && reach.up && fused_swiglu_lora(c) ? gate_up : 0;
  // With LoRA on down (down_proj or the fused down parameter) the GPU's combine adds its delta and
  // keeps it for the weights' gradient, beside the routed outputs.
  const double down_delta = gpu && reach.down ? NK * H * d : 0;
  const bool le = reach.gate || reach.up || reach.down;
  const double expert_lora = le ? NK * H * d + NK * I * d + 3 * NK * r_bytes + gate_up_deltas + down_delta : 0;
  const double combine_saved = routed_out + down_delta;  // freed by the combine's backward
  // The expert LoRA reads the dispatch's and SwiGLU's second outputs (gather_rows_twice,
  // swiglu_twice), so its input gradients stay apart from the base GEMMs' until those backward
  // kernels sum them: one more [pairs, hidden] through gate/up's backward and one more
  // [pairs, I] from down's backward to SwiGLU's.
  const double lora_dx = gpu && (reach.gate || reach.up) ? NK * H * d : 0;
  const double lora_dact = gpu && reach.down && fused_swiglu_lora(c) ? NK * I * d : 0;
  const double shared = beside_experts_saved_bytes(c, N, d);
  // Banks a recompute keeps for its backward (expert_bank_reuse; whole banks on a GPU, none when
  // streamed in groups), beside the one bank each phase holds anyway: with `all`, gate's and
  // up's until their backward.
  const bool keep_all = bank > 0 && run.group_size == 0 && run.bank_reuse == BankReuse::All;
  const bool keep_down = bank > 0 && run.group_size == 0 && run.bank_reuse == BankReuse::Down;
  const double kept_gate_up = keep_all ? 2 * bank : 0;
  const double saved = attn + moe_small + gate_up + routed_out + expert_lora + shared;
  // Recompute, at the down projection: x_sorted, gate, up, swiglu's output, the bank, y.
  ph.add("recompute (down projection)",
         attn + moe_small + shared + NK * H * d + gate_up + NK * I * d + bank + kept_gate_up + NK * H * d);
  // The recompute done: its saved tensors, the kept banks and the block's output.
  if (keep_all || keep_down) ph.add("recompute end (banks kept)", saved + (keep_all ? 3 : 1) * bank + N * H * d);
  // Backward of the down projection: the combine's gradient in expert order, the bank, dH.
  ph.add("down-projection backward", saved - combine_saved + NK * H * d + bank + kept_gate_up + NK * I * d + lora_dact);
  // SwiGLU's backward: dH (and the down LoRA's) beside gate and up, and dGate, dUp.
  ph.add("swiglu backward", saved - combine_saved + NK * I * d + lora_dact + gate_up + kept_gate_up);
  // Backward of gate / up: dGate and dUp in place of the freed gate and up, the bank (and the
  // other one still kept), dX from gate and from up (and the expert LoRA's).
  ph.add("gate/up backward", saved - combine_saved + bank + kept_gate_up / 2 + 2 * NK * H * d + lora_dx);
  // The dispatch's backward: dX in expert order, gathered back and summed per token.
  ph.add("dispatch backward", attn + moe_small + shared + 2 * NK * H * d + N * H * d);
}

}  // namespace

BlockParams block_params(const ModelConfig& c, int layer, bool moe, const BlockRun& run) {
  const double H = double(c.hidden), E = double(c.experts), I = double(c.expert_width), d = run.dtype_bytes;
  const LoraSpec& l = *run.lora;
  const double r = l.r;
  BlockParams b;
  auto site = [&](double& into, const std::string& name, double in, double out, double count) {
    if (adapts_module(l, run.lora_all_linear, name)) into += count * r * (in + out);
  };
  // Attention (q/k/v/o, or DeepSeek's latent-attention linears) with its per-head q/k norms, the
  // two norms, a whole-projection q/k norm (the widest layer's), the family's extras.
  for (const auto& a : c.attention_shapes(layer)) {
    b.frozen += linear_bytes(run, double(a.out), double(a.in));
    site(b.lora, a.name, double(a.in), double(a.out), 1);
  }
  if (c.qk_norm == QkNorm::PerHead) b.frozen += 2 * double(c.head_dim_at(layer)) * d;
  const AttentionWidths w = widest_attention(c);
  b.frozen += 2 * H * d + (c.qk_norm == QkNorm::Whole ? (w.q + w.kv) * d : 0) + extra_layer_params(c, layer) * d;
  if (!moe || c.dense_beside_experts()) {  // the dense MLP
    const double W = double(c.dense_width);
    b.frozen += 3 * linear_bytes(run, W, H);
    site(b.lora, "gate_proj", H, W, 1);
    site(b.lora, "up_proj", H, W, 1);
    site(b.lora, "down_proj", W, H, 1);
  }
  if (!moe) return b;
  b.frozen += E * H * d;  // the router
  if (c.shared_expert_width > 0) {  // resident linears, adapted under the expert names (Llama 4's has no gate)
    const double S = double(c.shared_expert_width);
    b.frozen += 3 * linear_bytes(run, S, H) + (c.llama4 ? 0.0 : H) * d;
    site(b.lora, "gate_proj", H, S, 1);
    site(b.lora, "up_proj", H, S, 1);
    site(b.lora, "down_proj", S, H, 1);
    if (c.shared_expert_gated) site(b.lora, "shared_expert_gate", H, 1, 1);
  }
  // The routed experts' LoRA: lora_target_parameters as peft's ParamWrapper per fused parameter,
  // A [r·E, in], B [out, r·E] (gate_up_proj: in H, out 2I, one A for gate and up), target_modules
  // then reaching no expert; else per-expert modules (gpt-oss, Gemma 4 and Llama 4 have none).
  if (!l.target_parameters.empty()) {
    if (l.targets_parameter(kGateUpParam)) b.expert_lora += E * r * (H + 2 * I);
    if (l.targets_parameter(kDownParam)) b.expert_lora += E * r * (I + H);
  } else if (c.experts_lora_ok()) {
    const std::array<std::string, 3> e = c.expert_linears();  // gate, up, down as peft names them
    site(b.expert_lora, e[0], H, I, E);
    site(b.expert_lora, e[1], H, I, E);
    site(b.expert_lora, e[2], I, H, E);
  }
  return b;
}

BlockPeak block_peak(const ModelConfig& c, const BlockRun& run, int moe_layers) {
  const double N = run.micro_batch_size * run.sequence_len, H = double(c.hidden), d = run.dtype_bytes;
  const AttentionWidths w = widest_attention(c);
  BlockPeak out;
  out.pairs = N * double(c.top_k);
  const AttentionSaved attn = attention_saved(c, run, w);
  out.attn_repeated_kv = attn.repeated_kv;
  // Gated delta-rule layers: their saved tensors where more than attention's, their chunked backward.
  const LinearAttentionBytes linear_attn =
      linear_attention_bytes(c, run.micro_batch_size, run.sequence_len, d, run.lora->r * d);
  const double saved = std::max(attn.saved, linear_attn.saved);
  out.bank = expert_bank_bytes(c, run, moe_layers);
  out.banks_kept = out.bank > 0 && run.group_size == 0 && run.bank_reuse == BankReuse::All;
  Phases ph;
  if (moe_layers > 0) moe_phases(c, run, saved, out.bank, ph);
  if (moe_layers < c.layers) {
    const double W = double(c.dense_width);
    ph.add("dense MLP backward", saved + 3 * N * W * d + N * H * d + W * H * d);
  }
  // Attention backward: SDPA's gradients (dq accumulated in fp32) beside what it saved.
  ph.add("attention backward", saved + N * (w.q + 2 * w.kv) * d + N * w.q * 4 + attn.repeated_kv);
  if (linear_attn.backward > 0) ph.add("delta-rule backward", saved + linear_attn.backward);
  // Gradients in flight on the residual stream: the block's output gradient and its input's.
  out.bytes = ph.bytes + 2 * N * H * d;
  out.phase = ph.name;
  return out;
}

double resident_experts_bytes(const ModelConfig& c, const BlockRun& run, int moe_layers,
                              std::optional<QuantFormat> format) {
  const double I = double(c.expert_width), H = double(c.hidden);
  const QuantFormatTraits& f = quant_format_traits(format.value_or(QuantFormat::Nf4));
  const double matrix = !format                        ? I * H * run.dtype_bytes
                        : *format == QuantFormat::Nf4 ? nf4_bytes(I, H, run.blocksize)
                                                        : I * H / 2 + I * H / f.group + f.per_matrix;
  return double(moe_layers) * double(c.experts) * 3 * matrix;
}

double rope_table_columns(const ModelConfig& c) {
  return c.gemma ? double(c.rope.dim + c.gemma->full_rope.dim) : double(c.head_dim);
}

int dense_mlp_layers(const ModelConfig& c, int moe_layers) {
  return c.dense_beside_experts() ? int(c.layers) : int(c.layers) - moe_layers;
}

BlockContextBytes block_context_bytes(const ModelConfig& c, double micro_batch_size, double sequence_len,
                                      double micro_batches) {
  if (!c.llama4) return {};
  // A bool [T, T] mask per row of each micro-batch kept, when the sequence is longer than a chunk,
  // and q_scale's fp32 per token for the NoPE layers.
  bool chunked = false;
  for (int i = 0; i < c.layers; ++i) chunked = chunked || c.is_chunked_layer(i);
  const double g = micro_batches, T = sequence_len, N = micro_batch_size * sequence_len;
  const double masks = chunked && sequence_len > double(c.llama4->chunk) ? g * micro_batch_size * T * T : 0;
  const double scales = c.llama4->temperature_tuning ? g * N * 4 : 0;
  return {masks + scales, "llama4 context", "chunked-attention masks and NoPE query scales of the micro-batches"};
}

ExpertLoraReach expert_lora_reach(const ModelConfig& c, const LoraSpec& l, bool all_linear) {
  if (!l.target_parameters.empty())
    return {l.targets_parameter(kGateUpParam), l.targets_parameter(kGateUpParam), l.targets_parameter(kDownParam)};
  const std::array<std::string, 3> e = c.expert_linears();
  return {adapts_module(l, all_linear, e[0]), adapts_module(l, all_linear, e[1]), adapts_module(l, all_linear, e[2])};
}

}  // namespace eo::model
