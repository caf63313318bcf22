// Strict reader for tokenized JSONL: one JSON object per line,
//   {"input_ids": [int, ...], "labels": [int, ...]?, "attention_mask": [0|1, ...]?}
// labels (same length, -100 = ignore) default to input_ids. Blank lines are skipped; anything
// else malformed — bad JSON, a missing or ill-typed field, a length mismatch, an id outside
// the vocabulary — is a UsageError naming file:line.
//
// attention_mask marks padding, and padding is not part of the document: its positions are
// dropped here, so that nothing attends to them and no loss is taken on them (as transformers
// does for padding with the mask and -100 labels; with RoPE, dropping left padding leaves the
// scores of the rest as they were). Only padding may be masked: a 0 between 1s, or a row all 0,
// is refused.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace eo::data {

struct TokenizedLine {
  std::vector<std::int64_t> input_ids;
  std::vector<std::int64_t> labels;          // same length; -100 = not predicted
  std::vector<std::int64_t> attention_mask;  // same length, all ones (padding dropped)
  int line = 0;                              // 1-based line number in the file
};

// vocab_size > 0 checks every input id (and every label other than -100) is below it.
std::vector<TokenizedLine> read_tokenized_jsonl(const std::string& path, std::int64_t vocab_size = -1);

}  // namespace eo::data
