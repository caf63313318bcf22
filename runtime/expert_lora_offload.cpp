#include "runtime/expert_lora_offload.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <chrono>
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

#ifdef EO_WITH_CUDA
// Per slot: `ready` after the copies into or out of it, on the copy stream; `released` after the
// last kernel that read its block, on the compute stream. Events that were never recorded are
// waited for at once, as CUDA defines.
struct ExpertLoraOffload::Copies {
  explicit Copies(const at::Device& d) : device(d.index()), stream(c10::cuda::getStreamFromPool(false, d.index())) {
    const c10::cuda::CUDAGuard on_device(device);  // events belong to the device current at creation
    for (int k = 0; k < kExpertLoraWorkingCopies; ++k) {
      for (cudaEvent_t* e : {&ready[k], &released[k]})
        EO_CUDA_CHECK(cudaEventCreateWithFlags(e, cudaEventDisableTiming), "expert LoRA offload: cudaEventCreate");
    }
    EO_CUDA_CHECK(cudaEventCreateWithFlags(&drained, cudaEventDisableTiming), "expert LoRA offload: cudaEventCreate");
  }
  ~Copies() {
    cudaStreamSynchronize(stream.stream());  // no throw from a destructor
    for (int k = 0; k < kExpertLoraWorkingCopies; ++k) {
      cudaEventDestroy(ready[k]);
      cudaEventDestroy(released[k]);
    }
    cudaEventDestroy(drained);
  }
  cudaStream_t compute() const { return c10::cuda::getCurrentCUDAStream(device).stream(); }

  c10::DeviceIndex device;
  c10::cuda::CUDAStream stream;
  std::array<cudaEvent_t, kExpertLoraWorkingCopies> ready{}, released{};
  cudaEvent_t drained = nullptr;
};
#else
struct ExpertLoraOffload::Copies {};
#endif

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
        // Its gradient's home now, not at its first eviction: no host allocation inside a step.
        p.grad_home = at::empty(p.master.sizes(), p.master.options().pinned_memory(pin_));
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
    slots_.push_back({at::empty({block_params_max_}, f32), at::empty({block_params_max_}, f32), -1, false});
#ifdef EO_WITH_CUDA
  if (device_.is_cuda()) copies_ = std::make_unique<Copies>(device_);
#endif
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
  copies_.reset();  // its stream drained before the slots and gradient homes go
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

namespace {
double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

void ExpertLoraOffload::wait_for_update(const Block& b) {
  if (!worker_.joinable()) return;
  // Its masters only once the running update is done with them.
  const auto t0 = std::chrono::steady_clock::now();
  std::unique_lock<std::mutex> lock(mutex_);
  updated_.wait(lock, [&] { return blocks_updated_ > b.index || update_over_; });
  times_.wait_s += seconds_since(t0);
  if (update_error_) {
    lock.unlock();
    wait_update();
  }
}

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
  wait_for_update(b);
  Block* old = s.layer >= 0 ? blocks_[s.layer].get() : nullptr;
  if (old) staged_.erase(std::remove(staged_.begin(), staged_.end(), s.layer), staged_.end());
  at::NoGradGuard ng;
  slot_copies(slot, [&] {
    if (old) evict(*old);  // its gradient home before the slot's gradients are reused
    // Pinned masters copy without the host waiting; the host touches them again only after the
    // step's synchronisation (TrainStep), which follows flush(), by when these copies are done.
    for (Param& p : b.params) slot_view(s.values, p.offset, p.master.sizes()).copy_(p.master, /*non_blocking=*/true);
  });
  for (Param& p : b.params) *p.leaf = slot_view(s.values, p.offset, p.master.sizes()).detach().requires_grad_(true);
  s.layer = layer;
  b.slot = slot;
  b.grad_live = false;
  staged_.push_back(layer);
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
    current_ = layer;
  }
  if (held(next) && next != layer && blocks_[next]->slot < 0) copy_in(next, take_slot(current_));
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
  wait_update();
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
  at::Tensor norm = combine_grad_norms(norms);
  std::lock_guard<std::mutex> lock(mutex_);
  times_.norm_s += seconds_since(t0);
  return norm;
}

void ExpertLoraOffload::add_read_time(double seconds) {
  std::lock_guard<std::mutex> lock(mutex_);
  times_.read_s += seconds;
}

ExpertLoraOffload::HostTimes ExpertLoraOffload::take_host_times() {
  std::lock_guard<std::mutex> lock(mutex_);
  return std::exchange(times_, HostTimes{});
}

std::shared_future<double> ExpertLoraOffload::step(double lr, const at::Tensor& skip, const at::Tensor& grad_divisor) {
  wait_update();
  auto done = std::make_shared<std::promise<double>>();
  std::shared_future<double> flag = done->get_future().share();
  blocks_updated_ = 0;
  update_over_ = false;
  // Block by block in layer order, the next step's forward order: stage(i) waits for block i only.
  worker_ = std::thread([this, lr, skip, grad_divisor, done] {
    const auto t0 = std::chrono::steady_clock::now();
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
    times_.update_s += seconds_since(t0);
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
