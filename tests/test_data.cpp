// The data pipeline: binary token files and the batcher (packing, labels, shuffling, sharding,
// cursor). Expectations are derived here from the documents themselves (token values encode
// their document and offset), never from the batcher's own output.
#include <gtest/gtest.h>
#include <unistd.h>

#include <ATen/ATen.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <set>

#include "common/error.h"
#include "runtime/data/batcher.h"
#include "runtime/data/jsonl.h"
#include "runtime/data/tokens.h"
#include "tests/test_paths.h"

using namespace eo::data;
namespace fs = std::filesystem;

namespace {

constexpr std::int64_t kIgnore = -100;

// Document d's token i has id 1000 * (d + 1) + i, so every token says where it came from.
std::int32_t token_of(std::size_t doc, std::size_t i) { return static_cast<std::int32_t>(1000 * (doc + 1) + i); }
std::size_t doc_of(std::int64_t id) { return static_cast<std::size_t>(id / 1000 - 1); }
std::int64_t offset_of(std::int64_t id) { return id % 1000; }

std::shared_ptr<const DocumentSource> make_docs(const std::vector<int>& lengths) {
  std::vector<Example> ex;
  for (std::size_t d = 0; d < lengths.size(); ++d) {
    Example e;
    for (int i = 0; i < lengths[d]; ++i) e.input_ids.push_back(token_of(d, i));
    e.labels = e.input_ids;
    ex.push_back(std::move(e));
  }
  return std::make_shared<InMemoryDocuments>(std::move(ex), "in-memory");
}

std::vector<std::int64_t> row_of(const at::Tensor& t, std::int64_t r) {
  const at::Tensor row = t[r].to(at::kLong).contiguous();
  const std::int64_t* p = row.data_ptr<std::int64_t>();
  return std::vector<std::int64_t>(p, p + row.numel());
}

void expect_throw_with(const std::function<void()>& fn, const std::vector<std::string>& needles) {
  try {
    fn();
    ADD_FAILURE() << "expected an exception containing '" << needles.front() << "'";
  } catch (const eo::UsageError& e) {
    for (const auto& n : needles) EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what() << "\n  lacks: " << n;
  }
}

fs::path temp_dir() {
  fs::path dir = fs::path(EO_BINARY_DIR) / "tests" / "data_tmp";
  fs::create_directories(dir);
  return dir;
}

template <typename T>
std::string write_tokens(const std::string& name, const std::vector<T>& tokens) {
  const std::string path = (temp_dir() / name).string();
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(tokens.data()), static_cast<std::streamsize>(tokens.size() * sizeof(T)));
  return path;
}

std::string write_bytes(const std::string& name, const std::string& bytes) {
  const std::string path = (temp_dir() / name).string();
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << bytes;
  return path;
}

// The row ids (first token's document) of every micro-batch row, in order.
std::vector<std::size_t> docs_in(const MicroBatch& b) {
  std::vector<std::size_t> out;
  for (std::int64_t r = 0; r < b.input_ids.size(0); ++r) out.push_back(doc_of(b.input_ids[r][0].item<std::int64_t>()));
  return out;
}

bool same_batch(const MicroBatch& a, const MicroBatch& b) {
  return at::equal(a.input_ids, b.input_ids) && at::equal(a.labels, b.labels) &&
         at::equal(a.position_ids, b.position_ids) && at::equal(a.segment_ids, b.segment_ids) &&
         a.num_target_tokens == b.num_target_tokens;
}

}  // namespace

