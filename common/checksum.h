// One 64-bit checksum of byte ranges, shared by the cross-rank check of the expert homes
// (runtime/ddp) and the disk homes file (offload/disk_homes). Not cryptographic: it catches
// different checkpoints, torn or corrupted files, not an adversary.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace eo {

// Four independent lanes over 32-byte blocks (several GB/s: fast enough for tens of GB of homes),
// then the tail; `seed` separates ranges hashed into one value.
std::uint64_t hash_bytes(const void* data, std::size_t bytes, std::uint64_t seed = 0);
// splitmix64's finaliser: combines hashes.
std::uint64_t mix64(std::uint64_t x);

// A file's contents, streamed in 16 MiB pieces (hash_bytes of each, seeded by its index, chained by
// mix64): the checkpoint checksums and the base model's content hash. Returns false (errno set)
// if the file cannot be opened or read; `bytes` gets the number of bytes hashed. A link at `path`
// is followed (the base model's files may be links into a cache).
bool hash_file(const std::string& path, std::uint64_t& hash, std::uint64_t& bytes);

// FNV-1a, 64 bits, byte by byte: the fingerprint the dataset cache's keys and earlier checkpoints'
// base_model_fingerprint are made of, kept bit for bit so that those still match. Slow for large
// data: new fingerprints use hash_bytes.
struct Fnv1a64 {
  std::uint64_t h = 1469598103934665603ull;
  void add(const void* data, std::size_t n);
  void add(const std::string& s) { add(s.data(), s.size()); }
  std::string hex() const;  // 16 lower-case hex digits
};

}  // namespace eo
