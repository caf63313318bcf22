// libFuzzer: a disk homes file (offload/disk_homes.h) through eo::offload::check_disk_homes, the
// check a run makes before it trusts the file it finds in expert_offload_disk_path.
// Input: one mode byte, then
//   mode bit 0 clear: the file's bytes as they are;
//   mode bit 0 set:   the header's JSON, which the harness wraps in a valid prefix (magic, version,
//                     region size, both checksums) so the JSON and the comparisons are reached;
//                     bit 1 then pads the file with zeros to the expected header's size.
// The expected header: two blocks (layers 0 and 2) of a fixed identity. The check must return,
// never throw or crash; when it says the file matches, the file must be exactly as long as the
// expected header says.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/checksum.h"
#include "common/error.h"
#include "fuzz/fuzz_common.h"
#include "offload/disk_homes.h"

namespace {

const eo::offload::DiskHomesHeader& expected() {
  static const eo::offload::DiskHomesHeader h = [] {
    eo::offload::DiskHomesHeader e;
    e.identity = {{"base_model", "/m"}, {"bnb_4bit_blocksize", "64"}};
    eo::offload::DiskBlock a, b;
    a.layer = 0;
    a.bytes = 100;
    a.checksum = 0x1234;
    b.layer = 2;
    b.bytes = 5000;
    b.checksum = 0xabcd;
    e.blocks = {a, b};
    eo::offload::place_disk_blocks(e);
    return e;
  }();
  return h;
}

void put_u64(std::vector<std::uint8_t>& out, std::size_t at, std::uint64_t v) { std::memcpy(out.data() + at, &v, 8); }

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  static const std::string path = eo::fuzz::scratch_dir() + "/eo-ddp-expert-homes.bin";
  const std::uint8_t mode = data[0];
  std::vector<std::uint8_t> file(data + 1, data + size);
  if (mode & 1) {
    // The writer's prefix around the input JSON (offload/disk_homes_file.cpp, encode_header).
    const std::size_t json = file.size();
    const std::size_t region = (48 + json + 4095) / 4096 * 4096;
    std::vector<std::uint8_t> wrapped(region, 0);
    std::memcpy(wrapped.data(), "EODDPHOM", 8);
    const std::uint32_t version = eo::offload::kDiskHomesVersion;
    std::memcpy(wrapped.data() + 8, &version, 4);
    put_u64(wrapped, 16, region);
    put_u64(wrapped, 24, json);
    put_u64(wrapped, 32, eo::hash_bytes(file.data(), json, eo::offload::kDiskHomesVersion));
    put_u64(wrapped, 40, eo::hash_bytes(wrapped.data(), 40, eo::offload::kDiskHomesVersion));
    if (json) std::memcpy(wrapped.data() + 48, file.data(), json);
    if ((mode & 2) && static_cast<std::int64_t>(wrapped.size()) < expected().file_bytes)
      wrapped.resize(static_cast<std::size_t>(expected().file_bytes), 0);
    file = std::move(wrapped);
  }
  eo::fuzz::write_file(path, file.data(), file.size());
  const eo::offload::DiskHomesCheck c = eo::offload::check_disk_homes(path, expected());
  EO_FUZZ_ASSERT(c.exists);
  EO_FUZZ_ASSERT(c.matches == c.reason.empty());
  if (c.matches) EO_FUZZ_ASSERT(static_cast<std::int64_t>(file.size()) == expected().file_bytes);
  return 0;
}