// Packed rows: every prediction HF's shift makes (logits[t] -> labels[t+1]) stays inside one
// document and targets that document's next token; positions restart; padding is inert; every
// token of every document is placed exactly once; the target count is sum(chunk_len - 1).
TEST(Data, PackingNeverPredictsAcrossDocuments) {
  const std::int64_t L = 8;
  const std::vector<int> lengths = {5, 3, 12, 1, 7, 20, 2, 9, 8, 4};
  BatcherOptions opt;
  opt.sequence_len = L;
  opt.sample_packing = true;
  opt.shuffle = false;
  opt.pad_token_id = 7;
  Batcher batcher(make_docs(lengths), opt);

  std::multiset<std::int64_t> placed;
  std::int64_t targets = 0, previous_row_free = -1;
  for (std::int64_t row = 0; row < batcher.num_sequences(); ++row) {
    const MicroBatch b = batcher.sequence(static_cast<std::size_t>(row));
    ASSERT_EQ(b.input_ids.sizes(), (at::IntArrayRef{1, L}));
    ASSERT_EQ(b.segment_ids.scalar_type(), at::kInt);
    const auto ids = row_of(b.input_ids, 0), labels = row_of(b.labels, 0), pos = row_of(b.position_ids, 0),
               seg = row_of(b.segment_ids, 0);
    std::int64_t row_targets = 0, used = 0;
    for (std::int64_t t = 0; t < L; ++t) {
      if (seg[t] == 0) {  // padding: only at the end, never predicted, position 0
        EXPECT_EQ(ids[t], 7);
        EXPECT_EQ(labels[t], kIgnore);
        EXPECT_EQ(pos[t], 0);
        continue;
      }
      EXPECT_EQ(used, t) << "padding in the middle of row " << row;
      ++used;
      placed.insert(ids[t]);
      const bool starts_segment = t == 0 || seg[t] != seg[t - 1];
      if (starts_segment) EXPECT_EQ(seg[t], t == 0 ? 1 : seg[t - 1] + 1);
      // Position restarts at 0 on each segment (documents are chunked every L tokens).
      EXPECT_EQ(pos[t], starts_segment ? 0 : pos[t - 1] + 1);
      EXPECT_EQ(pos[t], offset_of(ids[t]) % L);
    }
    for (std::int64_t t = 0; t + 1 < L; ++t) {  // the prediction of logits[t]
      if (labels[t + 1] == kIgnore) continue;
      ++row_targets;
      EXPECT_NE(seg[t], 0);
      EXPECT_EQ(seg[t], seg[t + 1]) << "row " << row << ": logits at " << t << " predict across a boundary";
      EXPECT_EQ(doc_of(ids[t]), doc_of(labels[t + 1]));
      EXPECT_EQ(labels[t + 1], ids[t] + 1);  // the same document's next token
    }
    EXPECT_EQ(b.num_target_tokens, row_targets);
    targets += row_targets;
    // Greedy: this row's first chunk did not fit in the previous row's free space.
    std::int64_t first_chunk = 0;
    while (first_chunk < L && seg[first_chunk] == 1) ++first_chunk;
    if (previous_row_free >= 0) EXPECT_GT(first_chunk, previous_row_free);
    previous_row_free = L - used;
  }
  std::multiset<std::int64_t> expected;
  std::int64_t expected_targets = 0;
  for (std::size_t d = 0; d < lengths.size(); ++d) {
    for (int i = 0; i < lengths[d]; ++i) expected.insert(token_of(d, i));
    for (int begin = 0; begin < lengths[d]; begin += L) expected_targets += std::min<int>(L, lengths[d] - begin) - 1;
  }
  EXPECT_EQ(placed, expected);
  EXPECT_EQ(targets, expected_targets);
}

