// The base model's identity: what resume and the ranks' agreement compare to know that two runs
// train on the same weights.
#pragma once

#include <string>

namespace eo {

struct TrainConfig;

// config.json, then for every *.safetensors file of base_model (sorted by name) its name, size,
// safetensors header and a hash of its full contents (common/checksum.h hash_file), so any
// changed byte of any tensor gives another identity; a copy in another folder gives the same one.
// Synthetic weights: their seed. The content hashes are cached (see file_content_hash).
std::string base_model_identity(const TrainConfig& cfg);

// hash_file of `path` (hex; the base model's files, the datasets resume compares), cached by (real path, size, mtime, ctime, inode, device) in
// $XDG_CACHE_HOME/eo-ddp/file-hashes.json (~/.cache/eo-ddp without XDG_CACHE_HOME) and in
// process: a file is read once until it changes (an edit changes ctime, which no tool can set
// back). Concurrent processes (the ranks of a node) take the cache's lock, so one reads the file
// while the others wait for its result. An unwritable cache only costs the read each start.
// Throws eo::Error if the file cannot be read.
std::string file_content_hash(const std::string& path);

}  // namespace eo
