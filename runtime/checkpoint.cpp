// Non-reentrant activation checkpointing: see checkpoint.h for the contract.
//
// Pieces:
//   Frame          one checkpointed call: fn, its inputs, RNG states, and one Slot per saved tensor
//   HandleHooks    given to each SavedVariable created inside the forward; keeps only an index
//   RecordingHooks given to each SavedVariable created inside the recompute; stores the tensor
//                  into the frame's next slot
//   CheckpointEngine  the default autograd engine, choosing the hooks from thread-local state
//
// Lifetimes: every HandleHooks owns a share of its Frame, so the frame (and its inputs) lives
// exactly as long as some backward node of the block still holds a saved tensor. A slot's
// recomputed tensor is dropped when it is unpacked or when its SavedVariable is released, which
// bounds live recomputed activations to about one block.
#include "runtime/checkpoint.h"

#include "common/error.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/saved_variable_hooks.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

namespace eo {
namespace {

// ---- statistics ---------------------------------------------------------------------------------

struct Counters {
  std::atomic<int64_t> forwards{0}, recomputes{0}, handles_packed{0};
  std::atomic<int64_t> live_tensors{0}, live_bytes{0}, peak_tensors{0}, peak_bytes{0};
};
Counters g_counters;

void raise_peak(std::atomic<int64_t>& peak, int64_t value) {
  int64_t seen = peak.load();
  while (value > seen && !peak.compare_exchange_weak(seen, value)) {
  }
}

void count_live(const at::Tensor& t, int sign) {
  const int64_t bytes = static_cast<int64_t>(t.numel()) * static_cast<int64_t>(t.element_size());
  raise_peak(g_counters.peak_tensors, g_counters.live_tensors += sign);
  raise_peak(g_counters.peak_bytes, g_counters.live_bytes += sign * bytes);
}

// ---- RNG fork -----------------------------------------------------------------------------------

struct RngState {
  at::Device device;
  at::Tensor state;
};

at::Tensor get_generator_state(const at::Device& device) {
  auto gen = at::globalContext().defaultGenerator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_generator_state(const RngState& saved) {
  auto gen = at::globalContext().defaultGenerator(saved.device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(saved.state);
}

// CPU generator always; the CUDA generator of every CUDA device among the inputs.
std::vector<RngState> capture_rng(const std::vector<at::Tensor>& inputs) {
  std::vector<RngState> states{{at::Device(at::kCPU), get_generator_state(at::Device(at::kCPU))}};
  for (const auto& t : inputs) {
    if (!t.defined() || !t.is_cuda()) continue;
    bool seen = false;
    for (const auto& s : states) seen = seen || s.device == t.device();
    if (!seen) states.push_back({t.device(), get_generator_state(t.device())});
  }
  return states;
}

// Sets the saved states for the recompute and puts the current ones back afterwards, so the
// recompute's draws do not shift the RNG stream of whatever runs after backward.
class RngFork {
 public:
  explicit RngFork(const std::vector<RngState>& saved) {
    for (const auto& s : saved) outer_.push_back({s.device, get_generator_state(s.device)});
    for (const auto& s : saved) set_generator_state(s);
  }
  ~RngFork() {
    for (const auto& s : outer_) set_generator_state(s);
  }
  RngFork(const RngFork&) = delete;
  RngFork& operator=(const RngFork&) = delete;

 private:
  std::vector<RngState> outer_;
};

// ---- frames -------------------------------------------------------------------------------------

struct Slot {
  std::vector<int64_t> sizes;  // metadata of the forward's tensor, to check the recompute
  at::ScalarType dtype;
  at::Device device;
  bool alive = true;       // its SavedVariable still exists (backward may unpack it)
  at::Tensor recomputed;   // set by a recompute, moved out by the unpack
};

struct Frame {
  CheckpointFn fn;
  std::vector<at::Tensor> inputs;  // by reference: the very tensors the forward used
  std::vector<int64_t> input_versions;
  std::vector<RngState> rng;       // empty when the RNG is not preserved
  std::vector<Slot> slots;         // grows during the forward only

  std::mutex mutex;                // unpack/release may come from autograd device threads
  size_t record_cursor = 0;        // next slot the recompute fills
  std::string record_error;        // first mismatch seen while recording

  at::Tensor unpack(size_t index);
  void release(size_t index);
  void record(const at::Tensor& t);

 private:
  void recompute_locked();
};

thread_local std::shared_ptr<Frame> tl_forward_frame;  // set inside checkpoint()'s forward
thread_local Frame* tl_recording_frame = nullptr;      // set inside a recompute

std::string describe(const Slot& s) {
  return c10::str(s.dtype, " ", at::IntArrayRef(s.sizes), " on ", s.device);
}

void Frame::record(const at::Tensor& t) {
  const size_t index = record_cursor++;
  if (index >= slots.size()) {
    if (record_error.empty())
      record_error = c10::str("the recompute saved more tensors than the forward (", slots.size(), ")");
    return;
  }
  Slot& slot = slots[index];
  if (record_error.empty() &&
      (t.scalar_type() != slot.dtype || t.device() != slot.device || t.sizes() != at::IntArrayRef(slot.sizes)))
    record_error = c10::str("saved tensor ", index, " was ", describe(slot), " in the forward but ",
                            t.scalar_type(), " ", t.sizes(), " on ", t.device(), " in the recompute");
  if (!slot.alive) return;  // its node is gone: nobody will unpack it
  if (slot.recomputed.defined()) count_live(slot.recomputed, -1);
  slot.recomputed = t.detach();
  count_live(slot.recomputed, +1);
}

void Frame::recompute_locked() {
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].defined() || inputs[i].is_inference()) continue;
    EO_CHECK(inputs[i]._version() == input_versions[i], "eo::checkpoint: input ", i,
             " of a checkpointed block was modified in place after (or during) its forward; the "
             "recompute would see different values. Clone the tensor before modifying it.");
  }
  for (auto& slot : slots) {  // a second backward (retain_graph) recomputes everything again
    if (slot.recomputed.defined()) count_live(slot.recomputed, -1);
    slot.recomputed.reset();
  }
  record_cursor = 0;
  record_error.clear();
  {
    std::unique_ptr<RngFork> fork = rng.empty() ? nullptr : std::make_unique<RngFork>(rng);
    Frame* outer = tl_recording_frame;
    tl_recording_frame = this;
    try {
      at::AutoGradMode grad_on(true);
      fn(inputs);  // outputs (and the recompute's own graph) are dropped here
    } catch (...) {
      tl_recording_frame = outer;
      throw;
    }
    tl_recording_frame = outer;
  }
  g_counters.recomputes++;
  if (record_error.empty() && record_cursor != slots.size())
    record_error = c10::str("the recompute saved ", record_cursor, " tensors, the forward ", slots.size());
  EO_CHECK(record_error.empty(), "eo::checkpoint: the block's function is not deterministic: ", record_error,
           ". It must run the same operations on the same shapes each time (same RNG state).");
}

at::Tensor Frame::unpack(size_t index) {
  std::lock_guard<std::mutex> lock(mutex);
  EO_CHECK(index < slots.size(), "eo::checkpoint: saved-tensor handle ", index, " is out of range");
  if (!slots[index].recomputed.defined()) recompute_locked();
  at::Tensor t = std::move(slots[index].recomputed);
  slots[index].recomputed = at::Tensor();
  EO_CHECK(t.defined(), "eo::checkpoint: the recompute produced no tensor for handle ", index);
  count_live(t, -1);
  return t;
}

void Frame::release(size_t index) {
  std::lock_guard<std::mutex> lock(mutex);
  if (index >= slots.size()) return;
  slots[index].alive = false;
  if (slots[index].recomputed.defined()) count_live(slots[index].recomputed, -1);
  slots[index].recomputed = at::Tensor();
}

// ---- hooks --------------------------------------------------------------------------------------

constexpr size_t kUnpacked = static_cast<size_t>(-1);

// Forward: the saved tensor becomes an index into the frame; nothing is kept.
class HandleHooks final : public torch::autograd::SavedVariableHooks {
 public:
  explicit HandleHooks(std::shared_ptr<Frame> frame) : frame_(std::move(frame)) {}
  ~HandleHooks() override {
    if (index_ != kUnpacked) frame_->release(index_);
  }
  void call_pack_hook(const at::Tensor& t) override {
    // The forward runs on one thread and no backward of this frame can run yet: no lock needed.
    index_ = frame_->slots.size();
    frame_->slots.push_back(Slot{t.sizes().vec(), t.scalar_type(), t.device()});
    g_counters.handles_packed++;
  }
  at::Tensor call_unpack_hook() override { return frame_->unpack(index_); }

