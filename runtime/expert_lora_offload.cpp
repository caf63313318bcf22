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
// host master and the pinned buffer its gradient comes home to.
struct ExpertLoraOffload::Param {
  std::shared_ptr<model::ExpertLora> owner;  // keeps `leaf` alive
  at::Tensor* leaf = nullptr;
  at::Tensor master, grad_home, work;
};

struct ExpertLoraOffload::Block {
  std::vector<Param> params;
  bool staged = false;
  std::size_t index = 0;  // its optimizer in optimizers_
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
  std::int64_t placement(int layer) override { return inner_->placement(layer); }
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
    std::int64_t n = 0;
    for (const auto& l : model.expert_loras(layer)) {
      for (at::Tensor* leaf : {&l->A(), &l->B()}) {
        Param p;
        p.owner = l;
        p.leaf = leaf;
        p.master = host_like(*leaf, pin_);
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
  return static_cast<std::int64_t>(expert_lora_bytes(0, double(block_params_max_)).device);
}

std::shared_ptr<model::WeightProvider> ExpertLoraOffload::wrap(std::shared_ptr<model::WeightProvider> inner) {
  return std::make_shared<LoraStagingProvider>(std::move(inner), *this);
}

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
  if (!b.staged) {
    // The least recent block leaves first, so the device never holds more working copies than
    // the plan counts.
    while (static_cast<int>(staged_.size()) >= kExpertLoraWorkingCopies) {
      evict(*blocks_[staged_.front()]);
      staged_.erase(staged_.begin());
    }
    at::NoGradGuard ng;
    for (Param& p : b.params) {
      // Pinned masters copy without waiting for the device; the host touches them again only
      // after the step's synchronisation (TrainStep), by when these copies are done.
      p.work = p.master.to(device_, p.master.scalar_type(), /*non_blocking=*/true, /*copy=*/true).requires_grad_(true);
      if (p.master.grad().defined()) p.work.mutable_grad() = p.master.grad().to(device_, p.master.scalar_type(), true, true);
      *p.leaf = p.work;
    }
    b.staged = true;
  }
  staged_.push_back(layer);
}

void ExpertLoraOffload::evict(Block& b) {
  if (!b.staged) return;
  at::NoGradGuard ng;
  for (Param& p : b.params) {
    // The gradient so far replaces the host's: it was copied up with the block and added to since.
    if (p.work.grad().defined()) {
      if (!p.grad_home.defined()) p.grad_home = at::empty(p.master.sizes(), p.master.options().pinned_memory(pin_));
      p.grad_home.copy_(p.work.grad(), /*non_blocking=*/true);
      p.master.mutable_grad() = p.grad_home;
    }
    *p.leaf = p.master;
    p.work = at::Tensor();
  }
  b.staged = false;
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