// A document's own ignored labels (a prompt) stay ignored after packing.
TEST(Data, PackingKeepsDocumentLabels) {
  std::vector<Example> ex(2);
  ex[0].input_ids = {11, 12, 13, 14};
  ex[0].labels = {-100, -100, 13, 14};
  ex[1].input_ids = {21, 22, 23};
  ex[1].labels = {-100, 22, 23};
  BatcherOptions opt;
  opt.sequence_len = 8;
  opt.sample_packing = true;
  Batcher batcher(std::make_shared<InMemoryDocuments>(ex, "prompts"), opt);
  ASSERT_EQ(batcher.num_sequences(), 1);
  const MicroBatch b = batcher.next();
  EXPECT_EQ(row_of(b.input_ids, 0), (std::vector<std::int64_t>{11, 12, 13, 14, 21, 22, 23, 0}));
  EXPECT_EQ(row_of(b.labels, 0), (std::vector<std::int64_t>{-100, -100, 13, 14, -100, 22, 23, -100}));
  EXPECT_EQ(row_of(b.position_ids, 0), (std::vector<std::int64_t>{0, 1, 2, 3, 0, 1, 2, 0}));
  EXPECT_EQ(row_of(b.segment_ids, 0), (std::vector<std::int64_t>{1, 1, 1, 1, 2, 2, 2, 0}));
  EXPECT_EQ(b.num_target_tokens, 4);
  // Mismatched lengths are rejected.
  ex[1].labels.pop_back();
  expect_throw_with([&] { InMemoryDocuments bad(ex, "bad.jsonl"); }, {"bad.jsonl", "example 1", "3 input_ids but 2 labels"});
}

TEST(Data, NoPackingTruncatesAndRightPads) {
  BatcherOptions opt;
  opt.sequence_len = 8;
  opt.shuffle = false;
  Batcher batcher(make_docs({5, 12, 8, 0}), opt);
  ASSERT_EQ(batcher.num_sequences(), 3);  // the empty document is skipped
  const std::vector<int> kept = {5, 8, 8};
  for (std::size_t d = 0; d < kept.size(); ++d) {
    const MicroBatch b = batcher.next();
    const auto ids = row_of(b.input_ids, 0), labels = row_of(b.labels, 0), pos = row_of(b.position_ids, 0),
               seg = row_of(b.segment_ids, 0);
    for (int t = 0; t < 8; ++t) {
      const bool real = t < kept[d];
      EXPECT_EQ(ids[t], real ? token_of(d, t) : 0);
      EXPECT_EQ(labels[t], real && t > 0 ? token_of(d, t) : kIgnore);
      EXPECT_EQ(pos[t], real ? t : 0);
      EXPECT_EQ(seg[t], real ? 1 : 0);
    }
    EXPECT_EQ(b.num_target_tokens, kept[d] - 1);
  }
}

// std::mt19937_64 is fully specified by the standard: its 10000th output is fixed. This is the
// property that makes the shuffle identical on every platform.
TEST(Data, ShuffleGeneratorIsTheStandardOne) {
  std::mt19937_64 rng;
  rng.discard(9999);
  EXPECT_EQ(rng(), 9981545732273789042ULL);
}

TEST(Data, ShuffleIsADeterministicPermutationPerEpoch) {
  const std::size_t n = 37;
  BatcherOptions opt;
  opt.sequence_len = 4;
  auto docs = make_docs(std::vector<int>(n, 3));
  auto epoch_order = [&](std::int64_t seed, int epochs) {
    BatcherOptions o = opt;
    o.seed = seed;
    Batcher b(docs, o);
    EXPECT_EQ(b.num_batches_per_epoch(), static_cast<std::int64_t>(n));
    std::vector<std::vector<std::size_t>> orders(epochs);
    for (int e = 0; e < epochs; ++e) {
      for (std::size_t i = 0; i < n; ++i) {
        const MicroBatch mb = b.next();
        EXPECT_EQ(mb.epoch, e);
        orders[e].push_back(docs_in(mb)[0]);
      }
    }
    return orders;
  };
  const auto a = epoch_order(42, 2), again = epoch_order(42, 2), other_seed = epoch_order(43, 1);
  std::vector<std::size_t> sorted = a[0];
  std::sort(sorted.begin(), sorted.end());
  for (std::size_t i = 0; i < n; ++i) EXPECT_EQ(sorted[i], i);  // a permutation of all rows
  std::vector<std::size_t> identity(n);
  for (std::size_t i = 0; i < n; ++i) identity[i] = i;
  EXPECT_NE(a[0], identity);
  EXPECT_EQ(a, again);            // deterministic per (seed, epoch)
  EXPECT_NE(a[0], a[1]);          // differs across epochs
  EXPECT_NE(a[0], other_seed[0]); // and across seeds
  EXPECT_EQ(a[1], epoch_permutation(n, 42, 1));
}

