#include "runtime/expert_lora_offload.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <utility>

#include "common/error.h"
#include "models/lora.h"
#include "models/moe_model.h"
#include "models/weights.h"
#include "runtime/ddp/comm.h"
#include "runtime/optimizer.h"

#ifdef EO_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <array>

#include "common/cuda_check.h"
#endif

namespace eo {

ExpertLoraBytes expert_lora_bytes(double params, double block_params) {
  // fp32 master, gradient, exp_avg, exp_avg_sq: on the host for every parameter, on the device for
  // each working copy (its 4-byte step counters per leaf left out).
  return {params * 16, double(kExpertLoraWorkingCopies) * block_params * 16};
}

ExpertLoraLinkBytes expert_lora_link_bytes(double params) { return {params * 20, params * 16}; }

// One leaf of an ExpertLora: where the block reads it (`leaf`, the ExpertLora's own A or B), its
// host master, the buffer its gradient comes home to, its AdamW moments, and where it sits in a
// slot.
struct ExpertLoraOffload::Param {
  std::shared_ptr<model::ExpertLora> owner;  // keeps `leaf` alive
  at::Tensor* leaf = nullptr;
  at::Tensor master, grad_home, exp_avg, exp_avg_sq;
  std::int64_t offset = 0;  // elements into the slot's flat buffers
  int layer = -1;           // its block
  std::int64_t index = 0;   // its step counter in Block::steps and Slot::steps
  std::int64_t order = 0;   // its place in params_ (the model's order)
  bool decay = true;        // AdamWSettings::decays(its name)
  bool stepped = false;     // has AdamW state (an update has taken it, skipped or not), as Optimizer's
  bool updating = false;    // has a gradient in the recorded update
};

#ifdef EO_WITH_CUDA
// Per slot: `ready` after the copies into or out of it, on the copy stream; `released` after the
// last kernel that read its block, on the compute stream; `updated` after its block's update, on
// the compute stream (the masters and moments go home after it). Events that were never recorded
// are waited for at once, as CUDA defines.
struct ExpertLoraOffload::Copies {
  explicit Copies(const at::Device& d) : device(d.index()), stream(c10::cuda::getStreamFromPool(false, d.index())) {
    const c10::cuda::CUDAGuard on_device(device);  // events belong to the device current at creation
    for (int k = 0; k < kExpertLoraWorkingCopies; ++k) {
      for (cudaEvent_t* e : {&ready[k], &released[k], &updated[k]})
        EO_CUDA_CHECK(cudaEventCreateWithFlags(e, cudaEventDisableTiming), "expert LoRA offload: cudaEventCreate");
    }
    EO_CUDA_CHECK(cudaEventCreateWithFlags(&drained, cudaEventDisableTiming), "expert LoRA offload: cudaEventCreate");
  }
  ~Copies() {
    cudaStreamSynchronize(stream.stream());  // no throw from a destructor
    for (int k = 0; k < kExpertLoraWorkingCopies; ++k) {
      cudaEventDestroy(ready[k]);
      cudaEventDestroy(released[k]);
      cudaEventDestroy(updated[k]);
    }
    cudaEventDestroy(drained);
  }
  cudaStream_t compute() const { return c10::cuda::getCurrentCUDAStream(device).stream(); }

