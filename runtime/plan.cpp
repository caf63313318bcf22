#include "runtime/plan.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "common/text.h"
#include "models/block_memory.h"
#include "models/linear4bit.h"
#include "models/lm_loss.h"
#include "offload/disk_homes.h"
#include "offload/layout.h"
#include "offload/staging.h"
#include "runtime/expert_lora_offload.h"
#include "runtime/schedule.h"

namespace eo {
namespace {

double nf4_bytes(double out, double in, int blocksize) {
  const double n = out * in;
  return std::ceil(n / 2) + std::ceil(n / blocksize) * 4;
}



bool targets(const RunSpec& spec, const std::string& name) {
  if (spec.lora_all_linear) return true;
  return std::find(spec.lora.targets.begin(), spec.lora.targets.end(), name) != spec.lora.targets.end();
}

}  // namespace

MemoryPlan plan_memory(const TrainConfig& cfg, const model::ModelConfig& mc, Compute compute, int ranks_per_node, bool on_gpu) {
  return plan_memory(resolve_run_spec(cfg, mc, compute, on_gpu, ranks_per_node));
}

MemoryPlan plan_memory(const RunSpec& spec) {
  const model::ModelConfig& c = spec.model;
  const bool on_gpu = spec.on_gpu;
  MemoryPlan p;
  p.on_gpu = on_gpu;
  p.compute = spec.compute;
  p.ranks_per_node = spec.ranks_per_node;
  const double d = spec.compute == Compute::Fp32 ? 4 : 2;  // compute dtype bytes
  const int bs = spec.blocksize;
  const double H = double(c.hidden), V = double(c.vocab);
  // The widest layer's attention (Gemma 4's full layers have their own head_dim and kv heads).
  double D = 0, kvd = 0;
  for (int i = 0; i < c.layers; ++i) {
    D = std::max(D, double(c.head_dim_at(i)));
    kvd = std::max(kvd, double(c.kv_heads_at(i) * c.head_dim_at(i)));
  }
  const double qd = double(c.heads) * D;
  const double rope_cols = model::rope_table_columns(c);
  const double E = double(c.experts), K = double(c.top_k), I = double(c.expert_width);
  const bool q4 = spec.load_in_4bit;
  auto linear = [&](double out, double in) { return q4 ? nf4_bytes(out, in, bs) : out * in * d; };

  const int moe_layers = static_cast<int>(spec.moe_layers.size());
  const int dense_layers = int(c.layers) - moe_layers;
  const int mlp_layers = model::dense_mlp_layers(c, moe_layers);

  // ---- frozen weights on the device (on a GPU the untied input embedding table stays in host
  // memory: model::LoadOptions::embeddings_on_host)
  const bool host_embeddings = p.on_gpu && !c.tie_word_embeddings;
  double weights = V * H * d * (c.tie_word_embeddings || host_embeddings ? 1 : 2) + H * d;
  double attn = 0;  // q/k/v/o, or DeepSeek's latent-attention linears, and q/k norms, of every layer
  for (int i = 0; i < c.layers; ++i) {
    for (const auto& l : c.attention_shapes(i)) attn += linear(double(l.out), double(l.in));
    if (c.qk_norm == model::QkNorm::PerHead) attn += 2 * double(c.head_dim_at(i)) * d;
  }
  double norms = 2 * H * d;
  if (c.qk_norm == model::QkNorm::Whole) norms += (qd + kvd) * d;
  norms += model::extra_layer_params(c) * d;
  weights += attn + double(c.layers) * norms;
  weights += double(moe_layers) * E * H * d;  // routers
  weights += double(mlp_layers) * 3 * linear(double(c.dense_width), H);
  if (c.shared_expert_width > 0)
    weights += double(moe_layers) * (3 * linear(double(c.shared_expert_width), H) + model::shared_expert_gate_params(c) * d);
  p.device.push_back({"weights", weights,
                      std::string(host_embeddings ? "lm_head (input embeddings in host RAM)" : "embeddings, lm_head") +
                          ", norms, routers, attention" + (q4 ? " (NF4)" : "")});

  // ---- experts: NF4, or the checkpoint's MXFP4 / NVFP4 kept (expert_quant; NVFP4 without load_in_4bit too)
  const std::optional<QuantFormat> fmt = spec.expert_format;
  p.expert_format = fmt.value_or(QuantFormat::Nf4);
  const std::string held = !fmt                         ? std::string()
                           : std::string(" (") + quant_format_name(*fmt) +
                                 (quant_format_traits(*fmt).checkpoint_own ? ", the checkpoint's own bytes)" : ")");
  // One MoE block's experts exactly as the offload engine lays them out (offload/layout.h).
  p.block_bytes = double(offload::expert_block_bytes(c, bs, spec.double_quant, p.expert_format));
  p.group_size = spec.offload && spec.group_size > 0 && spec.group_size < c.experts ? spec.group_size : 0;
  p.expert_bytes = p.block_bytes * moe_layers;
  if (spec.offload) {
    int slots = spec.slots;
    double budget = 0;
    if (!spec.budget_auto && spec.budget_bytes > 0) budget = std::floor(double(spec.budget_bytes) / p.block_bytes) * p.block_bytes;
    budget = std::min(budget, p.expert_bytes);
    const int resident_count = p.block_bytes > 0 ? int(budget / p.block_bytes) : 0;
    if (p.group_size > 0) {
      // Streamed in groups (offload/engine.h): two slots of a group (one computes, the next
      // copies), one without prefetch; none when every block is budget-resident.
      slots = resident_count >= moe_layers ? 0 : spec.prefetch ? 2 : 1;
      p.slot_bytes = double(offload::expert_group_bytes(c, bs, spec.double_quant, p.expert_format, p.group_size));
      p.device.push_back({"experts", double(slots) * p.slot_bytes + budget,
                          std::to_string(slots) + " slot(s) of " + human_bytes(p.slot_bytes) + ", each a group of " +
                              std::to_string(p.group_size) + " of a block's " + std::to_string(c.experts) +
                              " experts (expert_group_size; blocks of " + human_bytes(p.block_bytes) + " stream group by group)" +
                              (budget > 0 ? " + " + human_bytes(budget) + " of resident blocks" : std::string()) + held});
    } else {
      p.slot_bytes = p.block_bytes;
      p.device.push_back({"experts", double(slots) * p.block_bytes + budget,
                          std::to_string(slots) + " slot(s) of " + human_bytes(p.block_bytes) +
                              (budget > 0 ? " + " + human_bytes(budget) + " of resident blocks" : std::string()) + held});
    }
    p.host_pinned = p.expert_bytes;
    p.shared_homes = spec.homes == offload::HomesKind::PerNumaNode;
    // Copies per warm step: the engine's staging policy run dry along the step's staging order,
    // the blocks within the VRAM budget resident (the first ones, in layer order, as the engine).
    const std::vector<int>& moe_list = spec.moe_layers;
    std::vector<bool> is_moe(static_cast<std::size_t>(c.layers));
    for (int i : moe_list) is_moe[static_cast<std::size_t>(i)] = true;
    const std::vector<int> resident(moe_list.begin(), moe_list.begin() + std::min<std::size_t>(moe_list.size(), resident_count));
    const int streamed = moe_layers - int(resident.size());
    const std::vector<int> order = make_step_schedule(int(c.layers), spec.accum, spec.order).staging_order(is_moe);
    if (!moe_list.empty() && p.group_size > 0) {
      // Groups: every group of a streamed block's stagings is copied (forward, recompute), and its
      // backward copies all but the two groups its recompute left in the slots.
      const std::int64_t groups = (c.experts + p.group_size - 1) / p.group_size;
      std::int64_t stagings = 0;
      for (int l : order) stagings += std::find(resident.begin(), resident.end(), l) == resident.end() ? 1 : 0;
      p.copies_per_step = stagings * groups + (spec.checkpointing ? stagings / 2 * std::max<std::int64_t>(0, groups - 2) : 0);
    } else if (!moe_list.empty()) {
      p.copies_per_step = offload::steady_copies_per_step(order, int(c.layers), std::min(slots, streamed), spec.prefetch, resident);
    }
    if (spec.homes == offload::HomesKind::Disk) {
      const offload::DiskHomesSize z = offload::estimate_disk_homes(c, bs, spec.double_quant, slots, p.expert_format);
      p.disk_homes = true;
      p.disk_file_bytes = double(z.file_bytes);
      p.disk_ring = z.ring;
      p.disk_ring_bytes = double(z.ring_bytes);
      p.disk_reads_per_step = double(p.copies_per_step) * p.block_bytes;
      p.host_pinned = p.disk_ring_bytes;
    }
  } else {
    // Resident experts are separate tensors (no arena alignment).
    const QuantFormatTraits& sf = quant_format_traits(p.expert_format);
    const double matrix = !fmt                        ? I * H * d
                          : *fmt == QuantFormat::Nf4 ? nf4_bytes(I, H, bs)
                                                       : I * H / 2 + I * H / sf.group + sf.per_matrix;
    p.device.push_back({"experts", double(moe_layers) * E * 3 * matrix, "every expert resident" + held});
  }

  // ---- LoRA: fp32 parameter, gradient and two AdamW moments
  const double r = spec.lora.r;
  double lora_params = 0, expert_lora_params = 0;  // the latter on the routed experts
  auto site_into = [&](double& into, const std::string& name, double in, double out, double count) {
    if (targets(spec, name)) into += count * r * (in + out);
  };
  auto site = [&](const std::string& name, double in, double out, double count) { site_into(lora_params, name, in, out, count); };
  for (int i = 0; i < c.layers; ++i)
    for (const auto& l : c.attention_shapes(i)) site(l.name, double(l.in), double(l.out), 1);
  const std::array<std::string, 3> expert = c.expert_linears();  // gate, up, down as peft names them
  // lora_target_parameters: peft's ParamWrapper per fused parameter, A [r·E, in], B [out, r·E]
  // (gate_up_proj: in H, out 2I, one A for gate and up); target_modules then reach no expert.
  auto fused = [&](const char* param) {
    return std::find(spec.lora.target_parameters.begin(), spec.lora.target_parameters.end(), param) !=
           spec.lora.target_parameters.end();
  };
  const bool fused_gate_up = fused("mlp.experts.gate_up_proj"), fused_down = fused("mlp.experts.down_proj");
  if (!spec.lora.target_parameters.empty()) {
    if (fused_gate_up) expert_lora_params += moe_layers * E * r * (H + 2 * I);
    if (fused_down) expert_lora_params += moe_layers * E * r * (I + H);
  } else if (c.experts_lora_ok()) {  // per-expert modules (gpt-oss, Gemma 4 and Llama 4 have none: experts fused only)
    site_into(expert_lora_params, expert[0], H, I, moe_layers * E);
    site_into(expert_lora_params, expert[1], H, I, moe_layers * E);
    site_into(expert_lora_params, expert[2], I, H, moe_layers * E);
  }
  if (c.shared_expert_width > 0) {  // resident linears, adapted under the expert names
    const double S = double(c.shared_expert_width);
    site("gate_proj", H, S, moe_layers);
    site("up_proj", H, S, moe_layers);
    site("down_proj", S, H, moe_layers);
    if (c.shared_expert_gated) site("shared_expert_gate", H, 1, moe_layers);
  }
  if (mlp_layers > 0) {
    site("gate_proj", H, double(c.dense_width), mlp_layers);
    site("up_proj", H, double(c.dense_width), mlp_layers);
    site("down_proj", double(c.dense_width), H, mlp_layers);
  }
  const auto count = [](double n) { return std::to_string(static_cast<long long>(n)); };
  if (spec.expert_lora_offload && expert_lora_params > 0) {
    // The experts' LoRA state in host RAM (runtime/expert_lora_offload.h); on the device, the
    // working copies of a few blocks with their gradients.
    const double copies = std::min<double>(kExpertLoraWorkingCopies, moe_layers);
    const ExpertLoraBytes b = expert_lora_bytes(expert_lora_params, expert_lora_params / moe_layers);
    p.host_lora = b.host;
    p.expert_lora_params = expert_lora_params;
    p.device.push_back({"lora", lora_params * 16 + b.device * copies / kExpertLoraWorkingCopies,
                        count(lora_params) + " parameters x 16 bytes + the experts' LoRA of " + count(copies) +
                            " block(s) x 8 bytes (the rest in host RAM)"});
  } else {
    lora_params += expert_lora_params;
    p.device.push_back({"lora", lora_params * 16, count(lora_params) + " parameters x 16 bytes"});
  }

  // ---- activations of one micro-batch
  const double N = double(spec.micro_batch_size) * double(spec.sequence_len);
  // Block inputs kept by checkpointing (embedding output .. last block) and the RoPE tables of
  // every micro-batch of the step (the layer-major step keeps all g until backward; micro-batch-
  // major, one), the hidden state or incoming gradient of each, and the outgoing gradient of the
  // block under backward. With activation_offloading the inputs wait in pinned host RAM and about
  // two blocks' worth are on the device (the one in backward and the one being copied back).
  const bool layer_major = spec.order == StepOrder::LayerMajor;
  const double g = layer_major ? double(spec.accum) : 1.0;
  const double kept = spec.activation_offloading ? std::min(2.0, double(c.layers)) : double(c.layers);
  const double checkpoints = (g * (kept + 1) + 2) * N * H * d + g * 2 * N * rope_cols * d;
  p.device.push_back({"checkpoints", checkpoints,
                      std::to_string(static_cast<long long>(kept)) + " block inputs of [tokens, hidden] x " +
                          std::to_string(static_cast<long long>(g)) + " micro-batch(es) + gradients" +
                          (spec.activation_offloading ? " (the rest parked in host RAM)" : "")});
  if (spec.activation_offloading) p.host_pinned += g * double(c.layers) * N * H * d;
  if (const model::BlockContextBytes ctx = model::block_context_bytes(c, double(spec.micro_batch_size), double(spec.sequence_len), g);
      ctx.bytes > 0)
    p.device.push_back({ctx.name, ctx.bytes, ctx.what});

  // ---- one block under backward: its recompute graph's saved tensors plus, op by op, what the
  // backward holds at once (models/moe_model.cpp, linear4bit.cpp; GPU path: grouped experts).
  // Nothing here is fitted: each term names a tensor of the code.
  const double NK = N * double(c.top_k);
  const bool lq = targets(spec, "q_proj"), lk = targets(spec, "k_proj"), lv = targets(spec, "v_proj"),
             lo = targets(spec, "o_proj");
  const double heads = double(c.heads), r_bytes = r * d;
  // Attention, saved until its own backward: the normed input (for the q/k/v LoRA A), the q/k
  // norm inputs and statistics, SDPA's q, k, v, output and log-sum-exp, the post-norm input and
  // statistics, each LoRA's [tokens, r] intermediate.
  double attn_saved = N * 4 + N * H * d + N * 4;  // input norm rstd; post-norm input h and its rstd
  if (lq || lk || lv) attn_saved += N * H * d;
  if (c.qk_norm != model::QkNorm::None) attn_saved += N * (qd + kvd) * d + N * 4 * (heads + double(c.kv_heads));
  attn_saved += N * (qd + 2 * kvd) * d + N * qd * d + N * heads * 4;
  attn_saved += N * r_bytes * double(int(lq) + int(lk) + int(lv) + int(lo));
  // SDPA's math path on a GPU: flash attention takes head dims up to 256 and the memory-efficient
  // kernel no grouped-query heads, so wider heads (Gemma 4's full layers: 512, 2 kv heads) run
  // the math backend, which computes in fp32 and saves q, k and v (k, v repeated to every head)
  // and the attention probabilities [mb, heads, T, T] for its backward; that backward adds the
  // probabilities' gradient and the softmax's, the same size.
  double attn_math_saved = 0, attn_math_backward = 0;
  for (int i = 0; on_gpu && i < c.layers; ++i) {
    if (c.head_dim_at(i) <= 256) continue;
    const double probs = double(spec.micro_batch_size) * heads * double(spec.sequence_len) * double(spec.sequence_len) * 4;
    attn_math_saved = std::max(attn_math_saved, 3 * N * heads * double(c.head_dim_at(i)) * 4 + probs);
    attn_math_backward = std::max(attn_math_backward, 2 * probs);
  }
  attn_saved += attn_math_saved;
  // Gated delta-rule layers: their saved tensors where more than attention's, their chunked backward.
  const model::LinearAttentionBytes linear_attn =
      model::linear_attention_bytes(c, double(spec.micro_batch_size), double(spec.sequence_len), d, r_bytes);
  attn_saved = std::max(attn_saved, linear_attn.saved);
  // MoE, saved: router probabilities (fp32), top-k indices and weights, the dispatch's three
  // int64 permutations, gate and up (swiglu), the routed outputs in expert order (the combine's,
  // for the weights' gradient), and with expert LoRA its inputs, [pairs, r] intermediates, the
  // gate/up deltas and down's delta (the combine's too).
  // Which expert matrices get LoRA: by module name, or as peft's fused parameters (gate and up
  // share gate_up_proj's).
  const bool per_module = spec.lora.target_parameters.empty();
  const bool lora_gate = per_module ? targets(spec, expert[0]) : fused_gate_up;
  const bool lora_up = per_module ? targets(spec, expert[1]) : fused_gate_up;
  const bool lora_down = per_module ? targets(spec, expert[2]) : fused_down;
  const bool le = moe_layers > 0 && (lora_gate || lora_up || lora_down);
  const double moe_small = N * E * 4 + NK * (8 + 4 + d) + 3 * NK * 8 + model::routed_input_saved_bytes(c, NK, d);
  const double gate_up = 2 * NK * I * d, routed_out = NK * H * d;
  // With LoRA on both gate and up (or on gate_up_proj) the GPU's SwiGLU adds their deltas itself,
  // so it keeps the two deltas beside gate and up (models/fused.h).
  const double gate_up_deltas = on_gpu && lora_gate && lora_up && model::fused_swiglu_lora(c) ? gate_up : 0;
  // With LoRA on down (down_proj or the fused down parameter) the GPU's combine adds its delta and
  // keeps it for the weights' gradient, beside the routed outputs.
  const double down_delta = on_gpu && moe_layers > 0 && lora_down ? NK * H * d : 0;
  const double expert_lora = le ? NK * H * d + NK * I * d + 3 * NK * r_bytes + gate_up_deltas + down_delta : 0;
  const double combine_saved = routed_out + down_delta;  // freed by the combine's backward
  // The expert LoRA reads the dispatch's and SwiGLU's second outputs (gather_rows_twice,
  // swiglu_twice), so its input gradients stay apart from the base GEMMs' until those backward
  // kernels sum them: one more [pairs, hidden] through gate/up's backward and one more
  // [pairs, I] from down's backward to SwiGLU's.
  const double lora_dx = on_gpu && moe_layers > 0 && (lora_gate || lora_up) ? NK * H * d : 0;
  const double lora_dact = on_gpu && moe_layers > 0 && lora_down && model::fused_swiglu_lora(c) ? NK * I * d : 0;
  const double shared = model::beside_experts_saved_bytes(c, N, d);
  // The bank: every expert's matrix dequantised at once, or the largest slice of it
  // (expert_dequant_chunk; GPU only: the CPU runs the per-expert loop).
  // Streamed in groups, a bank is one group's experts (models/moe_model.cpp: experts_forward).
  const double Eb = p.group_size > 0 ? double(p.group_size) : E;
  double bank = moe_layers > 0 && fmt ? Eb * I * H * d : 0;  // held 4-bit (NVFP4 without load_in_4bit too)
  if (const std::int64_t max = spec.bank_bytes; bank > 0 && max > 0 && on_gpu) {
    const auto e = std::int64_t(Eb), h = std::int64_t(H), i = std::int64_t(I), el = std::int64_t(d);
    bank = std::max(Eb * H * d * double(model::bank_slice(i, e, h, el, max)), Eb * I * d * double(model::bank_slice(h, e, i, el, max)));
  }
  // Banks a recompute keeps for its backward (expert_bank_reuse; whole banks on a GPU, none when
  // streamed in groups), beside the one bank each phase holds anyway: with `all`, gate's and
  // up's until their backward.
  const bool keep_all = bank > 0 && p.group_size == 0 && spec.bank_reuse == model::BankReuse::All;
  const bool keep_down = bank > 0 && p.group_size == 0 && spec.bank_reuse == model::BankReuse::Down;
  const double kept_gate_up = keep_all ? 2 * bank : 0;
  // Gradients in flight on the residual stream: the block's output gradient and its input's.
  const double residual = 2 * N * H * d;
  double block = 0;
  std::string block_phase;
  auto phase = [&](const char* name, double bytes) {
    if (bytes > block) {
      block = bytes;
      block_phase = name;
    }
  };
  if (moe_layers > 0) {
    const double saved = attn_saved + moe_small + gate_up + routed_out + expert_lora + shared;
    // Recompute, at the down projection: x_sorted, gate, up, swiglu's output, the bank, y.
    phase("recompute (down projection)",
          attn_saved + moe_small + shared + NK * H * d + gate_up + NK * I * d + bank + kept_gate_up + NK * H * d);
    // The recompute done: its saved tensors, the kept banks and the block's output.
    if (keep_all || keep_down) phase("recompute end (banks kept)", saved + (keep_all ? 3 : 1) * bank + N * H * d);
    // Backward of the down projection: the combine's gradient in expert order, the bank, dH.
    phase("down-projection backward", saved - combine_saved + NK * H * d + bank + kept_gate_up + NK * I * d + lora_dact);
    // SwiGLU's backward: dH (and the down LoRA's) beside gate and up, and dGate, dUp.
    phase("swiglu backward", saved - combine_saved + NK * I * d + lora_dact + gate_up + kept_gate_up);
    // Backward of gate / up: dGate and dUp in place of the freed gate and up, the bank (and the
    // other one still kept), dX from gate and from up (and the expert LoRA's).
    phase("gate/up backward", saved - combine_saved + bank + kept_gate_up / 2 + 2 * NK * H * d + lora_dx);
    // The dispatch's backward: dX in expert order, gathered back and summed per token.
    phase("dispatch backward", attn_saved + moe_small + shared + 2 * NK * H * d + N * H * d);
  }
  if (dense_layers > 0) {
    const double W = double(c.dense_width);
    phase("dense MLP backward", attn_saved + 3 * N * W * d + N * H * d + W * H * d);
  }
  // Attention backward: SDPA's gradients (dq accumulated in fp32) beside what it saved.
  phase("attention backward", attn_saved + N * (qd + 2 * kvd) * d + N * qd * 4 + attn_math_backward);
  if (linear_attn.backward > 0) phase("delta-rule backward", attn_saved + linear_attn.backward);
  block += residual;
  p.device.push_back({"block", block, "one block's recompute + backward, peak at the " + block_phase + " (" +
                                          std::to_string(static_cast<long long>(NK)) + " token-expert pairs" +
                                          (bank > 0 ? ", dequantised bank " + human_bytes(bank) +
                                                          (p.group_size > 0 ? " (a group of " + std::to_string(p.group_size) + " experts)" : std::string())
                                                    : std::string()) +
                                          (keep_all ? ", 2 more kept from the recompute for its backward" : std::string()) +
                                          (attn_math_saved > 0 ? ", SDPA's math path for heads over 256 keeps " +
                                                                     human_bytes(attn_math_saved) + " in fp32"
                                                               : std::string()) + ")"});

  // ---- the head: the normed hidden and per-row log-sum-exp saved, the targets; one chunk of
  // logits in flight (forward: the GEMM's output, its fp32 copy and logsumexp's fp32 temporary;
  // backward: the GEMM's output, its fp32 softmax gradient and that cast back), the hidden's
  // gradient. It runs before the blocks' backward, so the peak holds the larger of head and block.
  const double rows = double(spec.micro_batch_size) * double(std::max(1, spec.sequence_len - 1));
  const double chunk = double(model::loss_chunk_rows(std::int64_t(rows), std::int64_t(V)));
  const double head = rows * (H * d + 4 + 8) + std::max(chunk * V * (d + 4 + 4), chunk * V * (d + 4 + d) + rows * H * d) +
                      rows * H * d;
  p.device.push_back({"head", head, "chunked cross entropy, " + std::to_string(static_cast<long long>(chunk)) + " rows per chunk"});

  // ---- CUDA graphs (runtime/block_graphs.h) replay on static buffers that are copies beside the
  // eager tensors they stand for: the block input (shared by forward, recompute and the loss),
  // the incoming gradient and the output (shared by every use), each [tokens, hidden], and the two
  // RoPE tables. Planned wherever graphs may run (cuda_graphs not false, and the uses can replay);
  // where auto turns them off for want of room, the plan is over by these bytes. Their
  // temporaries live in the graphs' own pool, which the fit check adds.
  if (on_gpu && spec.cuda_graphs != Setting::Off && spec.graphs_blocked.empty())
    p.device.push_back({"graphs", 3 * N * H * d + 2 * N * rope_cols * d,
                        "CUDA graphs' static buffers: block input, gradient, output, RoPE tables (cuda_graphs: false drops them)"});

  // The portable grouped GEMM's problem table (models/expert_gemm_cuda.h): 60 bytes per expert for
  // each GEMM in flight; a few of a block's GEMMs may be queued at once.
  if (on_gpu && spec.expert_gemm != ExpertGemmSetting::Torch)
    p.device.push_back({"expert gemm", 8.0 * 64 * double(c.experts),
                        "portable grouped GEMM problem tables (expert_gemm: torch has none)"});

  p.device_peak = 0;
  for (const auto& part : p.device)
    if (part.name != "block" && part.name != "head") p.device_peak += part.bytes;
  p.device_peak += std::max(block, head);
  // What the caching allocator holds beyond what it hands out at that peak (block rounding,
  // segments split by earlier allocations, cuBLAS workspaces): device_memory_limit caps the held
  // bytes, so the start-up check wants peak + margin. Measured on the H200 (docs/benchmarks.md):
  // held exceeds the allocated peak by 3-26%, but the allocator frees its cached blocks and
  // retries before it fails, so only fragmentation is fatal; 15% + 256 MiB covers the rows
  // measured short of the worst cache.
  p.margin = on_gpu ? 0.15 * p.device_peak + double(std::int64_t(256) << 20) : 0;
  return p;
}

FittedPlan fit_plan(const RunSpec& spec, double available) {
  FittedPlan f{spec, plan_memory(spec)};
  const bool gpu = spec.on_gpu;
  auto over = [&] { return f.plan.device_peak + f.plan.margin > available; };
  if (gpu && spec.bank_reuse_auto && over()) {
    RunSpec down = f.spec;
    down.bank_reuse = bank_reuse_in_effect(gpu, down.bank_bytes, down.checkpointing, model::BankReuse::Down);
    if (const MemoryPlan p = plan_memory(down); p.device_peak < f.plan.device_peak) {
      f.down_from = f.plan.device_peak;
      f.plan = p;
      f.spec = down;
    }
  }
  // expert_group_size: auto: the largest group (the block's experts halved, rounded up, until one
  // does) whose plan fits; where none does, the smallest group if it lowers the peak.
  if (gpu && spec.offload && spec.group_auto && f.spec.group_size == 0 && over()) {
    FittedPlan best = f;
    for (int g = (spec.model.experts + 1) / 2; g >= 1; g = g == 1 ? 0 : (g + 1) / 2) {
      RunSpec grouped = f.spec;
      grouped.group_size = g;
      const MemoryPlan p = plan_memory(grouped);
      if (p.device_peak >= best.plan.device_peak) continue;
      best.spec = grouped;
      best.plan = p;
      if (p.device_peak + p.margin <= available) break;
    }
    if (best.spec.group_size > 0) {
      best.grouped_from = f.plan.device_peak;
      f = best;
    }
  }
  if (gpu && spec.bank_auto && over()) {
    RunSpec sliced = f.spec;
    sliced.bank_bytes = kAutoBankSliceBytes;
    sliced.bank_reuse = bank_reuse_in_effect(gpu, sliced.bank_bytes, sliced.checkpointing, f.spec.bank_reuse);
    if (const MemoryPlan p = plan_memory(sliced); p.device_peak < f.plan.device_peak) {
      f.sliced_from = f.plan.device_peak;
      f.plan = p;
      f.spec = sliced;
    }
  }
  return f;
}

std::string describe_plan(const MemoryPlan& plan, double vram) {
  std::ostringstream os;
  char line[256];
  os << "memory plan (per rank, " << compute_name(plan.compute) << " compute):\n";
  for (const auto& part : plan.device) {
    // The description streamed after the fixed columns: a long one must not be cut (or lose its newline).
    std::snprintf(line, sizeof line, "  %-12s %10s  ", part.name.c_str(), human_bytes(part.bytes).c_str());
    os << line << part.what << "\n";
  }
  std::snprintf(line, sizeof line, "  %-12s %10s  predicted allocator peak: all but block and head, plus the larger of those\n", "peak VRAM",
                human_bytes(plan.device_peak).c_str());
  os << line;
  if (plan.margin > 0) {
    std::snprintf(line, sizeof line, "  %-12s %10s  allocator headroom the start-up check adds (15%% + 256 MiB)\n", "margin",
                  human_bytes(plan.margin).c_str());
    os << line;
  }
  if (plan.disk_homes) {
    std::snprintf(line, sizeof line, "  %-12s %10s  per rank: the disk homes' read ring, %d buffers of %s (%s for %d rank(s) on a node)%s\n",
                  "pinned host", human_bytes(plan.host_pinned).c_str(), plan.disk_ring,
                  human_bytes(plan.disk_ring_bytes / std::max(1, plan.disk_ring)).c_str(),
                  human_bytes(plan.host_pinned * plan.ranks_per_node).c_str(), plan.ranks_per_node,
                  plan.host_pinned > plan.disk_ring_bytes ? " (+ parked block inputs)" : "");
    os << line;
    std::snprintf(line, sizeof line, "  %-12s %10s  one homes file per host on the drive (expert_offload_disk_path)\n", "disk homes",
                  human_bytes(plan.disk_file_bytes).c_str());
    os << line;
    std::snprintf(line, sizeof line,
                  "  %-12s %10s  per rank and optimizer step: %lld block copies read from the drive (%s per step for %d rank(s) on a node)\n",
                  "disk reads", human_bytes(plan.disk_reads_per_step).c_str(), static_cast<long long>(plan.copies_per_step),
                  human_bytes(plan.disk_reads_per_step * plan.ranks_per_node).c_str(), plan.ranks_per_node);
    os << line;
  } else if (plan.host_pinned > 0 && plan.shared_homes) {
    std::snprintf(line, sizeof line, "  %-12s %10s  per NUMA node: one copy of the homes mapped by its %d rank(s)%s\n", "pinned host",
                  human_bytes(plan.host_pinned).c_str(), plan.ranks_per_node,
                  plan.host_pinned > plan.expert_bytes ? " (+ each rank's parked block inputs)" : "");
    os << line;
  } else if (plan.host_pinned > 0) {
    std::snprintf(line, sizeof line, "  %-12s %10s  per rank (%s for %d rank(s) on a node)\n", "pinned host",
                  human_bytes(plan.host_pinned).c_str(), human_bytes(plan.host_pinned * plan.ranks_per_node).c_str(),
                  plan.ranks_per_node);
    os << line;
  }
  if (plan.host_lora > 0) {
    std::snprintf(line, sizeof line, "  %-12s %10s  per rank: the experts' LoRA (%s parameters: fp32 master, gradient, AdamW moments)\n",
                  "host LoRA", human_bytes(plan.host_lora).c_str(),
                  std::to_string(static_cast<long long>(plan.expert_lora_params)).c_str());
    os << line;
  }
  if (vram > 0) {
    const double need = plan.device_peak + plan.margin;
    const bool fits = need <= vram;
    os << "  " << (fits ? "fits" : "does NOT fit") << " a " << human_bytes(vram) << " card ("
       << human_bytes(std::fabs(vram - need)) << (fits ? " to spare" : " short") << ", margin included)\n";
  }
  return os.str();
}

double host_ram_per_node(const MemoryPlan& p) {
  return (p.shared_homes ? p.host_pinned : p.host_pinned * p.ranks_per_node) + p.host_lora * p.ranks_per_node;
}

HostRamFit describe_host_ram(const RunSpec& spec, const MemoryPlan& plan, double host_ram, const std::string& source) {
  HostRamFit out;
  if (!spec.offload || host_ram <= 0) return out;
  // Pinned host RAM per node: a copy per rank (per_rank, and each rank's ring with disk), one per
  // NUMA node (counted as one here: the plan does not know the node's NUMA layout).
  auto per_node = [](const MemoryPlan& p) { return host_ram_per_node(p); };
  const double need = per_node(plan);
  out.fits = need <= host_ram;
  std::ostringstream os;
  os << "  host RAM " << (out.fits ? "fits" : "does NOT fit") << ": " << human_bytes(need) << " pinned per node"
     << (plan.shared_homes ? " (per NUMA node)" : "") << " of " << human_bytes(host_ram) << " (" << source << ")";
  if (!out.fits) {
    std::vector<std::string> tries;
    for (const auto& [homes, name] : {std::pair{offload::HomesKind::PerNumaNode, "per_numa_node"},
                                      std::pair{offload::HomesKind::Disk, "disk"}}) {
      if (spec.homes == homes) continue;
      if (homes == offload::HomesKind::Disk && spec.group_size > 0) continue;  // groups read the homes in RAM
      RunSpec other = spec;
      other.homes = homes;
      const MemoryPlan q = plan_memory(other);
      if (homes == offload::HomesKind::PerNumaNode && plan.ranks_per_node <= 1) continue;  // nothing to share
      tries.push_back(std::string("expert_offload_homes: ") + name + " (" + human_bytes(per_node(q)) +
                      (q.disk_homes ? " per node + " + human_bytes(q.disk_file_bytes) + " on a local drive, reading " +
                                          human_bytes(q.disk_reads_per_step) + " per rank and step"
                                    : std::string(" per NUMA node")) +
                      ")");
    }
    if (!tries.empty()) os << "; try " << join(tries, " or ");
  }
  os << "\n";
  out.text = os.str();
  return out;
}

}  // namespace eo