// W ranks x mb rows == one rank with W*mb rows, micro-batch by micro-batch, across epochs;
// the ranks' slices are disjoint and an epoch never repeats a row.
TEST(Data, RankShardsAreDisjointAndConcatenateToOneRank) {
  const int W = 3;
  const std::int64_t mb = 2;
  std::vector<int> lengths;
  for (int d = 0; d < 50; ++d) lengths.push_back(1 + (d * 7) % 13);
  auto docs = make_docs(lengths);
  BatcherOptions opt;
  opt.sequence_len = 6;
  opt.sample_packing = true;
  opt.seed = 7;
  opt.micro_batch_size = mb * W;
  Batcher single(docs, opt);
  std::vector<std::unique_ptr<Batcher>> ranks;
  for (int r = 0; r < W; ++r) {
    BatcherOptions o = opt;
    o.micro_batch_size = mb;
    o.rank = r;
    o.world_size = W;
    ranks.push_back(std::make_unique<Batcher>(docs, o));
    EXPECT_EQ(ranks.back()->num_batches_per_epoch(), single.num_batches_per_epoch());
  }
  EXPECT_EQ(single.num_batches_per_epoch(), single.num_sequences() / (mb * W));
  std::set<std::vector<std::int64_t>> seen_this_epoch;
  for (std::int64_t step = 0; step < 2 * single.num_batches_per_epoch() + 1; ++step) {
    const MicroBatch want = single.next();
    if (want.position == 0) seen_this_epoch.clear();
    std::vector<MicroBatch> got;
    for (auto& r : ranks) got.push_back(r->next());
    std::vector<at::Tensor> ids, labels, pos, seg;
    std::int64_t targets = 0;
    for (const auto& g : got) {
      ids.push_back(g.input_ids);
      labels.push_back(g.labels);
      pos.push_back(g.position_ids);
      seg.push_back(g.segment_ids);
      targets += g.num_target_tokens;
      EXPECT_EQ(g.epoch, want.epoch);
      for (std::int64_t r = 0; r < mb; ++r) {
        EXPECT_TRUE(seen_this_epoch.insert(row_of(g.input_ids, r)).second) << "row repeated within an epoch";
      }
    }
    EXPECT_TRUE(at::equal(at::cat(ids), want.input_ids)) << "step " << step;
    EXPECT_TRUE(at::equal(at::cat(labels), want.labels));
    EXPECT_TRUE(at::equal(at::cat(pos), want.position_ids));
    EXPECT_TRUE(at::equal(at::cat(seg), want.segment_ids));
    EXPECT_EQ(targets, want.num_target_tokens);
  }
}