  c10::DeviceIndex device;
  c10::cuda::CUDAStream stream;
  std::array<cudaEvent_t, kExpertLoraWorkingCopies> ready{}, released{}, updated{};
  cudaEvent_t drained = nullptr;
};
#else
struct ExpertLoraOffload::Copies {};
#endif

struct ExpertLoraOffload::Block {
  std::vector<Param> params;
  at::Tensor steps;         // the leaves' AdamW step counters (fp32 [leaves], host)
  at::Tensor norm_index;    // its leaves' places in params_ (int64 [leaves], on the device)
  int slot = -1;            // slots_ index while staged
  bool grad_live = false;   // its slot's gradients are this stint's (from before_backward on)
  bool outstanding = false; // its share of the recorded update is not applied yet
};

namespace {

at::Tensor host_like(const at::Tensor& t, bool pin) {
  at::Tensor h = at::empty(t.sizes(), at::TensorOptions().dtype(t.scalar_type()).pinned_memory(pin));
  h.copy_(t);
  return h;
}

// Stages the offloader's block and the block's LoRA, in that order, for every caller of stage().
class LoraStagingProvider : public model::WeightProvider {
 public:
  LoraStagingProvider(std::shared_ptr<model::WeightProvider> inner, ExpertLoraOffload& lora)
      : inner_(std::move(inner)), lora_(lora) {}
  const QuantizedWeight& expert_weight(int layer, int expert, model::ExpertMatrix m) override {
    return inner_->expert_weight(layer, expert, m);
  }
  void set_schedule(const std::vector<int>& order) override {
    inner_->set_schedule(order);
    lora_.set_schedule(order);
  }
  // The experts' token and the LoRA slot, together: equal only where both addresses are.
  std::int64_t placement(int layer) override {
    return (inner_->placement(layer) + 1) * (kExpertLoraWorkingCopies + 1) + lora_.slot_of(layer) + 1;
  }
  void before_backward(int layer) override {
    inner_->before_backward(layer);
    lora_.before_backward(layer);
  }
  int expert_group_size() const override { return inner_->expert_group_size(); }

 protected:
  void stage_block(int layer) override {
    inner_->stage(layer);
    lora_.stage(layer);
  }

 private:
  std::shared_ptr<model::WeightProvider> inner_;
  ExpertLoraOffload& lora_;
};

}  // namespace

ExpertLoraOffload::ExpertLoraOffload(model::MoeModel& model, const at::Device& device, bool pin, const TrainConfig& cfg,
                                     int ranks)
    : device_(device), pin_(pin && device.is_cuda()), norms_on_device_(ranks == 1), adamw_(cfg) {
  at::NoGradGuard ng;
  const NamedTensors all = model.lora_parameters();
  blocks_.resize(static_cast<std::size_t>(model.num_layers()));
  std::int64_t leaves_max = 0;
  for (int layer = 0; layer < model.num_layers(); ++layer) {
    auto b = std::make_unique<Block>();
    // Back to back in a slot: where the grouped GEMMs read the leaves, r is a multiple of 8
    // (ExpertLora::grouped_ok), so every start stays 16-byte aligned.
    std::int64_t n = 0;
    for (const auto& l : model.expert_loras(layer)) {
      for (at::Tensor* leaf : {&l->A(), &l->B()}) {
        EO_CHECK(leaf->scalar_type() == at::kFloat, "expert LoRA offload: a ", leaf->scalar_type(), " leaf in layer ",
                 layer, " (the masters are fp32)");
        Param p;
        p.owner = l;
        p.leaf = leaf;
        p.master = host_like(*leaf, pin_);
        // Its gradient's home and its moments now, not at first use: no host allocation inside a step.
        const auto on_host = p.master.options().pinned_memory(pin_);
        p.grad_home = at::empty(p.master.sizes(), on_host);
        p.exp_avg = at::zeros(p.master.sizes(), on_host);
        p.exp_avg_sq = at::zeros(p.master.sizes(), on_host);
        p.offset = n;
        p.layer = layer;
        p.index = static_cast<std::int64_t>(b->params.size());
        n += leaf->numel();
        b->params.push_back(std::move(p));
      }
    }
    if (b->params.empty()) continue;
    b->steps = at::zeros({static_cast<std::int64_t>(b->params.size())},
                         at::TensorOptions().dtype(at::kFloat).pinned_memory(pin_));
    block_params_max_ = std::max(block_params_max_, n);
    leaves_max = std::max(leaves_max, static_cast<std::int64_t>(b->params.size()));
    blocks_[static_cast<std::size_t>(layer)] = std::move(b);
  }
  for (auto& b : blocks_)
    if (b)
      for (Param& p : b->params) flat_.push_back(&p);
  // The masters under the model's names and in its order; the blocks read them from now on.
  for (const auto& [name, t] : all)
    for (Param* p : flat_)
      if (p->leaf->is_same(t)) {
        p->order = static_cast<std::int64_t>(params_.size());
        places_[p->master.unsafeGetTensorImpl()] = static_cast<int>(params_.size());
        params_.emplace_back(name, p->master);
        by_order_.push_back(p);
        p->decay = AdamWSettings::decays(name);
      }
  EO_CHECK(flat_.size() == params_.size(), "expert LoRA offload: ", params_.size(), " named host masters for ",
           flat_.size(), " leaves");
  for (auto& b : blocks_) {
    if (!b) continue;
    std::vector<std::int64_t> places;
    for (const Param& p : b->params) places.push_back(p.order);
    b->norm_index = at::tensor(places, at::kLong).to(device_);
  }
  grad_norms_ = at::zeros({static_cast<std::int64_t>(params_.size())}, at::TensorOptions().dtype(at::kFloat).device(device_));
  for (Param* p : flat_) *p->leaf = p->master;
  // The slots, once: their addresses are what a CUDA graph of a use captures.
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device_);
  for (int k = 0; k < kExpertLoraWorkingCopies; ++k) {
    Slot s;
    for (at::Tensor* t : {&s.values, &s.grads, &s.exp_avg, &s.exp_avg_sq}) *t = at::empty({block_params_max_}, f32);
    s.steps = at::empty({leaves_max}, f32);
    slots_.push_back(std::move(s));
  }
#ifdef EO_WITH_CUDA
  if (device_.is_cuda()) copies_ = std::make_unique<Copies>(device_);
#endif
}

