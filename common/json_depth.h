// A nesting limit for JSON read from files (nlohmann::json parse callback).
//
// Why: nlohmann parses iteratively, but dump() (which quotes an offending value in our error
// messages) recurses once per nesting level, so 200 KB of '[' overflows the stack while the
// parser reports an error. No file eo-ddp reads nests more than a few levels (config.json,
// safetensors headers, tokenized JSONL, bitsandbytes quant states), so deeper input is refused
// while parsing, before anything recurses over it.
#pragma once

#include <nlohmann/json.hpp>

namespace eo {

inline constexpr int kMaxJsonDepth = 64;

// A parse callback that calls `fail()` (which must throw, naming the file) when an object or
// array opens deeper than kMaxJsonDepth: json::parse(first, last, json_depth_limit(...)).
template <typename Fail>
nlohmann::json::parser_callback_t json_depth_limit(Fail fail) {
  return [fail](int depth, nlohmann::json::parse_event_t event, nlohmann::json& /*parsed*/) {
    if (depth >= kMaxJsonDepth &&
        (event == nlohmann::json::parse_event_t::object_start || event == nlohmann::json::parse_event_t::array_start))
      fail();
    return true;
  };
}

}  // namespace eo