TEST(Data, CursorResumesIdenticallyMidEpochAndAcrossEpochs) {
  auto docs = make_docs({3, 9, 4, 4, 2, 7, 1, 5, 6, 8, 2, 3, 3, 10, 4, 4});
  BatcherOptions opt;
  opt.sequence_len = 5;
  opt.sample_packing = true;
  opt.micro_batch_size = 2;
  Batcher reference(docs, opt);
  const std::int64_t per_epoch = reference.num_batches_per_epoch();
  ASSERT_GE(per_epoch, 3);
  std::vector<MicroBatch> stream;
  for (std::int64_t i = 0; i < 3 * per_epoch; ++i) stream.push_back(reference.next());
  // Save after k batches: mid-epoch, exactly at the epoch's end, and in the second epoch.
  for (std::int64_t k : {std::int64_t{1}, per_epoch - 1, per_epoch, per_epoch + 2}) {
    Batcher first(docs, opt);
    for (std::int64_t i = 0; i < k; ++i) first.next();
    const std::string saved = first.state().dump();  // what a checkpoint stores
    Batcher resumed(docs, opt);
    resumed.restore(nlohmann::json::parse(saved));
    for (std::int64_t i = k; i < static_cast<std::int64_t>(stream.size()); ++i) {
      const MicroBatch b = resumed.next();
      EXPECT_TRUE(same_batch(b, stream[i])) << "resumed after " << k << ", batch " << i;
      EXPECT_EQ(b.epoch, stream[i].epoch);
    }
  }
  // A cursor from other data or another seed is refused.
  BatcherOptions other = opt;
  other.seed = 1;
  Batcher wrong_seed(docs, other);
  expect_throw_with([&] { wrong_seed.restore(reference.state()); }, {"seed 42", "seed 1"});
  Batcher wrong_data(make_docs({5, 5, 5, 5}), opt);
  expect_throw_with([&] { wrong_data.restore(reference.state()); }, {"sequences", "same datasets"});
  expect_throw_with([&] { wrong_data.restore(nlohmann::json{{"epoch", 1}}); }, {"malformed"});
}

TEST(Data, TooSmallDatasetIsAClearError) {
  BatcherOptions opt;
  opt.sequence_len = 8;
  opt.micro_batch_size = 2;
  opt.world_size = 2;
  std::vector<Example> ex(3, Example{{1, 2}, {1, 2}});
  auto docs = std::make_shared<InMemoryDocuments>(ex, "tiny.jsonl");
  expect_throw_with([&] { Batcher b(docs, opt); }, {"dataset tiny.jsonl has 3 sequences", "one step needs 4"});
}

TEST(Data, TokenFileSplitsAtEosKeepingIt) {
  // uint16, eos = 0: documents end after each 0; a trailing run without eos is a document.
  const std::string path = write_tokens<std::uint16_t>("eos16.bin", {5, 1, 7, 0, 3, 0, 0, 60000, 9});
  TokenFileDocuments docs(path, parse_token_dtype("uint16", path), 0, /*chunk_len=*/4, /*vocab=*/65536);
  const std::vector<std::vector<std::int64_t>> want = {{5, 1, 7, 0}, {3, 0}, {0}, {60000, 9}};
  ASSERT_EQ(docs.num_documents(), want.size());
  for (std::size_t d = 0; d < want.size(); ++d) {
    ASSERT_EQ(docs.length(d), static_cast<std::int64_t>(want[d].size()));
    std::vector<std::int64_t> ids(want[d].size()), labels(want[d].size());
    docs.read(d, 0, docs.length(d), ids.data(), labels.data());
    EXPECT_EQ(ids, want[d]);
    EXPECT_EQ(labels, want[d]);
  }
  // Through the batcher (packed): [5 1 7 0 | 3 0] [0 | 60000 9].
  BatcherOptions opt;
  opt.sequence_len = 6;
  opt.sample_packing = true;
  opt.shuffle = false;
  Batcher b(std::make_shared<TokenFileDocuments>(path, TokenDtype::kUint16, 0, 4, 65536), opt);
  ASSERT_EQ(b.num_sequences(), 2);
  const MicroBatch r0 = b.sequence(0), r1 = b.sequence(1);
  EXPECT_EQ(row_of(r0.input_ids, 0), (std::vector<std::int64_t>{5, 1, 7, 0, 3, 0}));
  EXPECT_EQ(row_of(r0.labels, 0), (std::vector<std::int64_t>{-100, 1, 7, 0, -100, 0}));
  EXPECT_EQ(row_of(r1.input_ids, 0), (std::vector<std::int64_t>{0, 60000, 9, 0, 0, 0}));
  EXPECT_EQ(row_of(r1.segment_ids, 0), (std::vector<std::int64_t>{1, 2, 2, 0, 0, 0}));
}

