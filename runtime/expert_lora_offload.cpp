#include "runtime/expert_lora_offload.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <utility>

#include "common/error.h"
#include "models/lora.h"
#include "models/moe_model.h"
#include "models/weights.h"
#include "runtime/ddp/comm.h"
#include "runtime/optimizer.h"

namespace eo {

ExpertLoraBytes expert_lora_bytes(double params, double block_params) {
  // Host: master, gradient, exp_avg, exp_avg_sq (fp32). Device: each working copy and its gradient.
  return {params * 16, double(kExpertLoraWorkingCopies) * block_params * 8};
}

// One leaf of an ExpertLora: where the block reads it (`leaf`, the ExpertLora's own A or B), its
// host master, the pinned buffer its gradient comes home to, and where it sits in a slot.
struct ExpertLoraOffload::Param {
  std::shared_ptr<model::ExpertLora> owner;  // keeps `leaf` alive
  at::Tensor* leaf = nullptr;
  at::Tensor master, grad_home;
  std::int64_t offset = 0;  // elements into Slot::values and Slot::grads
};

struct ExpertLoraOffload::Block {
  std::vector<Param> params;
  int slot = -1;           // slots_ index while staged
  bool grad_live = false;  // its slot's gradients are this stint's (from before_backward on)
  std::size_t index = 0;   // its optimizer in optimizers_
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
  void set_schedule(const std::vector<int>& order) override { inner_->set_schedule(order); }
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

ExpertLoraOffload::ExpertLoraOffload(model::MoeModel& model, const at::Device& device, bool pin, const TrainConfig& cfg)
    : device_(device), pin_(pin && device.is_cuda()) {
  at::NoGradGuard ng;
  const NamedTensors all = model.lora_parameters();
  blocks_.resize(static_cast<std::size_t>(model.num_layers()));
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
        p.offset = n;
        n += leaf->numel();
        b->params.push_back(std::move(p));
      }
    }
    if (b->params.empty()) continue;
    block_params_max_ = std::max(block_params_max_, n);
    blocks_[static_cast<std::size_t>(layer)] = std::move(b);
  }
  for (auto& b : blocks_)
    if (b)
      for (Param& p : b->params) flat_.push_back(&p);
  // The masters under the model's names and in its order; the blocks read them from now on.
  for (const auto& [name, t] : all)
    for (Param* p : flat_)
      if (p->leaf->is_same(t)) params_.emplace_back(name, p->master), by_order_.push_back(p);
  EO_CHECK(flat_.size() == params_.size(), "expert LoRA offload: ", params_.size(), " named host masters for ",
           flat_.size(), " leaves");
  for (Param* p : flat_) *p->leaf = p->master;
  // The slots, once: their addresses are what a CUDA graph of a use captures.
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device_);
  for (int k = 0; k < kExpertLoraWorkingCopies; ++k)
    slots_.push_back({at::empty({block_params_max_}, f32), at::empty({block_params_max_}, f32), -1});
  for (auto& b : blocks_) {
    if (!b) continue;
    NamedTensors mine;  // the block's masters under their names, in the model's order
    for (std::size_t k = 0; k < params_.size(); ++k)
      for (const Param& p : b->params)
        if (&p == by_order_[k]) mine.push_back(params_[k]);
    b->index = optimizers_.size();
    optimizers_.push_back(std::make_unique<Optimizer>(mine, cfg));
  }
}

ExpertLoraOffload::~ExpertLoraOffload() {
  if (worker_.joinable()) worker_.join();
}

bool ExpertLoraOffload::holds(const at::Tensor& param) const {
  return std::any_of(params_.begin(), params_.end(), [&](const auto& p) { return p.second.is_same(param); });
}

std::int64_t ExpertLoraOffload::host_bytes() const {
  double n = 0;
  for (const auto& [name, t] : params_) n += double(t.numel());
  return static_cast<std::int64_t>(expert_lora_bytes(n, double(block_params_max_)).host);
}

