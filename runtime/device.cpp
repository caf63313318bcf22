#include "runtime/device.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <thread>

#include "common/error.h"
#include "runtime/metrics.h"

#ifdef EO_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#endif

namespace eo {
namespace {
std::int64_t g_memory_limit = 0;  // set_device_memory_limit (one device per process)
}  // namespace

at::Device pick_device(int local_rank, int local_size) {
  if (!at::hasCUDA()) return at::Device(at::kCPU);
  const int n = static_cast<int>(at::getNumGPUs());
  if (local_size > n)
    throw UsageError(std::to_string(local_size) + " ranks on this node but only " + std::to_string(n) +
                     " visible GPU(s); start one rank per GPU (mpirun -np " + std::to_string(n) + " per node)");
  return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(local_rank));
}

std::string describe_device(const at::Device& d) { return d.str(); }

GpuCard gpu_card(const at::Device& d) {
  GpuCard card;
#ifdef EO_WITH_CUDA
  cudaDeviceProp prop{};
  if (d.is_cuda() && cudaGetDeviceProperties(&prop, d.index()) == cudaSuccess) {
    card.name = prop.name;
    card.major = prop.major;
    card.minor = prop.minor;
  }
#endif
  (void)d;
  return card;
}

bool device_has_bf16(const at::Device& d) { return d.is_cuda() && gpu_card(d).major >= 8; }

std::int64_t peak_memory_bytes(const at::Device& d) {
#ifdef EO_WITH_CUDA
  if (d.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(d.index());
    return stats.allocated_bytes[static_cast<std::size_t>(c10::CachingAllocator::StatType::AGGREGATE)].peak;
  }
#endif
  (void)d;
  return peak_rss_bytes();
}

void reset_peak_memory(const at::Device& d) {
#ifdef EO_WITH_CUDA
  if (d.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(d.index());
#endif
  (void)d;
}

std::int64_t peak_reserved_bytes(const at::Device& d) {
#ifdef EO_WITH_CUDA
  if (d.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(d.index());
    return stats.reserved_bytes[static_cast<std::size_t>(c10::CachingAllocator::StatType::AGGREGATE)].peak;
  }
#endif
  (void)d;
  return 0;
}

void release_cached_memory(const at::Device& d) {
#ifdef EO_WITH_CUDA
  if (d.is_cuda()) c10::cuda::CUDACachingAllocator::emptyCache();
#endif
  (void)d;
}

std::int64_t free_device_memory(const at::Device& d) {
#ifdef EO_WITH_CUDA
  if (d.is_cuda()) {
    c10::cuda::CUDAGuard guard(d.index());
    std::size_t free = 0, total = 0;
    C10_CUDA_CHECK(cudaMemGetInfo(&free, &total));
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(d.index());
    const auto agg = static_cast<std::size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    const std::int64_t allocated = stats.allocated_bytes[agg].current;
    const std::int64_t available = static_cast<std::int64_t>(free) + stats.reserved_bytes[agg].current - allocated;
    return g_memory_limit > 0 ? std::min(available, g_memory_limit - allocated) : available;
  }
#endif
  (void)d;
  return 0;
}

std::int64_t allocated_memory_bytes(const at::Device& d) {
#ifdef EO_WITH_CUDA
  if (d.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(d.index());
    return stats.allocated_bytes[static_cast<std::size_t>(c10::CachingAllocator::StatType::AGGREGATE)].current;
  }
#endif
  (void)d;
  return 0;
}

std::int64_t total_device_memory(const at::Device& d) {
#ifdef EO_WITH_CUDA
  if (d.is_cuda()) {
    c10::cuda::CUDAGuard guard(d.index());
    std::size_t free = 0, total = 0;
    C10_CUDA_CHECK(cudaMemGetInfo(&free, &total));
    return static_cast<std::int64_t>(total);
  }
#endif
  (void)d;
  return 0;
}

void set_device_memory_limit(const at::Device& d, std::int64_t bytes) {
#ifdef EO_WITH_CUDA
  if (d.is_cuda() && bytes > 0) {
    const std::int64_t total = total_device_memory(d);
    if (bytes > total)
      throw UsageError("device_memory_limit " + std::to_string(bytes) + " bytes exceeds the device's " + std::to_string(total) +
                       " bytes");
    c10::cuda::CUDACachingAllocator::setMemoryFraction(double(bytes) / double(total), d.index());
    g_memory_limit = bytes;
  }
#endif
  (void)d;
  (void)bytes;
}

bool expand_allocator_segments(const at::Device& d) {
#ifdef EO_WITH_CUDA
  if (d.is_cuda() && !std::getenv("PYTORCH_CUDA_ALLOC_CONF") && !std::getenv("PYTORCH_ALLOC_CONF")) {
    c10::CachingAllocator::setAllocatorSettings("expandable_segments:True");
    return true;
  }
#endif
  (void)d;
  return false;
}

void synchronize(const at::Device& d) {
#ifdef EO_WITH_CUDA
  if (d.is_cuda()) c10::cuda::device_synchronize();
#endif
  (void)d;
}

HostCopy::HostCopy() = default;
HostCopy::HostCopy(HostCopy&&) noexcept = default;
HostCopy& HostCopy::operator=(HostCopy&&) noexcept = default;
HostCopy::~HostCopy() = default;

HostCopy::HostCopy(const at::Tensor& t) {
  if (!t.is_cuda()) {
    host_ = t.to(at::kCPU, /*non_blocking=*/false, /*copy=*/true);
    return;
  }
  host_ = at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(true));
  host_.copy_(t, /*non_blocking=*/true);
  done_ = std::make_unique<c10::Event>(c10::DeviceType::CUDA);
  done_->record(c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(t.device()));
}