ExpertLoraOffload::~ExpertLoraOffload() {
  copies_.reset();  // its stream drained before the slots and the host buffers go
}

bool ExpertLoraOffload::holds(const at::Tensor& param) const { return index_of(param) >= 0; }

std::int64_t ExpertLoraOffload::host_bytes() const {
  double n = 0;
  for (const auto& [name, t] : params_) n += double(t.numel());
  return static_cast<std::int64_t>(expert_lora_bytes(n, double(block_params_max_)).host);
}

std::int64_t ExpertLoraOffload::device_bytes() const {
  std::int64_t n = 0;  // the step counters (4 bytes a leaf) left out, as expert_lora_bytes does
  for (const Slot& s : slots_) n += s.values.nbytes() + s.grads.nbytes() + s.exp_avg.nbytes() + s.exp_avg_sq.nbytes();
  return n;
}

std::shared_ptr<model::WeightProvider> ExpertLoraOffload::wrap(std::shared_ptr<model::WeightProvider> inner) {
  return std::make_shared<LoraStagingProvider>(std::move(inner), *this);
}

int ExpertLoraOffload::slot_of(int layer) const {
  if (layer < 0 || layer >= static_cast<int>(blocks_.size()) || !blocks_[layer]) return -1;
  return blocks_[layer]->slot;
}

