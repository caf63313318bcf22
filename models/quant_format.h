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

// One row per format: what code outside the format's codec may know about it. A format's bytes
// per matrix of n values are n / 2 code bytes, n / group scale bytes and `per_matrix` bytes more
// (NVFP4's fp32 global scale). NF4's statistics depend on the blocksize and double quantisation
// chosen at load time (offload/layout.h: nf4_piece_bytes): group 0. Its dequantisers are the
// row of the same format in models/quantized_weight.cpp.
struct QuantFormatTraits {
  QuantFormat format;
  const char* name;      // "NF4", "MXFP4", "NVFP4"
  int group;             // values per scale byte (0: NF4's blocksize, chosen at load)
  int per_matrix;        // bytes of per-matrix statistics
  bool checkpoint_own;   // held as the checkpoint stores it (not quantised by eo-ddp at load)
};
inline constexpr QuantFormatTraits kQuantFormats[] = {
    {QuantFormat::Nf4, "NF4", 0, 0, false},
    {QuantFormat::Mxfp4, "MXFP4", 32, 0, true},
    {QuantFormat::Nvfp4, "NVFP4", 16, 4, true},
};
static_assert(kQuantFormats[0].format == QuantFormat::Nf4 && kQuantFormats[1].format == QuantFormat::Mxfp4 &&
                  kQuantFormats[2].format == QuantFormat::Nvfp4,
              "kQuantFormats: one row per QuantFormat, in the enum's order");
constexpr const QuantFormatTraits& quant_format_traits(QuantFormat f) { return kQuantFormats[static_cast<int>(f)]; }
constexpr const char* quant_format_name(QuantFormat f) { return quant_format_traits(f).name; }

}  // namespace eo
