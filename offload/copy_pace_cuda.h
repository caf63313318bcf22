// A pace for the expert copy stream: the stream's work between pace_begin and pace_end takes at
// least min_ns on the device's clock (%globaltimer), whatever the link does. eo-bench uses it to
// run a card's host link (PCIe 4.0 x16: about 24 GB/s) on a faster machine; nothing is read back
// by the host, so the pace costs no synchronisation.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace eo::offload::cuda {

// Stores the device clock in *stamp (device memory) when the stream reaches this point.
cudaError_t pace_begin(std::int64_t* stamp, cudaStream_t s);
// Holds the stream until min_ns have passed since *stamp (one thread spins on the clock).
cudaError_t pace_end(const std::int64_t* stamp, std::int64_t min_ns, cudaStream_t s);

}  // namespace eo::offload::cuda