 private:
  std::shared_ptr<Frame> frame_;
  size_t index_ = kUnpacked;
};

// Recompute: the saved tensor goes into the frame's next slot. The recompute's own graph is
// never run backward; its SavedVariables die with it.
class RecordingHooks final : public torch::autograd::SavedVariableHooks {
 public:
  explicit RecordingHooks(Frame* frame) : frame_(frame) {}
  void call_pack_hook(const at::Tensor& t) override { frame_->record(t); }
  at::Tensor call_unpack_hook() override {
    EO_FAIL("eo::checkpoint: a tensor saved during a checkpoint recompute was used by a backward; "
            "the recompute's outputs must not escape the block's function.");
  }

 private:
  Frame* frame_;
};

// ---- engine -------------------------------------------------------------------------------------

class CheckpointEngine final : public torch::autograd::Engine {
 public:
  static torch::autograd::Engine& instance() {
    static CheckpointEngine engine;
    return engine;
  }
  ~CheckpointEngine() override { stop(); }  // required by Engine before the base destructor runs

  std::unique_ptr<torch::autograd::SavedVariableHooks> get_default_saved_variable_hooks() override {
    if (tl_recording_frame) return std::make_unique<RecordingHooks>(tl_recording_frame);
    if (tl_forward_frame) return std::make_unique<HandleHooks>(tl_forward_frame);
    return nullptr;
  }

