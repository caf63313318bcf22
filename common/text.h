// Small text helpers: edit distance for "did you mean", byte sizes for humans and configs.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace eo {

std::size_t edit_distance(const std::string& a, const std::string& b);
// The candidate closest to `word`, if it is close enough to be a plausible typo.
std::optional<std::string> closest_match(const std::string& word, const std::vector<std::string>& candidates);
// "1.50 GiB", "340.0 MiB", "12 B".
std::string human_bytes(double bytes);
// Parses "8GiB", "512 MB", "1e9", "123": bytes. nullopt when not a size.
std::optional<std::uint64_t> parse_bytes(const std::string& text);
std::string join(const std::vector<std::string>& parts, const std::string& sep);

}  // namespace eo
