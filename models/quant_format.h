// The 4-bit formats a frozen weight is held in (QuantizedWeight's tag), and each format's
// sizes: the one table the memory plan (runtime/plan.h), the offload arenas (offload/layout.h) and
// the host-RAM check read. A header of its own so that sizes can be planned without libtorch.
#pragma once

#include <cstdint>

namespace eo {

// NF4: bitsandbytes' layout (models/nf4.h), quantised at load time. MXFP4: OCP microscaling FP4,
// 32 values per E8M0 scale byte (models/mxfp4.h), as gpt-oss's checkpoints store their experts.
// NVFP4: NVIDIA modelopt's FP4, 16 values per FP8 E4M3 scale byte and one fp32 scale per matrix
// (models/nvfp4.h), as modelopt's NVFP4 checkpoints store every quantised linear.
enum class QuantFormat : int { Nf4 = 0, Mxfp4 = 1, Nvfp4 = 2 };
const char* quant_format_name(QuantFormat f);  // "NF4", "MXFP4", "NVFP4"

// A checkpoint format's bytes per matrix of n values: n / 2 code bytes, n / group scale bytes,
// and `per_matrix` bytes more (NVFP4's fp32 global scale). NF4's statistics depend on the
// blocksize and double quantisation chosen at load time (offload/layout.h: nf4_piece_bytes).
struct StoredFormatBytes {
  int group = 0;           // values per scale byte
  int per_matrix = 0;      // bytes of per-matrix statistics
};
constexpr StoredFormatBytes stored_format_bytes(QuantFormat f) {
  return f == QuantFormat::Mxfp4 ? StoredFormatBytes{32, 0} : f == QuantFormat::Nvfp4 ? StoredFormatBytes{16, 4} : StoredFormatBytes{};
}

}  // namespace eo