std::int64_t ExpertLoraOffload::device_bytes() const {
  std::int64_t n = 0;
  for (const Slot& s : slots_) n += s.values.nbytes() + s.grads.nbytes();
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
}  // namespace

void ExpertLoraOffload::stage(int layer) {
  if (layer < 0 || layer >= static_cast<int>(blocks_.size()) || !blocks_[layer]) return;
  Block& b = *blocks_[layer];
  if (worker_.joinable()) {  // its masters only once the running update is done with them
    std::unique_lock<std::mutex> lock(mutex_);
    updated_.wait(lock, [&] { return blocks_updated_ > b.index || update_over_; });
    if (update_error_) {
      lock.unlock();
      wait_update();
    }
  }
  staged_.erase(std::remove(staged_.begin(), staged_.end(), layer), staged_.end());
  if (b.slot < 0) {
    // The free slot with the lowest index, else the least recent block's: a function of the
    // stagings since the last flush(), so each step puts each block where it put it the step before.
    int slot = -1;
    for (int k = 0; k < kExpertLoraWorkingCopies && slot < 0; ++k)
      if (slots_[k].layer < 0) slot = k;
    if (slot < 0) {
      Block& old = *blocks_[staged_.front()];
      slot = old.slot;
      evict(old);
      staged_.erase(staged_.begin());
    }
    at::NoGradGuard ng;
    Slot& s = slots_[slot];
    for (Param& p : b.params) {
      // Pinned masters copy without waiting for the device; the host touches them again only
      // after the step's synchronisation (TrainStep), by when these copies are done. The copy is
      // queued after every kernel that read the slot's last block, on the same stream.
      at::Tensor work = slot_view(s.values, p.offset, p.master.sizes());
      work.copy_(p.master, /*non_blocking=*/true);
      *p.leaf = work.detach().requires_grad_(true);
    }
    s.layer = layer;
    b.slot = slot;
    b.grad_live = false;
  }
  staged_.push_back(layer);
}

void ExpertLoraOffload::before_backward(int layer) {
  if (layer < 0 || layer >= static_cast<int>(blocks_.size()) || !blocks_[layer]) return;
  Block& b = *blocks_[layer];
  EO_CHECK(b.slot >= 0, "expert LoRA offload: a backward of layer ", layer, " before its stage()");
  if (b.grad_live) return;
  at::NoGradGuard ng;
  const Slot& s = slots_[b.slot];
  for (Param& p : b.params) {
    // The gradient it took home earlier in the step comes back, else it starts at zero: either
    // way the backward adds into the slot in place (a CUDA graph's accumulation replays there).
    at::Tensor g = slot_view(s.grads, p.offset, p.master.sizes());
    if (p.master.grad().defined()) g.copy_(p.master.grad(), /*non_blocking=*/true);
    else g.zero_();
    p.leaf->mutable_grad() = g;
  }
  b.grad_live = true;
}

void ExpertLoraOffload::evict(Block& b) {
  if (b.slot < 0) return;
  at::NoGradGuard ng;
  for (Param& p : b.params) {
    EO_CHECK(b.grad_live || !p.leaf->grad().defined(),
             "expert LoRA offload: a gradient was accumulated without before_backward() (it would be lost)");
    // The gradient so far replaces the host's: it was brought back with the block and added to since.
    if (b.grad_live) {
      if (!p.grad_home.defined()) p.grad_home = at::empty(p.master.sizes(), p.master.options().pinned_memory(pin_));
      p.grad_home.copy_(p.leaf->grad(), /*non_blocking=*/true);
      p.master.mutable_grad() = p.grad_home;
    }
    *p.leaf = p.master;
  }
  slots_[b.slot].layer = -1;
  b.slot = -1;
  b.grad_live = false;
}

void ExpertLoraOffload::flush() {
  for (int layer : staged_) evict(*blocks_[layer]);
  staged_.clear();
}

