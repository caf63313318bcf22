#include "runtime/plan.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "common/text.h"
#include "offload/layout.h"

namespace eo {
namespace {

double nf4_bytes(double out, double in, int blocksize) {
  const double n = out * in;
  return std::ceil(n / 2) + std::ceil(n / blocksize) * 4;
}



bool targets(const TrainConfig& cfg, const std::string& name) {
  if (cfg.lora_target_linear) return true;
  return std::find(cfg.lora_target_modules.begin(), cfg.lora_target_modules.end(), name) != cfg.lora_target_modules.end();
}

}  // namespace

MemoryPlan plan_memory(const TrainConfig& cfg, const model::ModelConfig& c, bool bf16, int ranks_per_node, bool on_gpu) {
  MemoryPlan p;
  p.on_gpu = on_gpu;
  p.bf16 = bf16;
  p.ranks_per_node = ranks_per_node;
  const double d = bf16 ? 2 : 4;  // compute dtype bytes
  const int bs = cfg.bnb_4bit_blocksize;
  const double H = double(c.hidden), V = double(c.vocab), D = double(c.head_dim);
  const double qd = double(c.heads) * D, kvd = double(c.kv_heads) * D;
  const double E = double(c.experts), K = double(c.top_k), I = double(c.expert_width);
  const bool q4 = cfg.load_in_4bit;
  auto linear = [&](double out, double in) { return q4 ? nf4_bytes(out, in, bs) : out * in * d; };

  int moe_layers = 0;
  for (int i = 0; i < c.layers; ++i) moe_layers += c.is_moe_layer(i) ? 1 : 0;
  const int dense_layers = int(c.layers) - moe_layers;

  // ---- frozen weights on the device (on a GPU the untied input embedding table stays in host
  // memory: model::LoadOptions::embeddings_on_host)
  const bool host_embeddings = p.on_gpu && !c.tie_word_embeddings;
  double weights = V * H * d * (c.tie_word_embeddings || host_embeddings ? 1 : 2) + H * d;
  double attn = 0;  // q/k/v/o, or DeepSeek's latent-attention linears
  for (const auto& l : c.attention_shapes()) attn += linear(double(l.out), double(l.in));
  double norms = 2 * H * d;
  if (c.qk_norm == model::QkNorm::PerHead) norms += 2 * D * d;
  if (c.qk_norm == model::QkNorm::Whole) norms += (qd + kvd) * d;
  weights += double(c.layers) * (attn + norms);
  weights += double(moe_layers) * E * H * d;  // routers
  weights += double(dense_layers) * 3 * linear(double(c.dense_width), H);
  if (c.shared_expert_width > 0) weights += double(moe_layers) * (3 * linear(double(c.shared_expert_width), H) + H * d);
  p.device.push_back({"weights", weights,
                      std::string(host_embeddings ? "lm_head (input embeddings in host RAM)" : "embeddings, lm_head") +
                          ", norms, routers, attention" + (q4 ? " (NF4)" : "")});

  // ---- experts
  // One MoE block's experts exactly as the offload engine lays them out (offload/layout.h).
  p.block_bytes = double(offload::expert_block_bytes(c, bs, cfg.bnb_4bit_use_double_quant));
  p.expert_bytes = p.block_bytes * moe_layers;
  if (cfg.expert_offload) {
    const int slots = std::min(moe_layers, cfg.expert_offload_prefetch ? 1 + cfg.expert_offload_prefetch_depth : 1);
    double budget = 0;
    if (cfg.expert_offload_vram_budget != "auto")
      if (auto b = parse_bytes(cfg.expert_offload_vram_budget))
        budget = std::floor(double(*b) / p.block_bytes) * p.block_bytes;
    budget = std::min(budget, p.expert_bytes);
    p.device.push_back({"experts", double(slots) * p.block_bytes + budget,
                        std::to_string(slots) + " slot(s) of " + human_bytes(p.block_bytes) +
                            (budget > 0 ? " + " + human_bytes(budget) + " of resident blocks" : std::string())});
    p.host_pinned = p.expert_bytes;
    p.shared_homes = cfg.expert_offload_homes == "per_numa_node";
  } else {
    // Resident experts are separate tensors (no arena alignment).
    p.device.push_back({"experts", double(moe_layers) * E * 3 * (q4 ? nf4_bytes(I, H, bs) : I * H * d), "every expert resident"});
  }

  // ---- LoRA: fp32 parameter, gradient and two AdamW moments
  const double r = cfg.lora_r;
  double lora_params = 0;
  auto site = [&](const std::string& name, double in, double out, double count) {
    if (targets(cfg, name)) lora_params += count * r * (in + out);
  };
  for (const auto& l : c.attention_shapes()) site(l.name, double(l.in), double(l.out), double(c.layers));
  const bool mix = c.arch == model::Arch::Mixtral;
  site(mix ? "w1" : "gate_proj", H, I, moe_layers * E);
  site(mix ? "w3" : "up_proj", H, I, moe_layers * E);
  site(mix ? "w2" : "down_proj", I, H, moe_layers * E);
  if (dense_layers > 0) {
    site("gate_proj", H, double(c.dense_width), dense_layers);
    site("up_proj", H, double(c.dense_width), dense_layers);
    site("down_proj", double(c.dense_width), H, dense_layers);
  }
  p.device.push_back({"lora", lora_params * 16, std::to_string(static_cast<long long>(lora_params)) + " parameters x 16 bytes"});

  // ---- activations of one micro-batch
  const double N = double(cfg.micro_batch_size) * double(cfg.sequence_len);
  // Block inputs kept by checkpointing (embedding output .. last block) and the RoPE tables of
  // every micro-batch of the step (the layer-major step keeps all g until backward; micro-batch-
  // major, one), the hidden state or incoming gradient of each, and the outgoing gradient of the
  // block under backward. With activation_offloading the inputs wait in pinned host RAM and about
  // two blocks' worth are on the device (the one in backward and the one being copied back).
  const bool layer_major = cfg.gradient_checkpointing && cfg.step_order == "layer_major";
  const double g = layer_major ? double(cfg.gradient_accumulation_steps) : 1.0;
  const double kept = cfg.activation_offloading ? std::min(2.0, double(c.layers)) : double(c.layers);
  const double checkpoints = (g * (kept + 1) + 2) * N * H * d + g * 2 * N * D * d;
  p.device.push_back({"checkpoints", checkpoints,
                      std::to_string(static_cast<long long>(kept)) + " block inputs of [tokens, hidden] x " +
                          std::to_string(static_cast<long long>(g)) + " micro-batch(es) + gradients" +
                          (cfg.activation_offloading ? " (the rest parked in host RAM)" : "")});
  if (cfg.activation_offloading) p.host_pinned += g * double(c.layers) * N * H * d;

  // One block recomputed for backward: what autograd saves (fp32 norm inputs, q/k norms, RoPE,
  // attention inputs and output) ...
  const double saved_attn = 2 * H * (4 + d) + (qd + kvd) * (4 + d) + 2 * (qd + kvd) * d + (qd + 2 * kvd) * d + 2 * qd * d;
  // ... the router's probabilities and, per (token, expert) row, the expert activations (gate
  // and up of width I, the weighted output of width H; swiglu saves no third tensor) ...
  const double NK = N * K;
  const double saved_moe = moe_layers > 0 ? E * (4 + d) + K * ((2 * I + H) * d + 16) : 3 * double(c.dense_width) * d;
  // ... and the gradients in flight inside it.
  const double grads = moe_layers > 0 ? K * (2 * H + 2 * I) * d : 2 * double(c.dense_width) * d;
  // Two phases bound the block's peak: the expert GEMMs' backward (one dequantised matrix bank
  // of every expert plus the activations, of which autograd has freed some: x 0.72) and the
  // token-combine / attention backward (more activation tensors alive at once, no bank: x 1.8).
  // Both factors are fitted to the allocator peaks eo-bench measured on the H200 (Qwen3-30B-A3B
  // and OLMoE shapes, 2048 x 1 and x 4, every mode; docs/benchmarks.md, runs 1 and 3).
  constexpr double kActivationsWithBank = 0.72, kActivationsWithoutBank = 1.8;
  const double bank = moe_layers > 0 && q4 ? E * I * H * d : 0;
  const double activations = N * (saved_attn + saved_moe + grads);
  const double block = std::max(kActivationsWithBank * activations + bank, kActivationsWithoutBank * activations);
  p.device.push_back({"block", block,
                      "one block's recompute + backward (expert activations for " + std::to_string(static_cast<long long>(NK)) +
                          " token-expert pairs, one dequantised matrix bank of " + human_bytes(bank) + ")"});

  // The head: normed hidden and per-row log-sum-exp saved; one chunk of logits in flight
  // (bf16 GEMM output, its fp32 copy and the fp32 softmax gradient). It runs before the blocks'
  // backward, so the peak holds the larger of head and block, not both.
  const double rows = double(cfg.micro_batch_size) * double(std::max(1, cfg.sequence_len - 1));
  const double chunk = std::min(rows, std::max(1.0, std::floor(double(std::int64_t(1) << 27) / (4 * V))));
  const double head = rows * (H * d * 2 + 4) + chunk * V * (d + 4 + 4);
  p.device.push_back({"head", head, "chunked cross entropy, " + std::to_string(static_cast<long long>(chunk)) + " rows per chunk"});

  p.device_peak = 0;
  for (const auto& part : p.device)
    if (part.name != "block" && part.name != "head") p.device_peak += part.bytes;
  p.device_peak += std::max(block, head);
  return p;
}

std::string describe_plan(const MemoryPlan& plan, double vram) {
  std::ostringstream os;
  char line[256];
  os << "memory plan (per rank, " << (plan.bf16 ? "bf16" : "fp32") << " compute):\n";
  for (const auto& part : plan.device) {
    std::snprintf(line, sizeof line, "  %-12s %10s  %s\n", part.name.c_str(), human_bytes(part.bytes).c_str(), part.what.c_str());
    os << line;
  }
  std::snprintf(line, sizeof line, "  %-12s %10s  predicted allocator peak: all but block and head, plus the larger of those\n", "peak VRAM",
                human_bytes(plan.device_peak).c_str());
  os << line;
  if (plan.host_pinned > 0 && plan.shared_homes) {
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
  if (vram > 0) {
    const bool fits = plan.device_peak <= vram;
    os << "  " << (fits ? "fits" : "does NOT fit") << " a " << human_bytes(vram) << " card ("
       << human_bytes(std::fabs(vram - plan.device_peak)) << (fits ? " to spare" : " short") << ")\n";
  }
  return os.str();
}

}  // namespace eo