const at::Tensor& HostCopy::get() {
  EO_CHECK(host_.defined(), "HostCopy::get on an empty copy");
  if (done_) {
    done_->synchronize();
    done_.reset();
  }
  return host_;
}

double steady_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

DeviceMark DeviceMark::record(const at::Device& d) {
  DeviceMark m;
  m.defined_ = true;
#ifdef EO_WITH_CUDA
  if (d.is_cuda()) {
    c10::cuda::CUDAGuard guard(d.index());
    cudaEvent_t e = nullptr;
    C10_CUDA_CHECK(cudaEventCreate(&e));  // default flags: with timing
    m.event_ = std::shared_ptr<void>(e, [](void* p) { cudaEventDestroy(static_cast<cudaEvent_t>(p)); });
    C10_CUDA_CHECK(cudaEventRecord(e, c10::cuda::getCurrentCUDAStream(d.index()).stream()));
    return m;
  }
#endif
  (void)d;
  m.wall_s_ = steady_seconds();
  return m;
}

double DeviceMark::seconds_since(const DeviceMark& earlier) const {
  EO_CHECK(defined_ && earlier.defined_, "DeviceMark::seconds_since on an unset mark");
  EO_CHECK(bool(event_) == bool(earlier.event_), "DeviceMark::seconds_since between a GPU and a CPU mark");
#ifdef EO_WITH_CUDA
  if (event_) {
    auto* e = static_cast<cudaEvent_t>(event_.get());
    C10_CUDA_CHECK(cudaEventSynchronize(e));
    float ms = 0;
    C10_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(earlier.event_.get()), e));
    return double(ms) / 1e3;
  }
#endif
  return wall_s_ - earlier.wall_s_;
}

namespace {
struct StreamHold {
  double seconds;
  std::function<void(double)> on_run;
};
void run_stream_hold(void* p) {
  std::unique_ptr<StreamHold> h(static_cast<StreamHold*>(p));
  if (h->on_run) h->on_run(steady_seconds());
  std::this_thread::sleep_for(std::chrono::duration<double>(h->seconds));
}
}  // namespace

void hold_device_stream(const at::Device& d, double seconds, std::function<void(double)> on_run) {
  auto* h = new StreamHold{seconds, std::move(on_run)};
#ifdef EO_WITH_CUDA
  if (d.is_cuda()) {
    C10_CUDA_CHECK(cudaLaunchHostFunc(c10::cuda::getCurrentCUDAStream(d.index()).stream(), run_stream_hold, h));
    return;
  }
#endif
  (void)d;
  run_stream_hold(h);
}

}  // namespace eo
