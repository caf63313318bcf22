// The checkpointed block inputs of one optimizer step (design.md §1: "keep block input x[i][m]").
//
// The layer-major step keeps the input of every (block, micro-batch) until that block's backward:
// g micro-batches x N blocks x [B, T, H]. On the device by default; with activation_offloading
// (axolotl's key) each input is copied to page-locked host memory on a copy stream as soon as it
// is stored, and copied back ahead of use: prefetch(i) is called when backward reaches block i+1,
// so the copies of block i's inputs overlap block i+1's backward. Device memory then holds the
// inputs of about two blocks instead of all of them.
//
// The copy stream waits on an event recorded on the compute stream, so it reads a tensor only
// after the kernel that wrote it; the caching allocator is told the copy stream uses the tensor
// (recordStream), so dropping it right away is safe. On a CPU build "host" buffers are separate
// host tensors filled by memcpy: the same bookkeeping runs, so it is tested without a GPU.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <utility>
#include <vector>

namespace eo::offload {

class ActivationStore {
 public:
  ActivationStore(at::Device device, bool to_host);
  ~ActivationStore();
  ActivationStore(const ActivationStore&) = delete;
  ActivationStore& operator=(const ActivationStore&) = delete;

  bool to_host() const { return to_host_; }
  // Keeps `x` (a block input, not modified afterwards) as (block, micro)'s saved input.
  void put(int block, int micro, const at::Tensor& x);
  // Starts bringing every saved input of `block` back to the device (no-op when kept there).
  void prefetch(int block);
  // (block, micro)'s saved input on the device; it leaves the store.
  at::Tensor take(int block, int micro);
  // Drops everything (a step that failed half way).
  void clear();

  std::int64_t device_bytes() const;  // saved inputs on the device now
  std::int64_t host_bytes() const;    // page-locked host bytes held (now, pool included)
  std::int64_t peak_device_bytes() const { return peak_device_bytes_; }
  void reset_peak() { peak_device_bytes_ = device_bytes(); }

 private:
  struct Entry;
  struct Cuda;
  at::Tensor host_buffer(const at::Tensor& like);
  void note_device_bytes();

  at::Device device_;
  bool to_host_;
  std::map<std::pair<int, int>, std::unique_ptr<Entry>> entries_;
  std::vector<at::Tensor> pool_;  // free host buffers, reused across steps
  std::int64_t peak_device_bytes_ = 0;
  std::unique_ptr<Cuda> cuda_;
};

}  // namespace eo::offload
