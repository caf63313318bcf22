// File-system helpers that must work the same in every build.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace eo {

// rm -r with POSIX calls (nftw). std::filesystem::remove_all crashed at run time in the CUDA
// build (libtorch 2.11 wheel) while the CPU build was fine; this has no such dependency.
// A missing path is not an error; a failure throws eo::Error naming the path.
void remove_tree(const std::string& path);

// fsync of a file or a folder (a folder's fsync makes a rename inside it durable).
void fsync_path(const std::string& path);

// write(2) until done, retrying EINTR; throws eo::Error naming `what` (ENOSPC, EFBIG, EIO, ...).
void write_all(int fd, const void* data, std::size_t bytes, const std::string& what);

// The one atomic file writer: `fill(fd, tmp)` writes the contents into a fresh temporary file `tmp` in the
// target's folder (created O_EXCL | O_NOFOLLOW, so no link is followed), which is fsynced, renamed
// over `path` (replacing a link, never writing through it) and the folder fsynced. A crash or any
// error leaves the old file (or none) under `path` and no temporary behind.
void write_file_atomic(const std::string& path, const std::function<void(int fd, const std::string& tmp)>& fill,
                       mode_t mode = 0644);
void write_file_atomic(const std::string& path, const std::string& contents);

// open(2) with O_NOFOLLOW | O_CLOEXEC added: a symbolic link at `path` is refused with an
// eo::Error that names it (files under output_dir must not write through a link).
int open_nofollow(const std::string& path, int flags, mode_t mode = 0644);

// Reads a whole file without following a link at `path`; nullopt-like empty + false if missing.
bool read_file_nofollow(const std::string& path, std::string& out);

// Reads a whole file of the base model, following links (a Hugging Face cache's snapshot files
// are links into its blobs/); false if missing. It must be an input file (open_input_file) of at
// most kMaxTextFileBytes.
bool read_model_file(const std::string& path, std::string& out);

// Every file eo-ddp reads as input (the config, config.json, data and model files) is opened
// here: O_NONBLOCK, so that a FIFO or a device never blocks in open(), then fstat: anything but
// a regular file (/dev/zero, a FIFO, a socket), or one larger than `max_bytes` (0: any size), is
// refused with a UsageError naming `what`, the path and the reason. Returns a blocking fd, or -1
// with errno set when open(2) itself fails (a missing file: the caller words that).
int open_input_file(const std::string& path, const std::string& what, std::uint64_t max_bytes = 0);
// A whole input file (open_input_file); false if it does not exist.
bool read_input_file(const std::string& path, std::string& out, const std::string& what, std::uint64_t max_bytes);
// The bound for text inputs read whole (YAML and JSON configs, tokenizer files, shard indexes).
constexpr std::uint64_t kMaxTextFileBytes = std::uint64_t(64) << 20;

}  // namespace eo
