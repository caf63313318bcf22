// The experts' LoRA state beside the streamed experts (expert_offload with expert LoRA): for every
// offloaded MoE block the fp32 masters, their gradients and AdamW's moments live in host memory
// (pinned), and the device holds only working copies of the blocks in use.
//
//   stage(i)   block i's masters are copied into one of kExpertLoraWorkingCopies fixed device
//              slots (allocated once, reused stint after stint, like the expert slots), whose views
//              become the leaves the block's ExpertLora reads. A block already in a slot copies
//              nothing (the forward/backward turn, a block copied ahead); otherwise it takes the free
//              slot with the lowest index, else the least recent block's, which leaves first and
//              takes its gradient home.
//   before_backward(i)  block i's gradients in its slot: the sum it took home earlier this step
//              (micro-batch-major), else zeros; the leaves' .grad are views of the slot from then on,
//              so the backward adds in place, in the order resident training adds.
//   set_schedule(order)  the stage() order of one step (the MoE layers, as the expert engine gets
//              it; it repeats every step): stage(i) then also copies the masters of the block staged
//              next into the other slot, so they cross while block i computes. Each slot's copies
//              (masters up, the leaving block's gradients home) run on a copy stream of their own,
//              after an event recorded when the slot's last block stopped being used; the compute
//              stream waits for a slot's copies only where it reads the slot. A new schedule starts
//              from free slots. The stream is this store's, not the expert engine's: offload/ knows
//              nothing of LoRA, and a block's two copies share the host link either way.
//   flush()    after the backward: every gradient home, every slot free; the compute stream then
//              waits for the copy stream, so whatever reads them next finds them home.
//   grad_norm(...)  on one rank, the step's global gradient norm on the device: each block's
//              per-leaf norms are taken on the device as its gradient leaves for home (the last
//              time in a step is its whole gradient), and combined with the device parameters'
//              in the model's order, so the step is decided on the device and the host reads it a
//              step late, as without the experts' LoRA on the host. Across ranks the gradients
//              are all-reduced on the host first (reduce_and_norm), and the step reads them there.
//   step(...)  records the step's AdamW update (learning rate, skip flag, clip divisor: TrainStep's
//              decision); each block's share runs on the device when the
//              block is next staged: its gradient and AdamW moments cross with its masters, the
//              resident Optimizer's kernels (adamw_update) update the slot in place before any use
//              reads it, and masters and moments go home on the copy stream while the block
//              computes. apply_update() brings in every share still outstanding (checkpoints, the
//              final adapter, an evaluation's or a save's read of the step).
// Why on the device and not on the host: a host AdamW reads and writes 28 bytes a parameter of host
// memory (Qwen3-30B-A3B at r 16: 629 M parameters, 17.6 GB a step) and must finish block i before
// the next forward reaches it. On the H100 machine (6fef652) the step with it took 2.01x (r 16) and
// 2.27x (r 32) the attention-only step, against 1.27x with the whole state on the device. On the
// device a block's update is a few kernels over its slot, and the bytes it adds cross the host link
// beside the experts' (36 a parameter a step in all, 12 with the host update), where a
// gradient-accumulated step has room for them (design.md §2.4). The update is the resident one
// (same kernels, same gradient norm, same decision), so a checkpoint is the same files either way.
//
// The staging is driven through the model's WeightProvider (ExpertLoraOffload::wrap): whatever
// stages a block's experts (the step runner, evaluation, scoring) stages its LoRA too, and the
// provider's placement() names the LoRA slot beside the experts' (a CUDA graph replays only on
// the addresses it captured: the slot's, the same every step since every step starts from free
// slots). Uses must be checkpointed (a kept autograd graph would hold a working copy past its
// stint).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/device.h"
#include "runtime/optimizer.h"

