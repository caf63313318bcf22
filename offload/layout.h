// The one arena layout of NF4 experts, shared by the offload engine (homes and slots), the
// host-RAM check before loading and the memory plan, so the three never disagree: per expert and
// matrix (gate, up, down), the packed 4-bit codes, then the statistics (fp32 absmax; with double
// quantisation the u8 absmax codes, then the fp32 nested absmax), each piece on a 256-byte boundary.
#pragma once

#include <cstdint>

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
// One MoE block's arena for a model quantised at load time.
std::int64_t expert_block_bytes(const model::ModelConfig& c, int blocksize, bool double_quant);

}  // namespace eo::offload
