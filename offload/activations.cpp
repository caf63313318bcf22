#include "offload/activations.h"

#include <ATen/ATen.h>

#include <cstring>

#include "common/error.h"

#ifdef EO_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include "common/cuda_check.h"
#endif

namespace eo::offload {
namespace {
std::int64_t nbytes(const at::Tensor& t) { return t.defined() ? t.numel() * static_cast<std::int64_t>(t.element_size()) : 0; }
}  // namespace

struct ActivationStore::Entry {
  at::Tensor device;  // defined while the input is (or is being brought back) on the device
  at::Tensor host;    // with to_host: the page-locked copy
#ifdef EO_WITH_CUDA
  cudaEvent_t ready = nullptr;  // the copy back to the device has finished
#endif
};

struct ActivationStore::Cuda {
#ifdef EO_WITH_CUDA
  explicit Cuda(int index) : copy(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, index)) {}
  c10::cuda::CUDAStream copy;
  // The copy stream waits until everything enqueued on the compute stream so far is done.
  void copy_waits_for_compute(int index) {
    cudaEvent_t e;
    EO_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "activation offloading: cudaEventCreate");
    EO_CUDA_CHECK(cudaEventRecord(e, c10::cuda::getCurrentCUDAStream(index).stream()), "activation offloading: cudaEventRecord");
    EO_CUDA_CHECK(cudaStreamWaitEvent(copy.stream(), e, 0), "activation offloading: cudaStreamWaitEvent");
    EO_CUDA_CHECK(cudaEventDestroy(e), "activation offloading: cudaEventDestroy");  // released once it has completed
  }
#endif
};

ActivationStore::ActivationStore(at::Device device, bool to_host) : device_(device), to_host_(to_host) {
#ifdef EO_WITH_CUDA
  if (to_host_ && device_.is_cuda()) cuda_ = std::make_unique<Cuda>(device_.index());
#endif
}

ActivationStore::~ActivationStore() { clear(); }

at::Tensor ActivationStore::host_buffer(const at::Tensor& like) {
  for (std::size_t i = 0; i < pool_.size(); ++i)
    if (pool_[i].numel() == like.numel() && pool_[i].scalar_type() == like.scalar_type()) {
      at::Tensor t = pool_[i].view(like.sizes());
      pool_.erase(pool_.begin() + static_cast<std::ptrdiff_t>(i));
      return t;
    }
  return at::empty(like.sizes(), like.options().device(at::kCPU).pinned_memory(cuda_ != nullptr));
}

void ActivationStore::put(int block, int micro, const at::Tensor& x) {
  auto e = std::make_unique<Entry>();
  if (!to_host_) {
    e->device = x;
  } else {
    const at::Tensor src = x.contiguous();
    e->host = host_buffer(src);
#ifdef EO_WITH_CUDA
    if (cuda_) {
      c10::cuda::CUDAGuard guard(device_.index());
      cuda_->copy_waits_for_compute(device_.index());
      EO_CUDA_CHECK(cudaMemcpyAsync(e->host.data_ptr(), src.data_ptr(), static_cast<std::size_t>(nbytes(src)),
                                    cudaMemcpyDeviceToHost, cuda_->copy.stream()),
                    "activation offloading: cudaMemcpyAsync (block input to host)");
      // The caller may drop `x` at once: its memory is not reused before the copy stream is done.
      c10::cuda::CUDACachingAllocator::recordStream(src.storage().data_ptr(), cuda_->copy);
    } else
#endif
    {
      std::memcpy(e->host.data_ptr(), src.data_ptr(), static_cast<std::size_t>(nbytes(src)));
    }
  }
  entries_[{block, micro}] = std::move(e);
  note_device_bytes();
}

void ActivationStore::prefetch(int block) {
  if (!to_host_) return;
  for (auto it = entries_.lower_bound({block, -1}); it != entries_.end() && it->first.first == block; ++it) {
    Entry& e = *it->second;
    if (e.device.defined()) continue;
    // Allocated on the compute stream, written by the copy stream after everything enqueued so far.
    e.device = at::empty(e.host.sizes(), e.host.options().device(device_).pinned_memory(false));
#ifdef EO_WITH_CUDA
    if (cuda_) {
      c10::cuda::CUDAGuard guard(device_.index());
      cuda_->copy_waits_for_compute(device_.index());
      EO_CUDA_CHECK(cudaMemcpyAsync(e.device.data_ptr(), e.host.data_ptr(), static_cast<std::size_t>(nbytes(e.host)),
                                    cudaMemcpyHostToDevice, cuda_->copy.stream()),
                    "activation offloading: cudaMemcpyAsync (block input to device)");
      EO_CUDA_CHECK(cudaEventCreateWithFlags(&e.ready, cudaEventDisableTiming), "activation offloading: cudaEventCreate");
      EO_CUDA_CHECK(cudaEventRecord(e.ready, cuda_->copy.stream()), "activation offloading: cudaEventRecord");
      continue;
    }
#endif
    std::memcpy(e.device.data_ptr(), e.host.data_ptr(), static_cast<std::size_t>(nbytes(e.host)));
  }
  note_device_bytes();
}

at::Tensor ActivationStore::take(int block, int micro) {
  auto it = entries_.find({block, micro});
  EO_CHECK(it != entries_.end(), "activation store: no saved input for block ", block, ", micro-batch ", micro,
           " (taken twice, or never stored)");
  if (!it->second->device.defined()) prefetch(block);  // not asked for ahead of time
  std::unique_ptr<Entry> e = std::move(it->second);
  entries_.erase(it);
#ifdef EO_WITH_CUDA
  if (e->ready) {
    EO_CUDA_CHECK(cudaStreamWaitEvent(c10::cuda::getCurrentCUDAStream(device_.index()).stream(), e->ready, 0),
                  "activation offloading: cudaStreamWaitEvent");
    EO_CUDA_CHECK(cudaEventDestroy(e->ready), "activation offloading: cudaEventDestroy");
  }
#endif
  // The host buffer is free for the next put: the copy stream is one stream, so a later copy into
  // it runs after this copy out of it.
  if (e->host.defined()) pool_.push_back(e->host);
  return e->device;
}

void ActivationStore::clear() {
#ifdef EO_WITH_CUDA
  if (cuda_) cudaStreamSynchronize(cuda_->copy.stream());
  for (auto& [key, e] : entries_)
    if (e->ready) cudaEventDestroy(e->ready);
#endif
  entries_.clear();
}

std::int64_t ActivationStore::device_bytes() const {
  std::int64_t n = 0;
  for (const auto& [key, e] : entries_) n += nbytes(e->device);
  return n;
}

std::int64_t ActivationStore::host_bytes() const {
  std::int64_t n = 0;
  for (const auto& [key, e] : entries_) n += nbytes(e->host);
  for (const auto& t : pool_) n += nbytes(t);
  return n;
}

void ActivationStore::note_device_bytes() { peak_device_bytes_ = std::max(peak_device_bytes_, device_bytes()); }

}  // namespace eo::offload
