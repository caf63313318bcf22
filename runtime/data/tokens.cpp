// Flat binary token files: memory map, validation, split into documents. See tokens.h.
#include "runtime/data/tokens.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "common/error.h"
#include "common/files.h"

namespace eo::data {

namespace {

[[noreturn]] void usage_fail(const std::string& message) { throw UsageError(message); }

}  // namespace

TokenDtype parse_token_dtype(const std::string& name, const std::string& what) {
  if (name == "uint16") return TokenDtype::kUint16;
  if (name == "uint32") return TokenDtype::kUint32;
  usage_fail(detail::concat(what, ": token dtype '", name, "' is not supported; use uint16 or uint32"));
}

std::size_t token_dtype_size(TokenDtype dtype) { return dtype == TokenDtype::kUint16 ? 2 : 4; }

TokenFile::TokenFile(const std::string& path, TokenDtype dtype, std::optional<std::int64_t> vocab_size)
    : path_(path), dtype_(dtype) {
  const std::size_t item = token_dtype_size(dtype);
  const char* dtype_name = dtype == TokenDtype::kUint16 ? "uint16" : "uint32";
  const int fd = open_input_file(path, "token file");  // no FIFO or device, never blocks
  if (fd < 0) usage_fail(detail::concat("token file ", path, ": cannot open (", std::strerror(errno), ")"));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    usage_fail(detail::concat("token file ", path, ": not a regular file"));
  }
  bytes_ = static_cast<std::size_t>(st.st_size);
  if (bytes_ == 0) {
    ::close(fd);
    usage_fail(detail::concat("token file ", path, " is empty; it must hold at least one ", dtype_name, " token"));
  }
  if (bytes_ % item != 0) {
    ::close(fd);
    usage_fail(detail::concat("token file ", path, " has ", bytes_, " bytes, not a multiple of ", item, " (", dtype_name,
                              "): the last ", bytes_ % item,
                              " byte(s) are a partial token; is the dtype right, or was the file cut short?"));
  }
  num_tokens_ = bytes_ / item;
  void* map = ::mmap(nullptr, bytes_, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_errno = errno;
  ::close(fd);  // the mapping keeps the file alive
  if (map == MAP_FAILED) {
    EO_FAIL("token file ", path, ": mmap of ", bytes_, " bytes failed (", std::strerror(map_errno), ")");
  }
  data_ = map;
  ::madvise(map, bytes_, MADV_WILLNEED);

  // The file is little-endian by definition; every supported host is too.
  static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "token files are little-endian");

  if (vocab_size) {
    for (std::size_t i = 0; i < num_tokens_; ++i) {
      const std::uint32_t id = at(i);
      if (static_cast<std::int64_t>(id) >= *vocab_size) {
        const std::size_t index = i;
        ::munmap(map, bytes_);
        data_ = nullptr;
        usage_fail(detail::concat("token file ", path, ": token ", id, " at index ", index, " (byte offset ",
                                  index * item, ") is out of range for vocab_size ", *vocab_size,
                                  "; was it tokenized with another tokenizer, or is the dtype wrong?"));
      }
    }
  }
}

TokenFile::~TokenFile() {
  if (data_) ::munmap(const_cast<void*>(data_), bytes_);
}

TokenFileDocuments::TokenFileDocuments(const std::string& path, TokenDtype dtype,
                                       std::optional<std::int64_t> eos_token_id, std::int64_t chunk_len,
                                       std::optional<std::int64_t> vocab_size)
    : file_(path, dtype, vocab_size) {
  const std::size_t n = file_.size();
  doc_starts_.push_back(0);
  if (eos_token_id) {
    const std::int64_t eos = *eos_token_id;
    const std::int64_t max_id = dtype == TokenDtype::kUint16 ? 0xFFFF : 0xFFFFFFFFLL;
    if (eos < 0 || eos > max_id || (vocab_size && eos >= *vocab_size)) {
      usage_fail(detail::concat("token file ", path, ": eos_token_id ", eos, " cannot occur in a ",
                                dtype == TokenDtype::kUint16 ? "uint16" : "uint32", " file",
                                vocab_size ? detail::concat(" with vocab_size ", *vocab_size) : std::string()));
    }
    for (std::size_t i = 0; i < n; ++i) {
      if (file_.at(i) == static_cast<std::uint32_t>(eos)) doc_starts_.push_back(i + 1);  // eos ends its doc
    }
    if (doc_starts_.back() != n) doc_starts_.push_back(n);  // trailing tokens without an eos
  } else {
    if (chunk_len <= 0) usage_fail(detail::concat("token file ", path, ": chunk length must be positive"));
    for (std::size_t start = static_cast<std::size_t>(chunk_len); start < n; start += chunk_len) {
      doc_starts_.push_back(start);
    }
    doc_starts_.push_back(n);
  }
}

void TokenFileDocuments::read(std::size_t doc, std::int64_t begin, std::int64_t count, std::int64_t* input_ids,
                              std::int64_t* labels) const {
  const std::size_t start = doc_starts_[doc] + static_cast<std::size_t>(begin);
  for (std::int64_t i = 0; i < count; ++i) {
    input_ids[i] = labels[i] = static_cast<std::int64_t>(file_.at(start + i));
  }
}

}  // namespace eo::data
