#include "offload/layout.h"

#include <algorithm>
#include <vector>

#include "models/hf_config.h"

namespace eo::offload {
namespace {
std::int64_t align_up(std::int64_t x) { return (x + kArenaAlign - 1) / kArenaAlign * kArenaAlign; }
constexpr std::int64_t kNestedBlocksize = 256;  // bitsandbytes' double-quantisation block
}  // namespace

PieceOffsets place_matrix(std::int64_t& offset, const PieceBytes& b) {
  PieceOffsets at;
  at.packed = offset;
  offset = align_up(offset + b.packed);
  at.stats = offset;
  offset = align_up(offset + b.stats);
  if (b.nested > 0) {
    at.nested = offset;
    offset = align_up(offset + b.nested);
  }
  return at;
}

PieceBytes nf4_piece_bytes(std::int64_t numel, int blocksize, bool double_quant) {
  const std::int64_t nblocks = (numel + blocksize - 1) / blocksize;
  PieceBytes b;
  b.packed = (numel + 1) / 2;
  if (double_quant) {
    b.stats = nblocks;  // u8 codes
    b.nested = (nblocks + kNestedBlocksize - 1) / kNestedBlocksize * 4;
  } else {
    b.stats = nblocks * 4;
  }
  return b;
}

PieceBytes stored_piece_bytes(QuantFormat format, std::int64_t numel) {
  const QuantFormatTraits& f = quant_format_traits(format);
  PieceBytes b;
  b.packed = numel / 2;
  b.stats = numel / f.group;  // one scale byte per group
  b.nested = f.per_matrix;
  return b;
}

namespace {
// Where each expert's pieces start in the arena, and the arena's end last.
std::vector<std::int64_t> expert_starts(const model::ModelConfig& c, int blocksize, bool double_quant, QuantFormat format) {
  const std::int64_t n = c.hidden * c.expert_width;  // gate, up [I, H]; down [H, I]
  const PieceBytes m = format == QuantFormat::Nf4 ? nf4_piece_bytes(n, blocksize, double_quant) : stored_piece_bytes(format, n);
  std::vector<std::int64_t> starts;
  std::int64_t offset = 0;
  for (std::int64_t e = 0; e < c.experts; ++e) {
    starts.push_back(offset);
    for (int k = 0; k < 3; ++k) place_matrix(offset, m);
  }
  starts.push_back(offset);
  return starts;
}
}  // namespace

std::int64_t expert_block_bytes(const model::ModelConfig& c, int blocksize, bool double_quant, QuantFormat format) {
  return expert_starts(c, blocksize, double_quant, format).back();
}

std::int64_t expert_group_bytes(const model::ModelConfig& c, int blocksize, bool double_quant, QuantFormat format, int group) {
  const std::vector<std::int64_t> starts = expert_starts(c, blocksize, double_quant, format);
  const std::int64_t E = static_cast<std::int64_t>(starts.size()) - 1;
  std::int64_t most = 0;
  for (std::int64_t first = 0; first < E; first += group)
    most = std::max(most, starts[static_cast<std::size_t>(std::min(E, first + group))] - starts[static_cast<std::size_t>(first)]);
  return most;
}

}  // namespace eo::offload
