// libFuzzer: a flat binary token file through eo::data::TokenFileDocuments (the reader the
// trainer builds for `type: tokens` datasets), then every document read back.
// Input: an 8-byte options prefix, then the file's bytes.
//   byte 0: bit 0 dtype (0 uint16, 1 uint32), bit 1 eos_token_id given, bit 2 vocab_size given
//   bytes 1-2: eos_token_id (LE), byte 3: chunk length (sequence_len), bytes 4-5: vocab_size (LE)
//   bytes 6-7: unused
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/error.h"
#include "fuzz/fuzz_common.h"
#include "runtime/data/tokens.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 8) return 0;
  static const std::string path = eo::fuzz::scratch_dir() + "/train.bin";
  const auto dtype = (data[0] & 1) ? eo::data::TokenDtype::kUint32 : eo::data::TokenDtype::kUint16;
  std::optional<std::int64_t> eos, vocab;
  if (data[0] & 2) eos = data[1] | (data[2] << 8);
  const std::int64_t chunk = data[3];
  if (data[0] & 4) vocab = data[4] | (data[5] << 8);
  eo::fuzz::write_file(path, data + 8, size - 8);
  try {
    const eo::data::TokenFileDocuments docs(path, dtype, eos, chunk, vocab);
    const std::size_t tokens = (size - 8) / eo::data::token_dtype_size(dtype);
    std::size_t total = 0;
    std::vector<std::int64_t> ids, labels;
    for (std::size_t d = 0; d < docs.num_documents(); ++d) {
      const std::int64_t n = docs.length(d);
      EO_FUZZ_ASSERT(n > 0);
      if (!eos) EO_FUZZ_ASSERT(n <= chunk);
      ids.assign(n, -1);
      labels.assign(n, -1);
      docs.read(d, 0, n, ids.data(), labels.data());
      for (std::int64_t i = 0; i < n; ++i) {
        EO_FUZZ_ASSERT(ids[i] == labels[i] && ids[i] >= 0 && (!vocab || ids[i] < *vocab));
        // Only the last token of a document may be the eos.
        if (eos && i + 1 < n) EO_FUZZ_ASSERT(ids[i] != *eos);
      }
      total += static_cast<std::size_t>(n);
    }
    EO_FUZZ_ASSERT(total == tokens);
  } catch (const eo::Error&) {
  }
  return 0;
}