namespace eo {

namespace model {
class MoeModel;
class WeightProvider;
class ExpertLora;
}  // namespace model
namespace ddp {
class Communicator;
}
struct TrainConfig;

// Blocks whose working copies the device holds at once (the plan counts the same number).
inline constexpr int kExpertLoraWorkingCopies = 2;

// Bytes for `params` expert-LoRA parameters of which `block_params` belong to the largest block:
// on the host fp32 master, gradient and two moments; on the device the same four for each working
// copy (the moments and gradient cross for the block's update). One rule for the plan and the code.
struct ExpertLoraBytes {
  double host = 0, device = 0;
};
ExpertLoraBytes expert_lora_bytes(double params, double block_params);
// Bytes the store copies each way in a layer-major step for `params` expert-LoRA parameters: up,
// the masters for the forward's and the backward's stints and the update's moments and gradient
// (20 a parameter); home, the updated masters and moments and the step's gradient (16). They share
// the host link with the experts (the step time's transfer floor counts the first).
struct ExpertLoraLinkBytes {
  double h2d = 0, d2h = 0;
};
ExpertLoraLinkBytes expert_lora_link_bytes(double params);

class ExpertLoraOffload {
 public:
  // Takes every MoE block's expert LoRA of `model` (already added) to host memory (pinned when
  // `pin` and `device` is a GPU); the blocks' ExpertLora read the host masters until staged.
  // `ranks`: the world's size (one rank: the gradient norm on the device, grad_norm()).
  ExpertLoraOffload(model::MoeModel& model, const at::Device& device, bool pin, const TrainConfig& cfg, int ranks = 1);
  ~ExpertLoraOffload();

  bool holds(const at::Tensor& param) const;  // a host master of this store
  const NamedTensors& params() const { return params_; }  // the host masters, in the model's order
  std::int64_t host_bytes() const;    // masters, gradients, moments (as expert_lora_bytes counts them)
  std::int64_t device_bytes() const;  // the slots: working copies with their gradients
  std::int64_t block_params_max() const { return block_params_max_; }

  // A WeightProvider that stages `inner`'s experts and this store's LoRA together.
  std::shared_ptr<model::WeightProvider> wrap(std::shared_ptr<model::WeightProvider> inner);
  void set_schedule(const std::vector<int>& staging_order);
  void stage(int layer);
  void before_backward(int layer);  // after stage(layer), before a backward of the block
  void flush();
  // The slot holding layer's working copies, -1 while it reads its host masters.
  int slot_of(int layer) const;

  // Whether the step's norm is taken on the device (grad_norm: one rank), else on the host
  // (reduce_and_norm, after the host gradients' all-reduce).
  bool norms_on_device() const { return norms_on_device_; }
  // One rank, after flush(): the global norm over every parameter in the model's order (`order`:
  // all parameters, the host ones this store's; `device_params` the others), fp64 [] on the
  // device, as grad_norm_on_device gives it over them all. No read of the device.
  at::Tensor grad_norm(const NamedTensors& order, const std::vector<at::Tensor>& device_params) const;
  // Several ranks: the step's host part, after flush() and the device's all-reduce, with `device_norms` the
  // per-parameter gradient norms of `device_params` (fp32, those with a gradient, in order; read
  // on the host). Across ranks the host gradients are all-reduced here (zeros where a rank has
  // none, as the GradReducer sends). Returns the global norm over every parameter in the model's
  // order (`order`: all parameters, the host ones this store's), fp64 [] on the host, computed as
  // grad_norm_on_device would over them all.
  at::Tensor reduce_and_norm(const NamedTensors& order, const at::Tensor& device_norms, ddp::Communicator* comm);
  // Records the step's AdamW update of every block (skip and grad_divisor: fp32 [] on any device),
  // each block's share applied when it is next staged. The gradients are taken (the next backward
  // starts from zero). The check returned gives 1 when a master or moment then holds NaN/Inf, else
  // 0; it brings the update in first where a share is still outstanding, and waits for the device
  // only until the update's last block is done. After a step failed midway (blocks still staged)
  // an update it cannot finish gives 0.
  using StateCheck = std::function<double()>;
  StateCheck step(double lr, const at::Tensor& skip, const at::Tensor& grad_divisor);
  // Applies every block's share of the recorded update still outstanding, and waits until the
  // masters and moments are home; between steps. A no-op when none is outstanding.
  void apply_update();
  // What the store did since the last take (metrics.jsonl, docs/runs.md): the bytes it copied each
  // way (masters, gradients, moments, step counters: they share the host link with the experts'),
  // and, across ranks, the host side's time: the queueing thread blocked reading a step's values
  // (the GPU finishing it; TrainStep adds it) and the host-held gradients' all-reduce and norms.
  struct StepStats {
    std::int64_t h2d_bytes = 0, d2h_bytes = 0;
    double read_s = 0, norm_s = 0;
    // lora_h2d_bytes, lora_d2h_bytes; with `host_side` lora_host_read_s, lora_host_norm_s too.
    nlohmann::json to_metrics(bool host_side) const;
  };
  void add_read_time(double seconds);
  StepStats take_step_stats();
  NamedTensors optimizer_state();
  void load_optimizer_state(const std::map<std::string, at::Tensor>& state);

