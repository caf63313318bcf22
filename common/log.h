// Rank-aware logging to stderr. Only rank 0 prints info by default; warnings and errors
// print on every rank, prefixed with the rank when the world has more than one.
#pragma once

#include <string>

namespace eo::log {

void set_rank(int rank, int world_size);
void set_quiet(bool quiet);
void info(const std::string& msg);
void warn(const std::string& msg);
void error(const std::string& msg);
// A progress line that rewrites itself on a terminal and prints plainly otherwise.
void progress(const std::string& msg, bool final_line);
// Whether progress lines rewrite themselves (stderr is a terminal).
bool progress_rewrites();

}  // namespace eo::log
