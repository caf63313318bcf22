// The copy stream's pace (contract: copy_pace_cuda.h).
#include "offload/copy_pace_cuda.h"

namespace eo::offload::cuda {
namespace {

__device__ __forceinline__ std::int64_t device_clock_ns() {
  std::uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return static_cast<std::int64_t>(t);
}

__global__ void stamp_kernel(std::int64_t* stamp) { *stamp = device_clock_ns(); }

__global__ void wait_kernel(const std::int64_t* stamp, std::int64_t min_ns) {
  const std::int64_t until = *stamp + min_ns;
  while (device_clock_ns() < until) __nanosleep(2000);
}

}  // namespace

cudaError_t pace_begin(std::int64_t* stamp, cudaStream_t s) {
  stamp_kernel<<<1, 1, 0, s>>>(stamp);
  return cudaGetLastError();
}

cudaError_t pace_end(const std::int64_t* stamp, std::int64_t min_ns, cudaStream_t s) {
  wait_kernel<<<1, 1, 0, s>>>(stamp, min_ns);
  return cudaGetLastError();
}

}  // namespace eo::offload::cuda
