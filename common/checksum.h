// One 64-bit checksum of byte ranges, shared by the cross-rank check of the expert homes
// (runtime/dist) and the disk homes file (offload/disk_homes). Not cryptographic: it catches
// different checkpoints, torn or corrupted files, not an adversary.
#pragma once

#include <cstddef>
#include <cstdint>

namespace eo {

// Four independent lanes over 32-byte blocks (several GB/s: fast enough for tens of GB of homes),
// then the tail; `seed` separates ranges hashed into one value.
std::uint64_t hash_bytes(const void* data, std::size_t bytes, std::uint64_t seed = 0);
// splitmix64's finaliser: combines hashes.
std::uint64_t mix64(std::uint64_t x);

}  // namespace eo
