// libFuzzer: a tokenized JSONL file through eo::data::read_tokenized_jsonl, without and with a
// vocabulary bound. Every id and label read must equal the number written in the file at the same
// position once the row's padding (attention_mask 0 at its start and end) is dropped, compared
// exactly, so a huge unsigned value that wrapped to -100 is caught.
#include <nlohmann/json.hpp>

#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "common/error.h"
#include "fuzz/fuzz_common.h"
#include "runtime/data/jsonl.h"

namespace {

// Exact comparison (nlohmann's == casts unsigned to signed, so 2^64 - 100 == -100 there).
bool same_number(const nlohmann::json& v, std::int64_t x) {
  if (v.is_number_unsigned()) return x >= 0 && v.get<std::uint64_t>() == static_cast<std::uint64_t>(x);
  return v.is_number_integer() && v.get<std::int64_t>() == x;
}

void check(const std::string& path, const std::vector<std::string>& text, std::int64_t vocab) {
  try {
    const auto lines = eo::data::read_tokenized_jsonl(path, vocab);
    EO_FUZZ_ASSERT(!lines.empty());
    for (const auto& l : lines) {
      EO_FUZZ_ASSERT(!l.input_ids.empty() && l.line > 0 && static_cast<std::size_t>(l.line) <= text.size());
      const auto j = nlohmann::json::parse(text[l.line - 1], nullptr, false);
      EO_FUZZ_ASSERT(j.is_object());
      // The reader keeps the span from the mask's first 1 to its last; nothing masked inside it.
      std::size_t first = 0, kept = j["input_ids"].size();
      if (j.contains("attention_mask") && !j["attention_mask"].is_null()) {
        const auto& m = j["attention_mask"];
        while (first < m.size() && same_number(m[first], 0)) ++first;
        std::size_t end = m.size();
        while (end > first && same_number(m[end - 1], 0)) --end;
        kept = end - first;
        for (std::size_t i = first; i < end; ++i) EO_FUZZ_ASSERT(same_number(m[i], 1));
      }
      EO_FUZZ_ASSERT(l.input_ids.size() == kept);
      for (std::size_t i = 0; i < l.input_ids.size(); ++i)
        EO_FUZZ_ASSERT(same_number(j["input_ids"][first + i], l.input_ids[i]));
      if (j.contains("labels") && !j["labels"].is_null())
        for (std::size_t i = 0; i < l.labels.size(); ++i) EO_FUZZ_ASSERT(same_number(j["labels"][first + i], l.labels[i]));
      else
        EO_FUZZ_ASSERT(l.labels == l.input_ids);
      EO_FUZZ_ASSERT(l.labels.size() == l.input_ids.size() && l.attention_mask.size() == l.input_ids.size());
      for (std::size_t i = 0; i < l.input_ids.size(); ++i) {
        EO_FUZZ_ASSERT(l.input_ids[i] >= 0 && (vocab <= 0 || l.input_ids[i] < vocab));
        EO_FUZZ_ASSERT(l.labels[i] == -100 || (l.labels[i] >= 0 && (vocab <= 0 || l.labels[i] < vocab)));
        EO_FUZZ_ASSERT(l.attention_mask[i] == 1);
      }
    }
  } catch (const eo::Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const std::string path = eo::fuzz::scratch_dir() + "/train.jsonl";
  eo::fuzz::write_file(path, data, size);
  std::vector<std::string> text;  // the file's lines, split as std::getline does
  std::istringstream in(std::string(reinterpret_cast<const char*>(data), size));
  for (std::string line; std::getline(in, line);) text.push_back(line);
  check(path, text, -1);
  check(path, text, 100);
  return 0;
}
