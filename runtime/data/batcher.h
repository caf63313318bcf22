// The batcher: documents -> fixed-shape micro-batches [micro_batch_size, sequence_len], shuffled
// per epoch, sharded across data-parallel ranks, resumable from an exact cursor.
//
// Why one class owns all of this: packing fixes the set of sequences ("rows"), the shuffle orders
// them, the sharding slices that order, and the cursor is a position in it. Keeping the four in
// one place is what makes "resume gives identical batches" and "W ranks see exactly what one rank
// with W x micro_batch_size would see" easy to state and to test.
//
// ---- Sequences (rows) -----------------------------------------------------------------------
// sample_packing = false: one document per row, truncated to sequence_len, right-padded.
// sample_packing = true:  each document is cut into chunks of at most sequence_len tokens (at
//   offsets 0, L, 2L, ...); chunks are placed greedily in document order: a chunk goes into the
//   current row if it fits, otherwise the row is closed (padded) and a new one is started. Each
//   chunk is its own segment. The packing does not depend on the epoch; only the row order does.
// Empty documents are skipped.
//
// ---- Tensors of a micro-batch (all [micro_batch_size, sequence_len], CPU) --------------------
// input_ids    int64  token ids; pad_token_id at padding.
// labels       int64  Hugging Face convention: stored UNSHIFTED, aligned with input_ids; the
//                     model shifts: loss = CE(logits[:, :-1], labels[:, 1:]), i.e. the logits at
//                     position t predict labels[t+1]. kIgnoreIndex (-100) = not predicted.
//                     labels = the document's labels, except -100 at padding and at the FIRST
//                     position of every segment: the logits there-1 belong to the previous
//                     document (or to nothing, at t=0), so no prediction ever crosses a document
//                     boundary. (HF ignores labels[:, 0] anyway; setting it keeps the count below
//                     equal to a plain count of labels != -100.)
// position_ids int64  0, 1, 2, ... restarting at 0 at the start of every segment; 0 at padding.
// segment_ids  int32  1, 2, 3, ... per segment within the row (document ids); 0 = padding.
//                     The model MUST use them: query t may attend key s iff s <= t (causal) and
//                     segment_ids[s] == segment_ids[t]. Padding (0) then attends only padding,
//                     so no softmax row is empty; padding outputs are never used (labels -100).
// num_target_tokens   number of labels[:, 1:] != -100 in this micro-batch (this rank's share);
//                     the trainer sums it over micro-batches and ranks to normalise the loss by
//                     the global token count.
//
// ---- Order, sharding, cursor -----------------------------------------------------------------
// Each epoch visits the rows in a permutation fixed by (seed, epoch) (see epoch_permutation).
// A global micro-batch takes the next G = world_size x micro_batch_size rows of the permutation,
// perm[p, p+G); rank r takes perm[p + r*mb, p + (r+1)*mb). Concatenating the ranks' micro-batches
// in rank order gives exactly the micro-batch of one rank with micro_batch_size x world_size.
// When fewer than G rows are left in an epoch they are dropped for that epoch (they are in other
// places of the next epoch's permutation), so num_batches_per_epoch = floor(rows / G). A dataset
// with fewer than G rows is an error (no wrap-around).
// The cursor is (epoch, position p in the permutation of the next global micro-batch); it is
// independent of world_size, so a run may resume on a different number of ranks.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

namespace eo::data {

inline constexpr std::int64_t kIgnoreIndex = -100;

// One training document: what a tokenized JSONL line converts to. labels has the size of
// input_ids; kIgnoreIndex marks tokens that are not trained on (a JSONL line without labels
// converts with labels = input_ids).
struct Example {
  std::vector<std::int32_t> input_ids;
  std::vector<std::int32_t> labels;
};

// A random-access collection of documents (in memory, memory-mapped file, several datasets).
class DocumentSource {
 public:
  virtual ~DocumentSource() = default;
  virtual std::size_t num_documents() const = 0;
  virtual std::int64_t length(std::size_t doc) const = 0;
  // Copies tokens [begin, begin + count) of document `doc`.
  virtual void read(std::size_t doc, std::int64_t begin, std::int64_t count, std::int64_t* input_ids,
                    std::int64_t* labels) const = 0;
  virtual std::string name() const = 0;  // for error messages: a path or dataset name
};

class InMemoryDocuments : public DocumentSource {
 public:
  // Throws if an example's labels and input_ids differ in length.
  InMemoryDocuments(std::vector<Example> examples, std::string name);
  std::size_t num_documents() const override { return examples_.size(); }
  std::int64_t length(std::size_t doc) const override {
    return static_cast<std::int64_t>(examples_[doc].input_ids.size());
  }
  void read(std::size_t doc, std::int64_t begin, std::int64_t count, std::int64_t* input_ids,
            std::int64_t* labels) const override;
  std::string name() const override { return name_; }

