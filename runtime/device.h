// The rank's compute device and its memory statistics. CUDA specifics stay in device.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace c10 {
struct Event;
}

namespace eo {

// cuda:<local_rank> when this build and host have CUDA, else the CPU. More local ranks than
// visible GPUs is a UsageError.
at::Device pick_device(int local_rank, int local_size);
std::string describe_device(const at::Device& d);
// A GPU's name and compute capability (empty and 0.0 for the CPU).
struct GpuCard {
  std::string name;
  int major = 0, minor = 0;
};
GpuCard gpu_card(const at::Device& d);
// Whether d computes in bf16: a CUDA card of compute capability 8.0 or newer (bf16 tensor cores).
bool device_has_bf16(const at::Device& d);

// Peak bytes allocated since the last reset: the CUDA caching allocator's peak on a GPU, the
// process' max RSS on the CPU.
std::int64_t peak_memory_bytes(const at::Device& d);
void reset_peak_memory(const at::Device& d);
// The caching allocator's peak of reserved (held from the driver) bytes since the last reset,
// and releasing what it caches unused; 0 / nothing off a GPU.
std::int64_t peak_reserved_bytes(const at::Device& d);
void release_cached_memory(const at::Device& d);
// Bytes this process could still allocate on the device: free per the driver plus what the
// caching allocator holds but does not use. 0 on the CPU.
std::int64_t free_device_memory(const at::Device& d);
std::int64_t allocated_memory_bytes(const at::Device& d);
void synchronize(const at::Device& d);
// Total device memory (0 on the CPU).
std::int64_t total_device_memory(const at::Device& d);
// Caps what the caching allocator may hand out on d at `bytes` (its memory fraction), so a big
// GPU behaves like a small card; allocations beyond raise out-of-memory. free_device_memory()
// then counts against the cap. No-op on the CPU.
void set_device_memory_limit(const at::Device& d, std::int64_t bytes);

// Lets the caching allocator grow its segments in place (PyTorch's expandable_segments) where a run
// frees and takes back banks of gigabytes, which fixed segments fragment past the plan's margin. Not
// where the user's PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF already says how to allocate, nor on
// the CPU. True when it was turned on.
bool expand_allocator_segments(const at::Device& d);

// A tensor's copy on the host, queued behind the work already queued on the device's current
// stream (into pinned memory, non-blocking), so the host goes on queuing work meanwhile; get()
// waits for that copy only. A CPU tensor is copied at once.
class HostCopy {
 public:
  HostCopy();
  explicit HostCopy(const at::Tensor& t);
  HostCopy(HostCopy&&) noexcept;
  HostCopy& operator=(HostCopy&&) noexcept;
  ~HostCopy();
  bool defined() const { return host_.defined(); }
  const at::Tensor& get();  // the host tensor, once the copy is done

 private:
  at::Tensor host_;
  std::unique_ptr<c10::Event> done_;
};

// A point in the device's stream of work, for timing it on the device's own clock. On a GPU it
// is a timing CUDA event recorded on the current stream: it completes once the work queued
// before it has run, so the time between two marks is what the device took, however late the
// host reads it. On the CPU the work is done when it is queued, and a mark is the wall clock.
class DeviceMark {
 public:
  DeviceMark() = default;
  static DeviceMark record(const at::Device& d);
  bool defined() const { return defined_; }
  // Seconds from `earlier` to this mark, on the device's clock; waits for this mark only.
  double seconds_since(const DeviceMark& earlier) const;

 private:
  bool defined_ = false;
  std::shared_ptr<void> event_;  // cudaEvent_t on a GPU
  double wall_s_ = 0;            // steady clock, CPU marks
};

// Holds the device's current stream for `seconds` at this point of its work (a host function the
// stream waits on; a sleep on the CPU), as if the kernels queued here took that long. `on_run`,
// if set, is called with the steady-clock second at which the stream reached this point. For
// the timing tests (through the test seam); nothing in training calls it.
void hold_device_stream(const at::Device& d, double seconds, std::function<void(double)> on_run = {});
double steady_seconds();  // std::chrono::steady_clock, in seconds

}  // namespace eo