namespace {
// A leaf's `sizes` stretch of a flat slot buffer from `offset`.
at::Tensor slot_view(const at::Tensor& flat, std::int64_t offset, at::IntArrayRef sizes) {
  std::int64_t n = 1;
  for (auto d : sizes) n *= d;
  return flat.narrow(0, offset, n).view(sizes);
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

void ExpertLoraOffload::slot_copies(int slot, const std::function<void()>& copies) {
#ifdef EO_WITH_CUDA
  if (copies_) {
    Copies& c = *copies_;
    // Not before every kernel that read the slot's block has run; the compute stream waits for
    // `ready` where it next reads the slot.
    EO_CUDA_CHECK(cudaStreamWaitEvent(c.stream.stream(), c.released[slot], 0),
                  "expert LoRA offload: cudaStreamWaitEvent");
    {
      c10::cuda::CUDAStreamGuard on_copy_stream(c.stream);
      copies();
    }
    EO_CUDA_CHECK(cudaEventRecord(c.ready[slot], c.stream.stream()), "expert LoRA offload: cudaEventRecord");
    slots_[slot].pending = true;
    return;
  }
#endif
  copies();
}

void ExpertLoraOffload::wait_ready(int slot) {
  if (!slots_[slot].pending) return;
  slots_[slot].pending = false;
#ifdef EO_WITH_CUDA
  if (copies_)
    EO_CUDA_CHECK(cudaStreamWaitEvent(copies_->compute(), copies_->ready[slot], 0),
                  "expert LoRA offload: cudaStreamWaitEvent");
#endif
}

void ExpertLoraOffload::release(int slot) {
#ifdef EO_WITH_CUDA
  // Everything queued so far may read the slot: the point after which its copies may run.
  if (copies_)
    EO_CUDA_CHECK(cudaEventRecord(copies_->released[slot], copies_->compute()), "expert LoRA offload: cudaEventRecord");
#else
  (void)slot;
#endif
}

int ExpertLoraOffload::take_slot(int keep) {
  // The free slot with the lowest index, else the least recent block's: a function of the
  // stagings since the slots were last all free, so each step puts each block where the step
  // before put it.
  for (int k = 0; k < kExpertLoraWorkingCopies; ++k)
    if (slots_[k].layer < 0) return k;
  for (int layer : staged_)
    if (layer != keep) return blocks_[layer]->slot;
  EO_CHECK(false, "expert LoRA offload: no slot to take beside layer ", keep);
  return -1;
}

void ExpertLoraOffload::copy_in(int layer, int slot) {
  Block& b = *blocks_[layer];
  Slot& s = slots_[slot];
  Block* old = s.layer >= 0 ? blocks_[s.layer].get() : nullptr;
  if (old) staged_.erase(std::remove(staged_.begin(), staged_.end(), s.layer), staged_.end());
  at::NoGradGuard ng;
  slot_copies(slot, [&] {
    if (old) evict(*old);  // its gradient home before the slot's gradients are reused
    // Pinned host buffers copy without the host waiting. The host touches them again only after
    // apply_update() or a read of a later step (flush() makes the compute stream wait for these
    // copies), by when they are done; the copies among themselves keep the copy stream's order.
    for (Param& p : b.params) {
      slot_view(s.values, p.offset, p.master.sizes()).copy_(p.master, /*non_blocking=*/true);
      stats_.h2d_bytes += p.master.nbytes();
      if (!b.outstanding) continue;
      // The update's inputs cross with the masters: the moments, the counters, the gradient.
      slot_view(s.exp_avg, p.offset, p.master.sizes()).copy_(p.exp_avg, /*non_blocking=*/true);
      slot_view(s.exp_avg_sq, p.offset, p.master.sizes()).copy_(p.exp_avg_sq, /*non_blocking=*/true);
      stats_.h2d_bytes += 2 * p.master.nbytes();
      if (!p.updating) continue;
      slot_view(s.grads, p.offset, p.master.sizes()).copy_(p.grad_home, /*non_blocking=*/true);
      stats_.h2d_bytes += p.master.nbytes();
    }
    if (b.outstanding) {
      s.steps.narrow(0, 0, b.steps.numel()).copy_(b.steps, /*non_blocking=*/true);
      stats_.h2d_bytes += b.steps.nbytes();
    }
  });
  for (Param& p : b.params) *p.leaf = slot_view(s.values, p.offset, p.master.sizes()).detach().requires_grad_(true);
  s.layer = layer;
  b.slot = slot;
  b.grad_live = false;
  staged_.push_back(layer);
}

void ExpertLoraOffload::update_block(Block& b) {
  const Update& u = *update_;
  const Slot& s = slots_[b.slot];
  at::NoGradGuard ng;
  AdamWTensors t;
  std::vector<at::Tensor> state;  // every master and moment of the block, for the non-finite check
  for (Param& p : b.params) {
    const auto sizes = p.master.sizes();
    const at::Tensor value = slot_view(s.values, p.offset, sizes);
    state.push_back(value);
    if (!p.stepped) continue;
    const at::Tensor m = slot_view(s.exp_avg, p.offset, sizes), v = slot_view(s.exp_avg_sq, p.offset, sizes);
    state.push_back(m);
    state.push_back(v);
    if (!p.updating) continue;
    t.params.push_back(value);
    t.grads.push_back(slot_view(s.grads, p.offset, sizes));
    t.exp_avg.push_back(m);
    t.exp_avg_sq.push_back(v);
    t.steps.push_back(s.steps[p.index]);
    t.decay.push_back(p.decay);
  }
  adamw_update(t, adamw_, u.lr, u.skip, u.grad_divisor);
  // As Optimizer::state_nonfinite: a max-norm is NaN or Inf exactly when an element is.
  StateCheckValue& check = state_amax_.at(u.id);
  check.amax.add_(at::stack(at::_foreach_norm(state, INFINITY)).to(at::kDouble).sum());
  const int slot = b.slot;
  const auto home = [&] {
    for (Param& p : b.params) {
      p.updating = false;
      if (!p.stepped) continue;
      const auto sizes = p.master.sizes();
      p.master.copy_(slot_view(s.values, p.offset, sizes), /*non_blocking=*/true);
      p.exp_avg.copy_(slot_view(s.exp_avg, p.offset, sizes), /*non_blocking=*/true);
      p.exp_avg_sq.copy_(slot_view(s.exp_avg_sq, p.offset, sizes), /*non_blocking=*/true);
      stats_.d2h_bytes += 3 * p.master.nbytes();
    }
    b.steps.copy_(s.steps.narrow(0, 0, b.steps.numel()), /*non_blocking=*/true);
    stats_.d2h_bytes += b.steps.nbytes();
  };
#ifdef EO_WITH_CUDA
  if (copies_) {
    // Home on the copy stream once the update has run; the compute stream goes on at once (the
    // copies only read the slot). Later copies into the slot queue behind them on that stream,
    // and the host reads these buffers only after the step's synchronisation or apply_update().
    Copies& c = *copies_;
    EO_CUDA_CHECK(cudaEventRecord(c.updated[slot], c.compute()), "expert LoRA offload: cudaEventRecord");
    EO_CUDA_CHECK(cudaStreamWaitEvent(c.stream.stream(), c.updated[slot], 0), "expert LoRA offload: cudaStreamWaitEvent");
    c10::cuda::CUDAStreamGuard on_copy_stream(c.stream);
    home();
  } else {
    home();
  }
#else
  (void)slot;
  home();
#endif
  b.outstanding = false;
  if (--blocks_outstanding_ == 0) {
    check.read = HostCopy(check.amax);  // its reader waits for this point only
    update_.reset();
  }
}

void ExpertLoraOffload::set_schedule(const std::vector<int>& staging_order) {
  flush();
  schedule_ = staging_order;
  cursor_ = 0;
}

void ExpertLoraOffload::stage(int layer) {
  // The schedule's next entry, when this call is the one it expects: the block to copy ahead.
  int next = -1;
  if (!schedule_.empty() && schedule_[cursor_] == layer) {
    cursor_ = (cursor_ + 1) % schedule_.size();
    next = schedule_[cursor_];
  }
  if (current_ >= 0 && blocks_[current_]->slot >= 0) release(blocks_[current_]->slot);
  current_ = -1;
  const auto held = [&](int l) { return l >= 0 && l < static_cast<int>(blocks_.size()) && blocks_[l]; };
  if (held(layer)) {
    Block& b = *blocks_[layer];
    if (b.slot < 0) copy_in(layer, take_slot(-1));
    staged_.erase(std::remove(staged_.begin(), staged_.end(), layer), staged_.end());
    staged_.push_back(layer);  // the most recent
    wait_ready(b.slot);
    if (b.outstanding) update_block(b);  // before any use reads the working copies
    current_ = layer;
  }
  if (held(next) && next != layer && blocks_[next]->slot < 0) copy_in(next, take_slot(current_));
}

void ExpertLoraOffload::before_backward(int layer) {
  if (layer < 0 || layer >= static_cast<int>(blocks_.size()) || !blocks_[layer]) return;
  Block& b = *blocks_[layer];
  EO_CHECK(b.slot >= 0, "expert LoRA offload: a backward of layer ", layer, " before its stage()");
  EO_CHECK(!b.outstanding, "expert LoRA offload: a backward of layer ", layer, " before its update");
  if (b.grad_live) return;
  at::NoGradGuard ng;
  const Slot& s = slots_[b.slot];
  for (Param& p : b.params) {
    // The gradient it took home earlier in the step comes back, else it starts at zero: either
    // way the backward adds into the slot in place (a CUDA graph's accumulation replays there).
    at::Tensor g = slot_view(s.grads, p.offset, p.master.sizes());
    if (p.master.grad().defined()) {
      g.copy_(p.master.grad(), /*non_blocking=*/true);
      stats_.h2d_bytes += g.nbytes();
    } else {
      g.zero_();
    }
    p.leaf->mutable_grad() = g;
  }
  b.grad_live = true;
}

void ExpertLoraOffload::evict(Block& b) {
  if (b.slot < 0) return;
  at::NoGradGuard ng;
  if (b.grad_live && norms_on_device_) {
    // Its leaves' norms as their gradients leave: the last time in a step is the whole gradient.
    std::vector<at::Tensor> grads;
    for (Param& p : b.params) grads.push_back(p.leaf->grad());
    grad_norms_.index_copy_(0, b.norm_index, at::stack(at::_foreach_norm(grads, 2)));
  }
  for (Param& p : b.params) {
    EO_CHECK(b.grad_live || !p.leaf->grad().defined(),
             "expert LoRA offload: a gradient was accumulated without before_backward() (it would be lost)");
    // The gradient so far replaces the host's: it was brought back with the block and added to since.
    if (b.grad_live) {
      p.grad_home.copy_(p.leaf->grad(), /*non_blocking=*/true);
      p.master.mutable_grad() = p.grad_home;
      stats_.d2h_bytes += p.grad_home.nbytes();
    }
    *p.leaf = p.master;
  }
  slots_[b.slot].layer = -1;
  b.slot = -1;
  b.grad_live = false;
}

void ExpertLoraOffload::flush() {
  if (current_ >= 0 && blocks_[current_]->slot >= 0) release(blocks_[current_]->slot);
  current_ = -1;
  for (int layer : std::vector<int>(staged_)) {
    Block& b = *blocks_[layer];
    slot_copies(b.slot, [&] { evict(b); });
  }
  staged_.clear();
#ifdef EO_WITH_CUDA
  if (copies_) {
    // Whoever reads the device next (the step's one synchronisation) finds the gradients home.
    EO_CUDA_CHECK(cudaEventRecord(copies_->drained, copies_->stream.stream()), "expert LoRA offload: cudaEventRecord");
    EO_CUDA_CHECK(cudaStreamWaitEvent(copies_->compute(), copies_->drained, 0),
                  "expert LoRA offload: cudaStreamWaitEvent");
  }
#endif
  for (Slot& s : slots_) s.pending = false;
}

at::Tensor ExpertLoraOffload::reduce_and_norm(const NamedTensors& order, const at::Tensor& device_norms,
                                              ddp::Communicator* comm) {
  at::NoGradGuard ng;
  const auto t0 = std::chrono::steady_clock::now();
  EO_CHECK(staged_.empty(), "expert LoRA offload: reduce_and_norm before flush()");
  if (comm && comm->size() > 1) {
    // As the GradReducer: every rank sends every gradient, zeros where it has none.
    for (std::size_t k = 0; k < params_.size(); ++k) {
      Param& p = *by_order_[k];
      if (!p.master.grad().defined()) {
        p.grad_home.zero_();
        p.master.mutable_grad() = p.grad_home;
      }
      comm->allreduce(p.master.grad(), ddp::ReduceOp::kSum, "expert LoRA gradient " + params_[k].first);
    }
  }
  // Per-parameter norms in the model's order, each where its gradient is, then combined as
  // grad_norm_on_device combines them.
  std::vector<at::Tensor> host_grads;
  std::vector<std::size_t> with_grad;
  for (std::size_t k = 0; k < params_.size(); ++k)
    if (params_[k].second.grad().defined()) host_grads.push_back(params_[k].second.grad()), with_grad.push_back(k);
  std::vector<at::Tensor> host_norms(params_.size());
  if (!host_grads.empty()) {
    const std::vector<at::Tensor> n = at::_foreach_norm(host_grads, 2);
    for (std::size_t i = 0; i < n.size(); ++i) host_norms[with_grad[i]] = n[i];
  }
  const std::vector<at::Tensor> norms = norms_in_order(order, device_norms.to(at::kCPU, at::kFloat),
                                                       [&](std::size_t k) { return host_norms[k]; });
  at::Tensor norm = combine_grad_norms(norms);
  stats_.norm_s += seconds_since(t0);
  return norm;
}

int ExpertLoraOffload::index_of(const at::Tensor& param) const {
  const auto it = places_.find(param.unsafeGetTensorImpl());
  return it == places_.end() ? -1 : it->second;
}

std::vector<at::Tensor> ExpertLoraOffload::norms_in_order(const NamedTensors& order, const at::Tensor& device_norms,
                                                          const std::function<at::Tensor(std::size_t)>& held) const {
  std::vector<at::Tensor> norms;
  std::int64_t d = 0;
  std::size_t h = 0, with_grad = 0;
  for (const auto& [name, p] : params_) with_grad += p.grad().defined();
  for (const auto& [name, p] : order) {
    if (!p.grad().defined()) continue;
    const int k = index_of(p);
    if (k >= 0) norms.push_back(held(static_cast<std::size_t>(k))), ++h;
    else norms.push_back(device_norms[d++]);
  }
  EO_CHECK(d == device_norms.numel() && h == with_grad, "expert LoRA offload: ", d, " of ", device_norms.numel(),
           " device norms and ", h, " of ", with_grad, " host ones placed");
  return norms;
}

at::Tensor ExpertLoraOffload::grad_norm(const NamedTensors& order, const std::vector<at::Tensor>& device_params) const {
  EO_CHECK(norms_on_device_ && staged_.empty(), "expert LoRA offload: grad_norm() with several ranks or before flush()");
  return combine_grad_norms(norms_in_order(order, grad_norms(device_params), [&](std::size_t k) { return grad_norms_[k]; }));
}

void ExpertLoraOffload::add_read_time(double seconds) { stats_.read_s += seconds; }

ExpertLoraOffload::StepStats ExpertLoraOffload::take_step_stats() { return std::exchange(stats_, StepStats{}); }

nlohmann::json ExpertLoraOffload::StepStats::to_metrics(bool host_side) const {
  nlohmann::json j = {{"lora_h2d_bytes", h2d_bytes}, {"lora_d2h_bytes", d2h_bytes}};
  if (host_side) j.update({{"lora_host_read_s", read_s}, {"lora_host_norm_s", norm_s}});
  return j;
}

ExpertLoraOffload::StateCheck ExpertLoraOffload::step(double lr, const at::Tensor& skip, const at::Tensor& grad_divisor) {
  apply_update();  // a block no stage() reached since the last step (none in a training step)
  Update u;
  u.id = ++updates_;
  u.lr = lr;
  u.skip = skip.to(device_);
  u.grad_divisor = grad_divisor.to(device_);
  StateCheckValue& check = state_amax_[u.id];
  check.amax = at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(device_));
  blocks_outstanding_ = 0;
  for (auto& b : blocks_) {
    if (!b) continue;
    b->outstanding = true;  // its non-finite check too: every master counts, with a gradient or not
    ++blocks_outstanding_;
    for (Param& p : b->params) {
      // As Optimizer::step: a leaf without a gradient takes no step; the first that has one
      // creates the state (zeros here), skipped or not. The gradient is the update's now: the
      // next backward starts from zero.
      p.updating = p.master.grad().defined();
      p.stepped = p.stepped || p.updating;
      p.master.mutable_grad() = at::Tensor();
    }
  }
  const std::int64_t id = u.id;
  if (blocks_outstanding_ > 0) update_ = std::move(u);
  else check.read = HostCopy(check.amax);
  return [this, id] { return state_nonfinite(id); };
}

double ExpertLoraOffload::state_nonfinite(std::int64_t update) {
  if (update_ && update_->id == update) {
    // The next step failed midway, blocks still staged (the step before is reported after the
    // failure): the update cannot be finished, and the run is ending on that failure.
    if (!staged_.empty()) return 0;
    apply_update();
  }
  const auto it = state_amax_.find(update);
  if (it == state_amax_.end()) return 0;
  const double amax = it->second.read.get().item<double>();
  state_amax_.erase(it);
  return std::isfinite(amax) ? 0 : 1;
}

void ExpertLoraOffload::apply_update() {
  if (!update_) return;
  EO_CHECK(staged_.empty(), "expert LoRA offload: apply_update() inside a step");
  // Block by block through the slots, outside any schedule (the next step's copies ahead stay
  // where they were); then every slot free and everything home before the host reads it.
  for (int layer = 0; layer < static_cast<int>(blocks_.size()); ++layer) {
    Block* b = blocks_[static_cast<std::size_t>(layer)].get();
    if (!b || !b->outstanding) continue;
    if (b->slot < 0) copy_in(layer, take_slot(-1));
    wait_ready(b->slot);
    update_block(*b);
    release(b->slot);
  }
  flush();
#ifdef EO_WITH_CUDA
  if (copies_) EO_CUDA_CHECK(cudaStreamSynchronize(copies_->stream.stream()), "expert LoRA offload: cudaStreamSynchronize");
#endif
}

NamedTensors ExpertLoraOffload::optimizer_state() {
  apply_update();
  // Optimizer::state's names and forms: the moments, and the counter as fp64 [1].
  NamedTensors out;
  for (std::size_t k = 0; k < params_.size(); ++k) {
    const Param& p = *by_order_[k];
    if (!p.stepped) continue;
    const Block& b = *blocks_[static_cast<std::size_t>(p.layer)];
    const std::string& name = params_[k].first;
    out.emplace_back(name + ".exp_avg", p.exp_avg);
    out.emplace_back(name + ".exp_avg_sq", p.exp_avg_sq);
    out.emplace_back(name + ".step", b.steps.narrow(0, p.index, 1).to(at::kDouble));
  }
  return out;
}

void ExpertLoraOffload::load_optimizer_state(const std::map<std::string, at::Tensor>& saved) {
  apply_update();
  at::NoGradGuard ng;
  const std::map<std::string, at::Tensor> state = stacked_optimizer_state(saved);
  for (std::size_t k = 0; k < params_.size(); ++k) {
    Param& p = *by_order_[k];
    const std::string& name = params_[k].first;
    const auto a = state.find(name + ".exp_avg");
    if (a == state.end()) continue;
    const auto v = state.find(name + ".exp_avg_sq");
    const auto s = state.find(name + ".step");
    EO_CHECK(v != state.end() && s != state.end(), "optimizer state for ", name, " is incomplete");
    EO_CHECK(a->second.sizes() == p.master.sizes(), "optimizer state for ", name, " has shape ", a->second.sizes(),
             ", the parameter ", p.master.sizes());
    p.exp_avg.copy_(a->second.to(at::kFloat));
    p.exp_avg_sq.copy_(v->second.to(at::kFloat));
    blocks_[static_cast<std::size_t>(p.layer)]->steps[p.index].fill_(s->second.item<double>());
    p.stepped = true;
  }
}

}  // namespace eo