 private:
  CheckpointEngine() = default;
};

std::once_flag g_install_once;

}  // namespace

void install_checkpoint_engine() {
  std::call_once(g_install_once, [] {
    (void)CheckpointEngine::instance();
    torch::autograd::set_default_engine_stub(&CheckpointEngine::instance);
  });
}

bool checkpoint_is_recomputing() { return tl_recording_frame != nullptr; }

std::vector<at::Tensor> checkpoint(const CheckpointFn& fn, const std::vector<at::Tensor>& inputs,
                                   bool preserve_rng_state) {
  EO_CHECK(fn, "eo::checkpoint: the block function is empty");
  EO_CHECK(&torch::autograd::Engine::get_default_engine() == &CheckpointEngine::instance(),
           "eo::checkpoint: the default autograd engine is not eo's checkpoint engine; call "
           "eo::install_checkpoint_engine() at program start, before any autograd work");
  EO_CHECK(!tl_forward_frame && !tl_recording_frame,
           "eo::checkpoint: nested checkpoints are not supported; checkpoint the outer or the inner "
           "function, not both");

  auto frame = std::make_shared<Frame>();
  frame->fn = fn;
  frame->inputs = inputs;
  for (const auto& t : inputs)
    frame->input_versions.push_back(t.defined() && !t.is_inference() ? t._version() : 0);
  if (preserve_rng_state) frame->rng = capture_rng(inputs);

  std::vector<at::Tensor> outputs;
  tl_forward_frame = frame;
  try {
    outputs = fn(inputs);
  } catch (...) {
    tl_forward_frame.reset();
    throw;
  }
  tl_forward_frame.reset();
  g_counters.forwards++;
  return outputs;  // `frame` now lives only through the handles its saved tensors got
}

CheckpointStats checkpoint_stats() {
  CheckpointStats s;
  s.forwards = g_counters.forwards;
  s.recomputes = g_counters.recomputes;
  s.handles_packed = g_counters.handles_packed;
  s.live_recomputed_tensors = g_counters.live_tensors;
  s.live_recomputed_bytes = g_counters.live_bytes;
  s.peak_live_recomputed_tensors = g_counters.peak_tensors;
  s.peak_live_recomputed_bytes = g_counters.peak_bytes;
  return s;
}

void reset_checkpoint_stats() {
  g_counters.forwards = 0;
  g_counters.recomputes = 0;
  g_counters.handles_packed = 0;
  g_counters.peak_tensors = g_counters.live_tensors.load();
  g_counters.peak_bytes = g_counters.live_bytes.load();
}

}  // namespace eo
