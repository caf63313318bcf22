// Everything a training run needs before its first step, in the order that loses the least when
// something is wrong: device and memory plan, host RAM for the expert homes, data (read and
// checked against the vocabulary), then the model, offload, LoRA, optimizer, resume, and the
// data-parallel start (rank 0's LoRA broadcast, the homes' checksum, gradient buckets).
#pragma once

#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "models/linear4bit.h"
#include "runtime/adapter_files.h"
#include "runtime/config.h"
#include "runtime/runspec.h"

namespace eo {

namespace ddp {
class World;
class Communicator;
class GradReducer;
}  // namespace ddp
namespace data {
class Batcher;
}
namespace model {
class MoeModel;
}
namespace offload {
class ExpertOffloader;
}
class Optimizer;
class ExpertLoraOffload;

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// The memory plan checked against the device at start-up, and what is decided from it.
struct PlanFit {
  RunSpec spec;                 // with expert_dequant_chunk and expert_bank_reuse's auto decided
  GraphFacts graphs;            // the plan's room for CUDA graphs' pool (decide_cuda_graphs)
};

// A GPU eo-ddp cannot run on (bf16 or fp32 compute on a card without bf16 tensor cores; no
// machine code for it in this build) is a UsageError naming the card and the fix.
void check_gpu_served(const at::Device& device, const ComputeChoice& compute);
// expert_gemm: auto | torch | portable decided for this device and compute dtype into
// spec.expert_gemm_kernel, expert_gemm_grouped and expert_gemm_why, once. portable where it has no
// kernel for the dtype here (fp32; fp16 below sm_75, bf16 below sm_80 code) is a UsageError.
void decide_expert_gemm(RunSpec& spec, const at::Device& device);

struct Run {
  RunSpec spec;                  // the settings resolved, as the memory plan decided them
  AdapterRecord adapter;         // what the adapter written at the end records beside its tensors
  at::Device device = at::kCPU;
  std::int64_t total_steps = 0;  // optimizer steps of the whole run
  std::int64_t warmup = 0;       // LR warm-up steps
  std::unique_ptr<data::Batcher> batcher;
  std::unique_ptr<data::Batcher> eval_rows;  // held-out rows (val_set_size / test_datasets), or null
  std::unique_ptr<model::MoeModel> model;
  std::shared_ptr<offload::ExpertOffloader> offloader;  // null without expert_offload
  NamedTensors lora;             // trainable parameters in order of use
  std::vector<int> lora_blocks;  // the decoder block of each
  std::unique_ptr<Optimizer> optimizer;  // the parameters on the device
  // With spec.expert_lora_offload: the experts' LoRA masters, gradients and AdamW state on the
  // host (its masters are in `lora` too, under their names), else null.
  std::unique_ptr<ExpertLoraOffload> expert_lora;
  std::int64_t step = 0;         // steps done (a resumed run starts after its checkpoint)
  std::string resumed_from;      // checkpoint folder, or empty
  nlohmann::json resumed_extra = nlohmann::json::object();  // counters saved in the checkpoint
  std::unique_ptr<ddp::Communicator> comm;
  std::unique_ptr<ddp::GradReducer> reducer;  // null in a world of one

  Run();
  ~Run();
  Run(Run&&) noexcept;
};

// `model`: base_model's config.json, parsed once for the run.
Run setup_run(const TrainConfig& cfg, const model::ModelConfig& model, ddp::World& world);

// The RNG state a checkpoint saves, and its restore.
NamedTensors rng_state(const at::Device& device);
void restore_rng(const NamedTensors& state, const at::Device& device);

// expert_offload_vram_budget: auto, after the first step: what the device can still give, less
// the step's activation peak and a margin, becomes budget-resident blocks.
void size_auto_budget(offload::ExpertOffloader& off, const at::Device& device, std::int64_t step_start_allocated);

}  // namespace eo