TEST(Data, TokenFileWithoutEosIsChunkedStream) {
  const std::vector<std::uint32_t> tokens = {70000, 1, 2, 3, 4, 5, 6, 7, 123456};
  const std::string path = write_tokens("stream32.bin", tokens);
  TokenFileDocuments docs(path, parse_token_dtype("uint32", path), std::nullopt, /*chunk_len=*/4);
  ASSERT_EQ(docs.num_documents(), 3u);
  std::vector<std::int64_t> all;
  for (std::size_t d = 0; d < 3; ++d) {
    EXPECT_EQ(docs.length(d), d < 2 ? 4 : 1);
    std::vector<std::int64_t> ids(docs.length(d)), labels(docs.length(d));
    docs.read(d, 0, docs.length(d), ids.data(), labels.data());
    EXPECT_EQ(ids, labels);
    all.insert(all.end(), ids.begin(), ids.end());
  }
  EXPECT_EQ(all, std::vector<std::int64_t>(tokens.begin(), tokens.end()));
}

TEST(Data, MalformedTokenFilesGivePreciseErrors) {
  const std::string odd = write_bytes("odd.bin", std::string("\x01\x00\x02", 3));
  expect_throw_with([&] { TokenFile f(odd, TokenDtype::kUint16); }, {odd, "3 bytes", "multiple of 2"});
  const std::string odd32 = write_bytes("odd32.bin", std::string(6, '\0'));
  expect_throw_with([&] { TokenFile f(odd32, TokenDtype::kUint32); }, {odd32, "6 bytes", "multiple of 4"});
  const std::string empty = write_bytes("empty.bin", "");
  expect_throw_with([&] { TokenFile f(empty, TokenDtype::kUint16); }, {empty, "is empty"});
  const std::string big = write_tokens<std::uint16_t>("big.bin", {1, 2, 300, 4});
  expect_throw_with([&] { TokenFile f(big, TokenDtype::kUint16, 256); },
                    {big, "token 300 at index 2 (byte offset 4)", "vocab_size 256"});
  EXPECT_NO_THROW({ TokenFile f(big, TokenDtype::kUint16, 301); });
  const std::string missing = (temp_dir() / "does-not-exist.bin").string();
  expect_throw_with([&] { TokenFile f(missing, TokenDtype::kUint16); }, {missing, "cannot open"});
  expect_throw_with([&] { parse_token_dtype("int8", "data/x.bin"); }, {"data/x.bin", "int8", "uint16 or uint32"});
  expect_throw_with([&] { TokenFileDocuments d(big, TokenDtype::kUint16, 70000, 4); }, {big, "eos_token_id 70000"});
}

TEST(Data, ConcatenatedDatasetsKeepOrderAndNames) {
  auto a = make_docs({2, 3});
  auto b = std::make_shared<InMemoryDocuments>(std::vector<Example>{Example{{7, 8, 9}, {7, 8, 9}}}, "b.jsonl");
  auto empty = std::make_shared<InMemoryDocuments>(std::vector<Example>{}, "empty.jsonl");
  ConcatDocuments all({a, empty, b});
  ASSERT_EQ(all.num_documents(), 3u);
  EXPECT_EQ(all.length(2), 3);
  std::vector<std::int64_t> ids(3), labels(3);
  all.read(2, 0, 3, ids.data(), labels.data());
  EXPECT_EQ(ids, (std::vector<std::int64_t>{7, 8, 9}));
  all.read(1, 1, 2, ids.data(), labels.data());
  EXPECT_EQ(ids[0], token_of(1, 1));
  EXPECT_EQ(all.name(), "in-memory + empty.jsonl + b.jsonl");
}

