#include "common/log.h"

#include <unistd.h>

#include <cstdio>
#include <mutex>

namespace eo::log {
namespace {
int g_rank = 0;
int g_world = 1;
bool g_quiet = false;
std::mutex g_mutex;

std::string prefix() { return g_world > 1 ? "[rank " + std::to_string(g_rank) + "] " : ""; }
}  // namespace

void set_rank(int rank, int world_size) {
  g_rank = rank;
  g_world = world_size;
}
void set_quiet(bool quiet) { g_quiet = quiet; }

void info(const std::string& msg) {
  if (g_quiet || g_rank != 0) return;
  std::lock_guard<std::mutex> lock(g_mutex);
  std::fprintf(stderr, "%s\n", msg.c_str());
}
void warn(const std::string& msg) {
  std::lock_guard<std::mutex> lock(g_mutex);
  std::fprintf(stderr, "%swarning: %s\n", prefix().c_str(), msg.c_str());
}
void error(const std::string& msg) {
  std::lock_guard<std::mutex> lock(g_mutex);
  std::fprintf(stderr, "%serror: %s\n", prefix().c_str(), msg.c_str());
}
bool progress_rewrites() {
  static const bool tty = isatty(fileno(stderr));
  return tty;
}

void progress(const std::string& msg, bool final_line) {
  if (g_quiet || g_rank != 0) return;
  std::lock_guard<std::mutex> lock(g_mutex);
  if (progress_rewrites())
    std::fprintf(stderr, "\r\033[K%s%s", msg.c_str(), final_line ? "\n" : "");
  else
    std::fprintf(stderr, "%s\n", msg.c_str());
  std::fflush(stderr);
}

}  // namespace eo::log
