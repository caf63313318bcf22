// The step time on a card, predicted: the optimizer step's FLOPs per phase and bytes per phase
// (counted from config.json and the run's settings, the same facts the memory plan reads), each at
// the card's rate (runtime/cards.h) times an efficiency measured on the H100, plus the host-link
// transfer floor when experts are offloaded. What it counts and what it ignores:
// docs/step-time.md.
#pragma once

#include <string>
#include <vector>

#include "runtime/cards.h"
#include "runtime/plan.h"
#include "runtime/runspec.h"

namespace eo {

// One optimizer step's work (all micro-batches), per rank. FLOPs count multiply-adds as 2. The base
// weights are frozen: the GEMMs run forward, again in the checkpointed recompute, and once for the
// input gradient (3 passes); LoRA's two small GEMMs also run for their weight gradients (4 passes).
struct StepWork {
  double tokens = 0;              // sequence_len x micro_batch_size x gradient_accumulation_steps
  double expert_gemm_flops = 0;   // routed experts' grouped GEMMs (top_k of them per token)
  double other_gemm_flops = 0;    // attention projections, dense MLPs, shared experts, routers, LoRA
  double attention_flops = 0;     // QK^T and PV over each layer's context (causal, windows, chunks)
  // ... as computed, by the SDPA kernel each layer runs (models/attention_path.h): the fused kernel
  // skips what a query cannot see; the memory-efficient kernel is counted as computing every key. Layers
  // on flash's own forms (packed rows' Varlen layers, sliding layers' local window): their visible
  // keys on a card with flash attention (packed rows counted as whole rows, an upper bound: the
  // documents are shorter), every key through the mask on one without.
  double fused_attention_flops = 0;
  double flash_forms_flops = 0, flash_forms_masked_flops = 0;
  double masked_attention_flops = 0;
  double head_flops = 0;          // the LM head: forward and input gradient
  double dequant_bytes = 0;       // 4-bit expert banks read and bf16 banks written
  double expert_lora_bytes = 0;   // the experts' LoRA: its thin grouped GEMMs and their adds, by the bytes they move
  double elementwise_bytes = 0;   // adds, casts, norms, routing gathers / scatters, SwiGLU
  double layer_passes = 0;        // decoder layers x micro-batches: a fixed cost each (launches, host)
  int moe_layers = 0;
  double staged_bytes = 0;        // bytes copied host -> device per step (offloaded experts, their host-held LoRA), else 0
  bool prefetch = false;          // copies overlap compute (per block: the slower of the two)
};

StepWork step_work(const RunSpec& spec, const MemoryPlan& plan);

// Fraction of the card's rate each phase reaches, and the fixed cost of a layer pass. The defaults
// come from one H100 step (docs/benchmarks.md, "The step time predicted").
struct StepEfficiency {
  double expert_gemm = 0.6761;  // of bf16_tflops
  double other_gemm = 0.5272;
  double attention = 0.4676;
  // The memory-efficient kernel, every key counted: gpt-oss-20b's masked layers on the H100 (2048 x 4
  // resident, 6fef652), with the other phases as above.
  double masked_attention = 0.0600;
  double memory = 0.5209;       // of mem_gbps, for dequant and elementwise bytes
  // Of mem_gbps, for the experts' LoRA bytes: Qwen3-30B-A3B lora_target_parameters r 16 offloaded,
  // 2048 x 1 x g 8 at a 12 GiB cap on the H100 (4a30182), the other phases as above.
  double expert_lora = 0.3227;
  double layer_pass_s = 1.057e-3;
  // Of link_gbps, for a transfer-bound step: its copies wait on slots and events, so it runs above
  // its floor (Qwen3-30B-A3B 2048 x 1 offloaded on the H200: 1.096x).
  double link = 0.9125;
};

// The seconds a measured step spent per phase (a profiler's breakdown), and the efficiencies that
// reproduce them from the step's counted work on that card: how StepEfficiency's defaults were made
// (tests/test_step_time.cpp makes them again from the recorded H100 breakdown).
struct PhaseSeconds {
  double expert_gemm = 0, other_gemm = 0, attention = 0, memory = 0, fixed = 0;  // other_gemm includes the head
};
StepEfficiency calibrate_step_efficiency(const StepWork& work, const CardFigures& card, const PhaseSeconds& measured);

struct StepTime {
  struct Phase {
    std::string name;
    double seconds = 0;
  };
  std::vector<Phase> phases;  // compute phases, summed in compute_s
  double compute_s = 0;       // the step with every expert resident
  double transfer_s = 0;      // staged bytes at the card's link rate (the transfer floor)
  double step_s = 0;          // predicted s/step
  double tokens_per_s = 0;
};

StepTime predict_step_time(const StepWork& work, const CardFigures& card, const StepEfficiency& eff = {});

// The prediction as the plan prints it.
std::string describe_step_time(const StepTime& t, const CardFigures& card);

}  // namespace eo
