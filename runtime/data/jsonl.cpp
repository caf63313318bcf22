#include "runtime/data/jsonl.h"

#include <unistd.h>
#include <algorithm>
#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "common/files.h"
#include "common/json_depth.h"

namespace eo::data {
namespace {

std::vector<std::int64_t> int_array(const nlohmann::json& obj, const char* key, const std::string& where) {
  const auto& v = obj.at(key);
  if (!v.is_array()) throw UsageError(where + ": '" + key + "' must be an array of integers");
  std::vector<std::int64_t> out;
  out.reserve(v.size());
  for (const auto& x : v) {
    if (!x.is_number_integer()) throw UsageError(where + ": '" + key + "' must contain only integers, found " + x.dump());
    // Beyond int64 get<> would wrap (18446744073709551516 would read as the ignore label -100).
    if (x.is_number_unsigned() && x.get<std::uint64_t>() > static_cast<std::uint64_t>(INT64_MAX))
      throw UsageError(where + ": '" + key + "' value " + x.dump() + " is too large for a token id");
    out.push_back(x.get<std::int64_t>());
  }
  return out;
}

// The row without its padding (attention_mask 0 before the first 1 and after the last).
void drop_padding(TokenizedLine& l, const std::string& where) {
  const auto& m = l.attention_mask;
  const auto first = std::find(m.begin(), m.end(), 1);
  if (first == m.end())
    throw UsageError(where + ": 'attention_mask' is all 0: the row is padding only; remove it");
  const std::size_t b = static_cast<std::size_t>(first - m.begin());
  const std::size_t e = m.size() - static_cast<std::size_t>(std::find(m.rbegin(), m.rend(), 1) - m.rbegin());
  if (std::find(m.begin() + b, m.begin() + e, 0) != m.begin() + e)
    throw UsageError(where + ": 'attention_mask' has a 0 between 1s (position " +
                     std::to_string(std::find(m.begin() + b, m.begin() + e, 0) - m.begin()) +
                     "): only padding at the start or end of a row can be masked; eo-ddp trains each row's tokens "
                     "whole. Remove the masked tokens from input_ids (and labels), or set labels -100 to exclude "
                     "them from the loss only");
  if (b == 0 && e == m.size()) return;
  auto cut = [&](std::vector<std::int64_t>& v) { v = std::vector<std::int64_t>(v.begin() + b, v.begin() + e); };
  cut(l.input_ids);
  cut(l.labels);
  cut(l.attention_mask);
}

}  // namespace

std::vector<TokenizedLine> read_tokenized_jsonl(const std::string& path, std::int64_t vocab_size) {
  // A regular file only (no FIFO or device: open_input_file), then read by line.
  if (const int fd = open_input_file(path, "data file"); fd >= 0) ::close(fd);
  std::ifstream in(path);
  if (!in) throw UsageError(path + ": cannot open the data file");
  std::vector<TokenizedLine> out;
  std::string text;
  int lineno = 0;
  while (std::getline(in, text)) {
    ++lineno;
    if (text.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = path + ":" + std::to_string(lineno);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(text, json_depth_limit([&] {
        throw UsageError(where + ": JSON nested deeper than " + std::to_string(kMaxJsonDepth) +
                         " levels; expected {\"input_ids\": [...], ...}");
      }));
    } catch (const nlohmann::json::exception& e) {
      throw UsageError(where + ": invalid JSON (" + e.what() + ")");
    }
    if (!j.is_object()) throw UsageError(where + ": expected one JSON object per line");
    if (!j.contains("input_ids"))
      throw UsageError(where + ": 'input_ids' is missing (expected tokenized rows, as type: tokenized and a dataset "
                               "without a type are read; other rows need their type, e.g. chat_template or alpaca)");
    TokenizedLine l;
    l.line = lineno;
    l.input_ids = int_array(j, "input_ids", where);
    if (l.input_ids.empty()) throw UsageError(where + ": 'input_ids' is empty");
    const std::size_t n = l.input_ids.size();
    l.labels = j.contains("labels") && !j["labels"].is_null() ? int_array(j, "labels", where) : l.input_ids;
    if (l.labels.size() != n)
      throw UsageError(where + ": 'labels' has " + std::to_string(l.labels.size()) + " entries, 'input_ids' " + std::to_string(n));
    if (j.contains("attention_mask") && !j["attention_mask"].is_null()) {
      l.attention_mask = int_array(j, "attention_mask", where);
      if (l.attention_mask.size() != n)
        throw UsageError(where + ": 'attention_mask' has " + std::to_string(l.attention_mask.size()) + " entries, 'input_ids' " +
                         std::to_string(n));
      for (auto m : l.attention_mask)
        if (m != 0 && m != 1) throw UsageError(where + ": 'attention_mask' values must be 0 or 1");
      drop_padding(l, where);
    } else {
      l.attention_mask.assign(n, 1);
    }
    for (std::size_t i = 0; i < l.input_ids.size(); ++i) {  // padding dropped: the row may be shorter than n
      const auto id = l.input_ids[i], lab = l.labels[i];
      if (id < 0 || (vocab_size > 0 && id >= vocab_size))
        throw UsageError(where + ": token id " + std::to_string(id) + " is outside the vocabulary [0, " +
                         std::to_string(vocab_size) + "); was the file tokenized with another model's tokenizer? "
                         "Re-tokenize it with the base model's tokenizer (tools/tokenize_data.py)");
      if (lab != -100 && (lab < 0 || (vocab_size > 0 && lab >= vocab_size)))
        throw UsageError(where + ": label " + std::to_string(lab) + " is neither -100 nor a token id of the vocabulary");
    }
    out.push_back(std::move(l));
  }
  if (lineno == 0 || out.empty())
    throw UsageError(path + ": no examples (the file is empty); fill it with tools/tokenize_data.py or remove it from datasets");
  return out;
}

}  // namespace eo::data