 private:
  struct Param;
  struct Block;
  struct Slot {
    // Flat, a block's leaves back to back (Param::offset): working copies, their gradients, both
    // moments; and one fp32 step counter per leaf (Param::index).
    at::Tensor values, grads, exp_avg, exp_avg_sq, steps;
    int layer = -1;          // the block in it, -1: free
    bool pending = false;    // copies queued that the compute stream has not waited for
  };
  struct Copies;  // the copy stream and the slots' events (CUDA devices)
  // The recorded update (step()) while some block's share is outstanding.
  struct Update {
    std::int64_t id = 0;
    double lr = 0;
    at::Tensor skip, grad_divisor;  // on the device
  };
  int take_slot(int keep);  // a free slot, else the least recent block's other than `keep`'s
  void copy_in(int layer, int slot);
  void slot_copies(int slot, const std::function<void()>& copies);
  void wait_ready(int slot);
  void release(int slot);
  void evict(Block& b);
  void update_block(Block& b);  // its share of the update, in its slot (after wait_ready)
  double state_nonfinite(std::int64_t update);
  int index_of(const at::Tensor& param) const;  // in params_, -1 if not a host master
  // Per parameter in `order` with a gradient, its norm: the device's from `device_norms` (those
  // with a gradient, in order), the host ones' from `held` (by params_ index).
  std::vector<at::Tensor> norms_in_order(const NamedTensors& order, const at::Tensor& device_norms,
                                         const std::function<at::Tensor(std::size_t)>& held) const;

  at::Device device_;
  bool pin_;
  bool norms_on_device_;
  AdamWSettings adamw_;
  std::vector<std::unique_ptr<Block>> blocks_;  // by layer; null where nothing is held
  std::vector<int> staged_;                     // layers with working copies, least recent first
  std::vector<Slot> slots_;                     // kExpertLoraWorkingCopies, allocated once
  std::unique_ptr<Copies> copies_;              // after slots_: it waits for its stream first
  std::vector<int> schedule_;                   // set_schedule's order
  std::size_t cursor_ = 0;                      // the schedule's entry the next stage() should be
  int current_ = -1;                            // the staged block in use (stage()'s last)
  std::vector<Param*> flat_;                    // every leaf, by block
  std::vector<Param*> by_order_;                // params_' leaves
  // params_' places by tensor: the step's norm looks up every LoRA parameter (tens of thousands
  // with per-expert LoRA on every linear), so not by a scan.
  std::unordered_map<const c10::TensorImpl*, int> places_;
  NamedTensors params_;
  std::int64_t block_params_max_ = 0;
  std::optional<Update> update_;
  std::size_t blocks_outstanding_ = 0;          // blocks whose share of update_ is not applied
  std::int64_t updates_ = 0;                    // step() calls so far
  // One rank: the per-leaf gradient norms (fp32 [params_], on the device), each written as its
  // block's gradient leaves the slot.
  at::Tensor grad_norms_;
  // Per update not yet checked: the sum of the max-norms of every updated master and moment (fp64
  // [] on the device; NaN/Inf exactly when one of them holds such a value), and its copy to the
  // host, queued once the update's last block is done.
  struct StateCheckValue {
    at::Tensor amax;
    HostCopy read;
  };
  std::map<std::int64_t, StateCheckValue> state_amax_;
  StepStats stats_;
};

}  // namespace eo
