// safetensors: memory-mapped reading with strict validation, atomic writing.
//
// Format (https://github.com/huggingface/safetensors): 8-byte little-endian header length N,
// N bytes of UTF-8 JSON {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__":
// {str: str}}, then the data. Offsets are relative to the data start. We validate like the
// reference reader: bounded header, well-formed JSON, known dtypes, offsets inside the data
// area, contiguous without holes or overlaps, numel * dtype size == end - begin (overflow
// checked), file ends at the last byte. Every error names the file and the tensor.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace eo::st {

enum class DType { BOOL, U8, I8, I16, U16, F16, BF16, I32, U32, F32, F64, I64, U64, F8_E4M3, F8_E5M2 };

struct TensorInfo {
  std::string name;
  DType dtype;
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0;  // offsets relative to the data area
  std::uint64_t end = 0;
};

// One .safetensors file, memory-mapped read-only for its lifetime.
class File {
 public:
  // Throws eo::Error with a message naming the file (and tensor) on any malformation.
  static std::shared_ptr<File> open(const std::string& path);
  ~File();

  const std::string& path() const { return path_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* find(const std::string& name) const;  // nullptr if absent
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // The raw bytes of a tensor inside the mapping (valid while the File lives).
  const std::uint8_t* data(const TensorInfo& t) const;
  // A tensor that owns a copy of the bytes (CPU, the stored dtype).
  at::Tensor load(const std::string& name) const;

 private:
  File() = default;
  std::string path_;
  void* map_ = nullptr;
  std::size_t map_size_ = 0;
  std::size_t data_start_ = 0;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::size_t> index_;
  std::map<std::string, std::string> metadata_;
};

// A Hugging Face checkpoint folder: model.safetensors, or shards listed by
// model.safetensors.index.json. Pickled checkpoints (*.bin, *.pt, *.pth) are refused with
// instructions to convert them; they are never unpickled.
class Checkpoint {
 public:
  static Checkpoint open(const std::string& folder);
  bool has(const std::string& name) const;
  at::Tensor load(const std::string& name) const;  // throws naming the tensor when missing
  const TensorInfo& info(const std::string& name) const;
  std::vector<std::string> names() const;  // sorted
  const std::string& folder() const { return folder_; }

  // What load() has read so far, for a progress line: the tensors' bytes (a tensor loaded twice
  // counts twice) and the shards touched; and what there is in all.
  std::uint64_t bytes_read() const { return read_.bytes; }
  std::size_t shards_read() const { return read_.shards; }
  std::size_t shards() const { return files_.size(); }
  std::uint64_t total_bytes() const;

 private:
  struct ReadTally {
    std::uint64_t bytes = 0;
    std::size_t shards = 0;
    std::vector<bool> touched;  // per shard
  };
  std::string folder_;
  std::vector<std::shared_ptr<File>> files_;
  std::map<std::string, std::size_t> where_;  // tensor name -> index into files_
  mutable ReadTally read_;
};

// Writes tensors (any device; contiguous copies are made on the CPU) to `path` atomically:
// a temporary file in the same folder, fsync, rename, fsync of the folder. Header padded with
// spaces to a multiple of 8; metadata always includes {"format": "pt"}.
void save(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
          const std::map<std::string, std::string>& metadata = {});

const char* dtype_name(DType d);
std::size_t dtype_size(DType d);

}  // namespace eo::st
