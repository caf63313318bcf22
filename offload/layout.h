// The one arena layout of 4-bit experts, shared by the offload engine (homes and slots), the
// host-RAM check before loading and the memory plan, so the three never disagree: per expert and
// matrix (gate, up, down), the packed 4-bit codes, then the statistics (NF4: fp32 absmax, or with
// double quantisation the u8 absmax codes, then the fp32 nested absmax; MXFP4: the u8 E8M0 scales;
// NVFP4: the u8 E4M3 scales, then the fp32 global scale), each piece on a 256-byte boundary.
#pragma once

#include <cstdint>

#include "models/quant_format.h"

namespace eo::model {
struct ModelConfig;
}

namespace eo::offload {

constexpr std::int64_t kArenaAlign = 256;

struct PieceBytes {
  std::int64_t packed = 0, stats = 0, nested = 0;  // nested: NF4's nested absmax or NVFP4's global scale; 0: none
};
struct PieceOffsets {
  std::int64_t packed = 0, stats = 0, nested = 0;
};

// Appends one matrix's pieces at `offset` (moved past them, aligned); returns where they start.
PieceOffsets place_matrix(std::int64_t& offset, const PieceBytes& bytes);
// The pieces of a matrix of `numel` weights quantised at load time (bitsandbytes' layout; the
// nested statistics use bitsandbytes' block of 256).
PieceBytes nf4_piece_bytes(std::int64_t numel, int blocksize, bool double_quant);
// The pieces of a matrix of `numel` weights kept in a checkpoint's format (MXFP4, NVFP4), from
// quant_format.h's table: numel / 2 code bytes, numel / group scales, the per-matrix bytes.
PieceBytes stored_piece_bytes(QuantFormat format, std::int64_t numel);
// One MoE block's arena: NF4 quantised at load time with blocksize / double_quant, or (format
// MXFP4 / NVFP4) the checkpoint's experts kept as they are.
std::int64_t expert_block_bytes(const model::ModelConfig& c, int blocksize, bool double_quant,
                                QuantFormat format = QuantFormat::Nf4);
// The largest arena range of `group` consecutive experts (a slot when blocks stream in groups:
// the engine's ExpertOffloader groups): experts [first, first + group) from the first's pieces to
// the next group's, or to the arena's end.
std::int64_t expert_group_bytes(const model::ModelConfig& c, int blocksize, bool double_quant, QuantFormat format, int group);

}  // namespace eo::offload
