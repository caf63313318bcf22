// The one arena layout of 4-bit experts, shared by the offload engine (homes and slots), the
// host-RAM check before loading and the memory plan, so the three never disagree: per expert and
// matrix (gate, up, down), the packed 4-bit codes, then the statistics (NF4: fp32 absmax, or with
// double quantisation the u8 absmax codes, then the fp32 nested absmax; MXFP4: the u8 E8M0 scales),
// each piece on a 256-byte boundary.
#pragma once

#include <cstdint>

#include "models/quant_format.h"

namespace eo::model {
struct ModelConfig;
}

namespace eo::offload {

constexpr std::int64_t kArenaAlign = 256;

struct PieceBytes {
  std::int64_t packed = 0, stats = 0, nested = 0;  // nested = 0: no double quantisation
};
struct PieceOffsets {
  std::int64_t packed = 0, stats = 0, nested = 0;
};

// Appends one matrix's pieces at `offset` (moved past them, aligned); returns where they start.
PieceOffsets place_matrix(std::int64_t& offset, const PieceBytes& bytes);
// The pieces of a matrix of `numel` weights quantised at load time (bitsandbytes' layout; the
// nested statistics use bitsandbytes' block of 256).
PieceBytes nf4_piece_bytes(std::int64_t numel, int blocksize, bool double_quant);
// The pieces of an MXFP4 matrix of `numel` weights (numel / 2 code bytes, numel / 32 scales).
PieceBytes mxfp4_piece_bytes(std::int64_t numel);
// One MoE block's arena: NF4 quantised at load time with blocksize / double_quant, or (format
// MXFP4) the checkpoint's MXFP4 experts kept as they are.
std::int64_t expert_block_bytes(const model::ModelConfig& c, int blocksize, bool double_quant,
                                QuantFormat format = QuantFormat::Nf4);

}  // namespace eo::offload