 private:
  std::vector<Example> examples_;
  std::string name_;
};

// Several datasets (the config's `datasets:` list) as one, in order.
class ConcatDocuments : public DocumentSource {
 public:
  explicit ConcatDocuments(std::vector<std::shared_ptr<const DocumentSource>> parts);
  std::size_t num_documents() const override { return starts_.back(); }
  std::int64_t length(std::size_t doc) const override;
  void read(std::size_t doc, std::int64_t begin, std::int64_t count, std::int64_t* input_ids,
            std::int64_t* labels) const override;
  std::string name() const override;

 private:
  std::size_t part_of(std::size_t doc) const;
  std::vector<std::shared_ptr<const DocumentSource>> parts_;
  std::vector<std::size_t> starts_;  // first global doc index of each part, plus the total
};

// Some documents of another source, in the order given (val_set_size's train / eval split).
class SubsetDocuments : public DocumentSource {
 public:
  SubsetDocuments(std::shared_ptr<const DocumentSource> parent, std::vector<std::size_t> docs, std::string name);
  std::size_t num_documents() const override { return docs_.size(); }
  std::int64_t length(std::size_t doc) const override { return parent_->length(docs_[doc]); }
  void read(std::size_t doc, std::int64_t begin, std::int64_t count, std::int64_t* input_ids,
            std::int64_t* labels) const override {
    parent_->read(docs_[doc], begin, count, input_ids, labels);
  }
  std::string name() const override { return name_; }

 private:
  std::shared_ptr<const DocumentSource> parent_;
  std::vector<std::size_t> docs_;
  std::string name_;
};

struct BatcherOptions {
  std::int64_t sequence_len = 2048;
  bool sample_packing = false;
  std::int64_t micro_batch_size = 1;
  std::int64_t seed = 42;
  bool shuffle = true;
  int rank = 0;
  int world_size = 1;
  std::int64_t pad_token_id = 0;  // any id < vocab; padding is never attended or predicted
};

struct MicroBatch {
  at::Tensor input_ids;     // int64 [mb, L]
  at::Tensor labels;        // int64 [mb, L]
  at::Tensor position_ids;  // int64 [mb, L]
  at::Tensor segment_ids;   // int32 [mb, L]
  std::int64_t num_target_tokens = 0;
  std::int64_t epoch = 0;     // the epoch this micro-batch belongs to
  std::int64_t position = 0;  // its global micro-batch's position in the epoch's permutation
};

// The permutation of [0, n) used for `epoch`: Fisher-Yates driven by std::mt19937_64 (whose
// output the C++ standard fixes exactly) seeded with splitmix64(splitmix64(seed) + epoch), and an
// unbiased bounded draw by rejection (draw_below). Identical on every platform.
std::vector<std::size_t> epoch_permutation(std::size_t n, std::int64_t seed, std::int64_t epoch);

class Batcher {
 public:
  // Plans the rows (packing) up front; throws UsageError when the data cannot fill one global
  // micro-batch.
  Batcher(std::shared_ptr<const DocumentSource> documents, BatcherOptions options);

  std::int64_t num_sequences() const { return static_cast<std::int64_t>(row_starts_.size()) - 1; }
  // Global micro-batches per epoch (each rank gets one micro-batch of each).
  std::int64_t num_batches_per_epoch() const;
  // Epochs done once `b`'s global micro-batch is consumed: its epoch + rows consumed in that
  // epoch (all ranks) / rows an epoch uses (num_batches_per_epoch x G; the dropped remainder is
  // not counted), so an epoch ends at exactly 1.0, 2.0, ...
  double epochs_after(const MicroBatch& b) const;

  // This rank's next micro-batch; moves to the next epoch when the current one is exhausted.
  MicroBatch next();

  // Exact, serialisable cursor: {"epoch", "position", "num_sequences", "seed", "shuffle"}.
  // restore() rejects a state from different data, packing or seed (UsageError).
  nlohmann::json state() const;
  void restore(const nlohmann::json& state);

  // Row `row` of the packing plan, unshuffled, as 1-row tensors (for inspection and tests).
  MicroBatch sequence(std::size_t row) const;

 private:
  struct Piece {  // tokens [begin, begin + count) of document `doc`
    std::size_t doc;
    std::int64_t begin, count;
  };
  void plan_rows();
  void check_trainable_tokens() const;
  void fill_row(std::size_t row, std::int64_t* ids, std::int64_t* labels, std::int64_t* positions,
                std::int32_t* segments) const;
  MicroBatch make_batch(const std::vector<std::size_t>& rows) const;

  std::shared_ptr<const DocumentSource> docs_;
  BatcherOptions opt_;
  std::vector<Piece> pieces_;
  std::vector<std::size_t> row_starts_;  // row i = pieces_[row_starts_[i], row_starts_[i + 1])

  // Cursor, and the permutation of its epoch (recomputed on demand).
  std::int64_t epoch_ = 0;
  std::int64_t position_ = 0;
  std::int64_t perm_epoch_ = -1;
  std::vector<std::size_t> perm_;
};

}  // namespace eo::data
