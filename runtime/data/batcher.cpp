// Packing, shuffling, sharding and the resumable cursor. Conventions are documented in batcher.h.
#include "runtime/data/batcher.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <random>

#include "common/error.h"

namespace eo::data {

namespace {

std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// Uniform integer in [0, n), n > 0, without bias: reject the low 2^64 mod n raw values so the
// accepted range is a multiple of n. (std::uniform_int_distribution's algorithm is
// implementation-defined, which would make the order differ between standard libraries.)
std::uint64_t draw_below(std::mt19937_64& rng, std::uint64_t n) {
  const std::uint64_t threshold = (0 - n) % n;  // == 2^64 mod n
  for (;;) {
    const std::uint64_t r = rng();
    if (r >= threshold) return r % n;
  }
}

}  // namespace

std::vector<std::size_t> epoch_permutation(std::size_t n, std::int64_t seed, std::int64_t epoch) {
  std::vector<std::size_t> perm(n);
  for (std::size_t i = 0; i < n; ++i) perm[i] = i;
  std::mt19937_64 rng(splitmix64(splitmix64(static_cast<std::uint64_t>(seed)) + static_cast<std::uint64_t>(epoch)));
  for (std::size_t i = n; i > 1; --i) {  // Fisher-Yates: position i-1 gets a uniform pick of [0, i)
    const std::size_t j = static_cast<std::size_t>(draw_below(rng, i));
    std::swap(perm[i - 1], perm[j]);
  }
  return perm;
}

// ---- Document sources --------------------------------------------------------------------------

InMemoryDocuments::InMemoryDocuments(std::vector<Example> examples, std::string name)
    : examples_(std::move(examples)), name_(std::move(name)) {
  for (std::size_t i = 0; i < examples_.size(); ++i) {
    if (examples_[i].labels.size() != examples_[i].input_ids.size()) {
      throw UsageError(detail::concat("dataset ", name_, ": example ", i, " has ", examples_[i].input_ids.size(),
                                      " input_ids but ", examples_[i].labels.size(), " labels"));
    }
  }
}

void InMemoryDocuments::read(std::size_t doc, std::int64_t begin, std::int64_t count, std::int64_t* input_ids,
                             std::int64_t* labels) const {
  const Example& e = examples_[doc];
  for (std::int64_t i = 0; i < count; ++i) {
    input_ids[i] = e.input_ids[begin + i];
    labels[i] = e.labels[begin + i];
  }
}

SubsetDocuments::SubsetDocuments(std::shared_ptr<const DocumentSource> parent, std::vector<std::size_t> docs, std::string name)
    : parent_(std::move(parent)), docs_(std::move(docs)), name_(std::move(name)) {
  for (auto d : docs_) EO_CHECK(d < parent_->num_documents(), "subset: document ", d, " of ", parent_->num_documents());
}

ConcatDocuments::ConcatDocuments(std::vector<std::shared_ptr<const DocumentSource>> parts) : parts_(std::move(parts)) {
  starts_.push_back(0);
  for (const auto& p : parts_) starts_.push_back(starts_.back() + p->num_documents());
}

std::size_t ConcatDocuments::part_of(std::size_t doc) const {
  // Last part whose start is <= doc (parts may be empty, so skip equal starts).
  return static_cast<std::size_t>(std::upper_bound(starts_.begin(), starts_.end(), doc) - starts_.begin()) - 1;
}

std::int64_t ConcatDocuments::length(std::size_t doc) const {
  const std::size_t p = part_of(doc);
  return parts_[p]->length(doc - starts_[p]);
}

void ConcatDocuments::read(std::size_t doc, std::int64_t begin, std::int64_t count, std::int64_t* input_ids,
                           std::int64_t* labels) const {
  const std::size_t p = part_of(doc);
  parts_[p]->read(doc - starts_[p], begin, count, input_ids, labels);
}

std::string ConcatDocuments::name() const {
  std::string s;
  for (const auto& p : parts_) s += (s.empty() ? "" : " + ") + p->name();
  return s;
}

// ---- Batcher -----------------------------------------------------------------------------------

Batcher::Batcher(std::shared_ptr<const DocumentSource> documents, BatcherOptions options)
    : docs_(std::move(documents)), opt_(options) {
  EO_CHECK(docs_ != nullptr, "Batcher: no document source");
  if (opt_.sequence_len < 2) throw UsageError(detail::concat("sequence_len must be >= 2, got ", opt_.sequence_len));
  if (opt_.micro_batch_size < 1) {
    throw UsageError(detail::concat("micro_batch_size must be >= 1, got ", opt_.micro_batch_size));
  }
  EO_CHECK(opt_.world_size >= 1 && opt_.rank >= 0 && opt_.rank < opt_.world_size, "Batcher: rank ", opt_.rank,
           " is not in a world of ", opt_.world_size);
  plan_rows();
  check_trainable_tokens();
  const std::int64_t global = opt_.micro_batch_size * opt_.world_size;
  if (num_sequences() < global) {
    throw UsageError(detail::concat(
        "dataset ", docs_->name(), " has ", num_sequences(), " sequences (sequence_len ", opt_.sequence_len,
        opt_.sample_packing ? ", packed" : "", "); one step needs ", global, " (micro_batch_size ",
        opt_.micro_batch_size, " x ", opt_.world_size,
        " ranks). Add data or lower micro_batch_size / the number of ranks."));
  }
}

void Batcher::plan_rows() {
  const std::int64_t L = opt_.sequence_len;
  row_starts_.assign(1, 0);
  std::int64_t used = 0;  // tokens in the open row (packing)
  for (std::size_t d = 0; d < docs_->num_documents(); ++d) {
    const std::int64_t len = docs_->length(d);
    if (len == 0) continue;
    if (!opt_.sample_packing) {
      pieces_.push_back({d, 0, std::min(len, L)});
      row_starts_.push_back(pieces_.size());
      continue;
    }
    for (std::int64_t begin = 0; begin < len; begin += L) {
      const std::int64_t count = std::min(L, len - begin);
      if (used + count > L) {  // close the open row
        row_starts_.push_back(pieces_.size());
        used = 0;
      }
      pieces_.push_back({d, begin, count});
      used += count;
    }
  }
  if (row_starts_.back() != pieces_.size()) row_starts_.push_back(pieces_.size());
}

// Data with no label to learn (every label -100 after truncation and the first position of each
// sequence) would train at loss 0 and change nothing: refused, naming the data. Stops at the first
// trainable token, so ordinary data costs one row.
void Batcher::check_trainable_tokens() const {
  const std::int64_t L = opt_.sequence_len;
  std::vector<std::int64_t> ids(L), labels(L), positions(L);
  std::vector<std::int32_t> segments(L);
  for (std::size_t r = 0; r + 1 < row_starts_.size(); ++r) {
    fill_row(r, ids.data(), labels.data(), positions.data(), segments.data());
    for (std::int64_t t = 1; t < L; ++t)
      if (labels[t] != kIgnoreIndex) return;
  }
  if (num_sequences() == 0) return;  // "too few sequences" is reported below
  throw UsageError(detail::concat("dataset ", docs_->name(), " has no trainable token: every label is ", kIgnoreIndex,
                                  " (after truncation to sequence_len ", L,
                                  "; a sequence's first token is never a target). Training would report loss 0 and "
                                  "learn nothing; check the labels of the data (tools/tokenize_data.py writes labels for "
                                  "the completion or assistant tokens)."));
}

std::int64_t Batcher::num_batches_per_epoch() const {
  return num_sequences() / (opt_.micro_batch_size * opt_.world_size);
}

double Batcher::epochs_after(const MicroBatch& b) const {
  const std::int64_t global = opt_.micro_batch_size * opt_.world_size;
  return double(b.epoch) + double(b.position + global) / double(std::max<std::int64_t>(1, num_batches_per_epoch() * global));
}

void Batcher::fill_row(std::size_t row, std::int64_t* ids, std::int64_t* labels, std::int64_t* positions,
                       std::int32_t* segments) const {
  const std::int64_t L = opt_.sequence_len;
  std::int64_t t = 0;
  std::int32_t segment = 0;
  for (std::size_t p = row_starts_[row]; p < row_starts_[row + 1]; ++p) {
    const Piece& piece = pieces_[p];
    docs_->read(piece.doc, piece.begin, piece.count, ids + t, labels + t);
    ++segment;
    for (std::int64_t i = 0; i < piece.count; ++i) {
      positions[t + i] = i;
      segments[t + i] = segment;
    }
    labels[t] = kIgnoreIndex;  // its logits' position t-1 belongs to another segment (or none)
    t += piece.count;
  }
  for (; t < L; ++t) {  // right padding
    ids[t] = opt_.pad_token_id;
    labels[t] = kIgnoreIndex;
    positions[t] = 0;
    segments[t] = 0;
  }
}

MicroBatch Batcher::make_batch(const std::vector<std::size_t>& rows) const {
  const std::int64_t n = static_cast<std::int64_t>(rows.size()), L = opt_.sequence_len;
  MicroBatch b;
  b.input_ids = at::empty({n, L}, at::kLong);
  b.labels = at::empty({n, L}, at::kLong);
  b.position_ids = at::empty({n, L}, at::kLong);
  b.segment_ids = at::empty({n, L}, at::kInt);
  std::int64_t* ids = b.input_ids.data_ptr<std::int64_t>();
  std::int64_t* labels = b.labels.data_ptr<std::int64_t>();
  std::int64_t* positions = b.position_ids.data_ptr<std::int64_t>();
  std::int32_t* segments = b.segment_ids.data_ptr<std::int32_t>();
  for (std::int64_t r = 0; r < n; ++r) {
    fill_row(rows[r], ids + r * L, labels + r * L, positions + r * L, segments + r * L);
    for (std::int64_t t = 1; t < L; ++t) b.num_target_tokens += labels[r * L + t] != kIgnoreIndex;
  }
  return b;
}

MicroBatch Batcher::next() {
  const std::int64_t global = opt_.micro_batch_size * opt_.world_size;
  if (position_ + global > num_sequences()) {  // epoch exhausted: the remainder is dropped
    ++epoch_;
    position_ = 0;
  }
  if (perm_epoch_ != epoch_) {
    if (opt_.shuffle) {
      perm_ = epoch_permutation(static_cast<std::size_t>(num_sequences()), opt_.seed, epoch_);
    } else {
      perm_.resize(static_cast<std::size_t>(num_sequences()));
      for (std::size_t i = 0; i < perm_.size(); ++i) perm_[i] = i;
    }
    perm_epoch_ = epoch_;
  }
  std::vector<std::size_t> rows(static_cast<std::size_t>(opt_.micro_batch_size));
  const std::int64_t first = position_ + opt_.rank * opt_.micro_batch_size;
  for (std::size_t i = 0; i < rows.size(); ++i) rows[i] = perm_[static_cast<std::size_t>(first) + i];
  MicroBatch b = make_batch(rows);
  b.epoch = epoch_;
  b.position = position_;
  position_ += global;
  return b;
}

MicroBatch Batcher::sequence(std::size_t row) const {
  EO_CHECK(static_cast<std::int64_t>(row) < num_sequences(), "Batcher::sequence: row ", row, " of ", num_sequences());
  return make_batch({row});
}

nlohmann::json Batcher::state() const {
  return {{"epoch", epoch_},
          {"position", position_},
          {"num_sequences", num_sequences()},
          {"seed", opt_.seed},
          {"shuffle", opt_.shuffle}};
}

void Batcher::restore(const nlohmann::json& state) {
  std::int64_t epoch = 0, position = 0, sequences = 0, seed = 0;
  bool shuffle = true;
  try {
    epoch = state.at("epoch").get<std::int64_t>();
    position = state.at("position").get<std::int64_t>();
    sequences = state.at("num_sequences").get<std::int64_t>();
    seed = state.at("seed").get<std::int64_t>();
    shuffle = state.at("shuffle").get<bool>();
  } catch (const nlohmann::json::exception& e) {
    throw UsageError(detail::concat("data cursor ", state.dump(), " is malformed: ", e.what()));
  }
  if (sequences != num_sequences() || seed != opt_.seed || shuffle != opt_.shuffle) {
    throw UsageError(detail::concat(
        "data cursor ", state.dump(), " was saved for ", sequences, " sequences, seed ", seed, ", shuffle ", shuffle,
        "; this run has ", num_sequences(), " sequences, seed ", opt_.seed, ", shuffle ", opt_.shuffle,
        " (dataset ", docs_->name(), "). Resume with the same datasets, sequence_len, sample_packing and seed."));
  }
  if (epoch < 0 || position < 0 || position > num_sequences()) {
    throw UsageError(detail::concat("data cursor ", state.dump(), " is out of range for ", num_sequences(),
                                    " sequences"));
  }
  epoch_ = epoch;
  position_ = position;
}

}  // namespace eo::data