at::Tensor ExpertLoraOffload::reduce_and_norm(const NamedTensors& order, const at::Tensor& device_norms,
                                              ddp::Communicator* comm) {
  at::NoGradGuard ng;
  wait_update();
  EO_CHECK(staged_.empty(), "expert LoRA offload: reduce_and_norm before flush()");
  if (comm && comm->size() > 1) {
    // As the GradReducer: every rank sends every gradient, zeros where it has none.
    for (std::size_t k = 0; k < params_.size(); ++k) {
      Param& p = *by_order_[k];
      if (!p.master.grad().defined()) {
        if (!p.grad_home.defined()) p.grad_home = at::empty(p.master.sizes(), p.master.options().pinned_memory(pin_));
        p.grad_home.zero_();
        p.master.mutable_grad() = p.grad_home;
      }
      comm->allreduce(p.master.grad(), ddp::ReduceOp::kSum, "expert LoRA gradient " + params_[k].first);
    }
  }
  // Per-parameter norms in the model's order, each where its gradient is, then combined as
  // grad_norm_on_device combines them.
  std::vector<at::Tensor> host_grads;
  for (const auto& [name, p] : params_)
    if (p.grad().defined()) host_grads.push_back(p.grad());
  const std::vector<at::Tensor> host_norms = host_grads.empty() ? std::vector<at::Tensor>{} : at::_foreach_norm(host_grads, 2);
  const at::Tensor dev = device_norms.to(at::kCPU, at::kFloat);
  std::vector<at::Tensor> norms;
  std::size_t h = 0;
  std::int64_t d = 0;
  for (const auto& [name, p] : order) {
    if (!p.grad().defined()) continue;
    if (holds(p)) norms.push_back(host_norms.at(h++));
    else norms.push_back(dev[d++]);
  }
  EO_CHECK(d == dev.numel() && h == host_norms.size(), "expert LoRA offload: ", d, " of ", dev.numel(),
           " device norms and ", h, " of ", host_norms.size(), " host norms placed");
  return combine_grad_norms(norms);
}

std::shared_future<double> ExpertLoraOffload::step(double lr, const at::Tensor& skip, const at::Tensor& grad_divisor) {
  wait_update();
  auto done = std::make_shared<std::promise<double>>();
  std::shared_future<double> flag = done->get_future().share();
  blocks_updated_ = 0;
  update_over_ = false;
  // Block by block in layer order, the next step's forward order: stage(i) waits for block i only.
  worker_ = std::thread([this, lr, skip, grad_divisor, done] {
    double bad = 0;
    try {
      at::NoGradGuard ng;
      for (std::size_t k = 0; k < optimizers_.size(); ++k) {
        optimizers_[k]->step(lr, skip, grad_divisor);
        optimizers_[k]->zero_grad(/*set_to_none=*/true);
        bad = std::max(bad, optimizers_[k]->state_nonfinite().item<double>());
        std::lock_guard<std::mutex> lock(mutex_);
        blocks_updated_ = k + 1;
        updated_.notify_all();
      }
      done->set_value(bad);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      update_error_ = std::current_exception();
      done->set_exception(update_error_);
    }
    std::lock_guard<std::mutex> lock(mutex_);
    update_over_ = true;
    updated_.notify_all();
  });
  return flag;
}

void ExpertLoraOffload::wait_update() {
  if (worker_.joinable()) worker_.join();
  if (std::exception_ptr e = std::exchange(update_error_, nullptr)) std::rethrow_exception(e);
}

NamedTensors ExpertLoraOffload::optimizer_state() {
  wait_update();
  NamedTensors out;
  for (const auto& o : optimizers_)
    for (auto& entry : o->state()) out.push_back(std::move(entry));
  return out;
}

void ExpertLoraOffload::load_optimizer_state(const std::map<std::string, at::Tensor>& state) {
  wait_update();
  for (const auto& o : optimizers_) o->load_state(state);
}

}  // namespace eo
