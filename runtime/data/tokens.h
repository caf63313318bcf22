// Flat binary token files: a little-endian array of uint16 or uint32 token ids, nothing else.
//
// This is the cheapest pre-tokenized format (nanoGPT/llm.c style, written by tools/tokenize_data.py
// --format bin): the file is memory-mapped, validated once, and read on demand, so a corpus of
// billions of tokens costs no RAM beyond the page cache. Documents are split at eos_token_id (the
// eos stays as the last token of its document); without an eos the file is one stream cut into
// sequence_len chunks (like HF's group_texts). Labels are the input ids.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "runtime/data/batcher.h"

namespace eo::data {

enum class TokenDtype { kUint16, kUint32 };

// "uint16" | "uint32"; anything else is a UsageError naming `what` (e.g. the dataset path).
TokenDtype parse_token_dtype(const std::string& name, const std::string& what);
std::size_t token_dtype_size(TokenDtype dtype);

// A read-only memory map of one token file, validated on open:
// non-empty, size a multiple of the dtype size, and (given vocab_size) every id < vocab_size.
class TokenFile {
 public:
  TokenFile(const std::string& path, TokenDtype dtype, std::optional<std::int64_t> vocab_size = std::nullopt);
  ~TokenFile();
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;

  std::size_t size() const { return num_tokens_; }  // number of tokens
  std::uint32_t at(std::size_t index) const {
    return dtype_ == TokenDtype::kUint16 ? static_cast<const std::uint16_t*>(data_)[index]
                                         : static_cast<const std::uint32_t*>(data_)[index];
  }
  const std::string& path() const { return path_; }
  TokenDtype dtype() const { return dtype_; }

 private:
  std::string path_;
  TokenDtype dtype_;
  const void* data_ = nullptr;
  std::size_t bytes_ = 0;
  std::size_t num_tokens_ = 0;
};

// The documents of a token file, as a DocumentSource for the Batcher.
class TokenFileDocuments : public DocumentSource {
 public:
  // eos_token_id given: documents end after each eos (a trailing run without eos is the last
  // document). Not given: consecutive chunks of `chunk_len` tokens (the last may be shorter).
  TokenFileDocuments(const std::string& path, TokenDtype dtype, std::optional<std::int64_t> eos_token_id,
                     std::int64_t chunk_len, std::optional<std::int64_t> vocab_size = std::nullopt);

  std::size_t num_documents() const override { return doc_starts_.size() - 1; }
  std::int64_t length(std::size_t doc) const override {
    return static_cast<std::int64_t>(doc_starts_[doc + 1] - doc_starts_[doc]);
  }
  void read(std::size_t doc, std::int64_t begin, std::int64_t count, std::int64_t* input_ids,
            std::int64_t* labels) const override;
  std::string name() const override { return file_.path(); }

 private:
  TokenFile file_;
  std::vector<std::size_t> doc_starts_;  // token offsets; doc i is [doc_starts_[i], doc_starts_[i+1])
};

}  // namespace eo::data