// val_set_size's split (issue #16): a subset reads its documents from the parent, in the order given.
TEST(Data, SubsetReadsTheChosenDocuments) {
  auto docs = make_docs({2, 3, 4, 5});
  SubsetDocuments sub(docs, {3, 1}, "held out");
  ASSERT_EQ(sub.num_documents(), 2u);
  EXPECT_EQ(sub.length(0), 5);
  EXPECT_EQ(sub.length(1), 3);
  std::vector<std::int64_t> ids(3), labels(3), want(3), want_labels(3);
  sub.read(1, 0, 3, ids.data(), labels.data());
  docs->read(1, 0, 3, want.data(), want_labels.data());
  EXPECT_EQ(ids, want);
  EXPECT_EQ(labels, want_labels);
  EXPECT_EQ(sub.name(), "held out");
  EXPECT_THROW(SubsetDocuments(docs, {4}, "past the end"), eo::Error);
}

// Issue #15 item 12: data with no trainable token (every label -100) is refused, naming the data,
// instead of training at loss 0. One trainable label anywhere is enough.
TEST(Data, DataWithoutATrainableTokenIsRefused) {
  std::vector<Example> ex(3);
  for (auto& e : ex) {
    e.input_ids = {1, 2, 3, 4};
    e.labels = {-100, -100, -100, -100};
  }
  BatcherOptions opt;
  opt.sequence_len = 8;
  expect_throw_with([&] { Batcher b(std::make_shared<InMemoryDocuments>(ex, "prompts-only.jsonl"), opt); },
                    {"prompts-only.jsonl", "no trainable token", "-100"});
  // A label only at a sequence's first position is no target either (nothing predicts it).
  ex[2].labels[0] = 1;
  expect_throw_with([&] { Batcher b(std::make_shared<InMemoryDocuments>(ex, "first-only.jsonl"), opt); },
                    {"first-only.jsonl", "no trainable token"});
  ex[2].labels[3] = 4;
  EXPECT_NO_THROW(Batcher(std::make_shared<InMemoryDocuments>(ex, "ok.jsonl"), opt));
}

// Issue #49 item 4: attention_mask in tokenized rows is honoured: padding (0s before the first 1
// or after the last) is dropped with its labels, so nothing attends to it and no loss is taken
// on it; a 0 between 1s, which is no padding, and an all-0 row are refused naming file:line.
TEST(Data, AttentionMaskPaddingIsDroppedAndOtherMasksRefused) {
  const fs::path dir = fs::temp_directory_path() / ("eo_mask_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const fs::path f = dir / "rows.jsonl";
  std::ofstream(f) << R"({"input_ids": [5, 6, 7, 0, 0], "labels": [5, 6, 7, 0, 0], "attention_mask": [1, 1, 1, 0, 0]})" "\n"
                   << R"({"input_ids": [0, 0, 8, 9], "attention_mask": [0, 0, 1, 1]})" "\n"
                   << R"({"input_ids": [1, 2], "attention_mask": [1, 1]})" "\n";
  const auto rows = read_tokenized_jsonl(f.string(), /*vocab_size=*/10);  // the vocabulary check sees the cut rows
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows[0].input_ids, (std::vector<std::int64_t>{5, 6, 7}));
  EXPECT_EQ(rows[0].labels, (std::vector<std::int64_t>{5, 6, 7}));
  EXPECT_EQ(rows[1].input_ids, (std::vector<std::int64_t>{8, 9}));
  EXPECT_EQ(rows[1].labels, (std::vector<std::int64_t>{8, 9}));
  EXPECT_EQ(rows[2].input_ids, (std::vector<std::int64_t>{1, 2}));
  std::ofstream(f, std::ios::trunc) << R"({"input_ids": [1, 2, 3], "attention_mask": [1, 0, 1]})" "\n";
  expect_throw_with([&] { read_tokenized_jsonl(f.string()); }, {"rows.jsonl:1", "a 0 between 1s"});
  std::ofstream(f, std::ios::trunc) << R"({"input_ids": [1, 2], "attention_mask": [0, 0]})" "\n";
  expect_throw_with([&] { read_tokenized_jsonl(f.string()); }, {"rows.jsonl:1", "all 0"});
  fs::remove_all(dir);
}
