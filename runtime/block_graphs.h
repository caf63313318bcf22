// CUDA graphs of a step's uses. A decoder block at micro-batch 1 is ~100 small kernels per use,
// launched from one host thread (and each backward hands over to autograd's device thread): the
// step waits on the host, and more so when another process takes the cores. Each use of the step
// schedule (runtime/step.h: a block's forward, its recompute + backward, the loss and its
// backward) is a function of a few tensors with static shapes (the block input, the RoPE tables,
// the mask, the incoming gradient; the labels and token count) reading weights at fixed device
// addresses, so it replays as one graph.
//
//   run(key, inputs, fn): the first use of a key runs fn eagerly (warm-up: lazy library state,
//   workspaces); the second captures fn on static input buffers and replays it; later uses copy the
//   inputs into those buffers and replay. What fn returns is copied into static output buffers
//   inside the graph and handed back as fresh tensors (the next replay overwrites the buffers).
//
// The key must name everything that makes two uses different graphs: the block, forward or
// backward, where its experts (and an offloaded expert LoRA) are staged (WeightProvider::placement),
// which optional inputs are present. Input shapes and dtypes are added here. Side effects of fn on
// tensors outside its inputs (LoRA gradients accumulated in place) replay at the same addresses:
// the gradients must stay allocated between steps (Optimizer::zero_grad zeroes them in place; an
// offloaded expert LoRA's live in its fixed slots).
//
// Static input and output buffers are shared by all graphs (one per argument position, shape and
// dtype), and all graphs allocate from one memory pool: uses run one after another on one stream,
// so the temporaries of one graph are free while another replays. Before each capture the default
// pool's cache is released, so it and the graphs' pool do not each keep a working set.
//
// A capture that fails (an operation that cannot be captured) turns graphs off for the rest of the
// run, with one log line; the use runs eagerly. CPU builds and CPU devices always run eagerly.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace eo {

class BlockGraphs {
 public:
  using Fn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

  // enabled = false, or a CPU device: every run() calls fn directly.
  BlockGraphs(const at::Device& device, bool enabled);
  ~BlockGraphs();
  BlockGraphs(const BlockGraphs&) = delete;
  BlockGraphs& operator=(const BlockGraphs&) = delete;

  bool enabled() const { return enabled_; }
  // Undefined inputs are allowed (an absent mask); they are part of the key.
  std::vector<at::Tensor> run(const std::string& key, const std::vector<at::Tensor>& inputs, const Fn& fn);

  int graphs() const;          // captured so far
  std::int64_t replays() const { return replays_; }

  struct Pool;  // CUDA: the capture stream, the memory pool

 private:
  struct Entry;
  at::Tensor& shared_buffer(std::map<std::string, at::Tensor>& buffers, std::size_t position, const at::Tensor& like);
  void capture(Entry& e, const std::vector<at::Tensor>& inputs, const Fn& fn);

  at::Device device_;
  bool enabled_;
  std::map<std::string, std::unique_ptr<Entry>> entries_;
  std::map<std::string, at::Tensor> inputs_, outputs_;  // shared static buffers
  std::int64_t replays_ = 0;
  std::unique_ptr<Pool> pool_;
};

}  // namespace eo
