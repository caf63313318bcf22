#include "runtime/model_identity.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <map>
#include <mutex>
#include <vector>

#include "common/checksum.h"
#include "common/error.h"
#include "common/files.h"
#include "common/log.h"
#include "runtime/config.h"

namespace eo {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

std::string hex64(std::uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

fs::path cache_dir() {
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) return fs::path(x) / "eo-ddp";
  if (const char* h = std::getenv("HOME"); h && *h) return fs::path(h) / ".cache" / "eo-ddp";
  return {};
}

// What must be unchanged for a cached hash to stand for the file.
json stamp(const struct stat& st) {
  return {{"size", static_cast<std::int64_t>(st.st_size)},
          {"mtime_ns", static_cast<std::int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec},
          {"ctime_ns", static_cast<std::int64_t>(st.st_ctim.tv_sec) * 1000000000 + st.st_ctim.tv_nsec},
          {"inode", static_cast<std::uint64_t>(st.st_ino)},
          {"device", static_cast<std::uint64_t>(st.st_dev)}};
}

// A file changed within the file system's timestamp tick of its last stamp could change again
// with the same stamp ("racy" as git calls it): such a hash is used but not kept.
bool settled(const struct stat& st) {
  struct timespec now {};
  ::clock_gettime(CLOCK_REALTIME, &now);
  const double age = double(now.tv_sec - st.st_ctim.tv_sec) + 1e-9 * double(now.tv_nsec - st.st_ctim.tv_nsec);
  return age > 0.1;
}

std::string hash_now(const std::string& path) {
  std::uint64_t h = 0, bytes = 0;
  if (!hash_file(path, h, bytes)) EO_FAIL("cannot read ", path, " to hash it: ", std::strerror(errno));
  return hex64(h);
}

}  // namespace

std::string file_content_hash(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) EO_FAIL("cannot read ", path, " to hash it: ", std::strerror(errno));
  std::error_code ec;
  const std::string real = fs::canonical(path, ec).string();
  const std::string key = ec ? path : real;
  const json want = stamp(st);
  static std::mutex mu;
  static std::map<std::string, std::pair<json, std::string>> memo;
  std::lock_guard<std::mutex> lk(mu);
  if (auto it = memo.find(key); it != memo.end() && it->second.first == want) return it->second.second;

  const fs::path dir = cache_dir();
  int lock = -1;
  if (!dir.empty()) {
    fs::create_directories(dir, ec);
    lock = ::open((dir / "file-hashes.lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  }
  std::string hash;
  if (!settled(st)) {
    if (lock >= 0) ::close(lock);
    return hash_now(path);
  }
  if (lock < 0 || ::flock(lock, LOCK_EX) != 0) {
    static bool warned = false;
    if (!warned) log::warn("cannot use the hash cache in " + dir.string() + " (" + std::strerror(errno) +
                           "): the base model's files are hashed at every start");
    warned = true;
    hash = hash_now(path);
  } else {
    // Under the lock: another rank of this node may have just hashed it.
    const std::string file = (dir / "file-hashes.json").string();
    json cache = json::object();
    std::string text;
    if (read_file_nofollow(file, text)) {
      try {
        cache = json::parse(text);
      } catch (const std::exception&) {
      }
      if (!cache.is_object()) cache = json::object();
    }
    if (cache.contains(key) && cache[key].is_object() && cache[key].contains("hash") && cache[key]["hash"].is_string()) {
      json entry = cache[key];
      entry.erase("hash");
      if (entry == want) hash = cache[key]["hash"].get<std::string>();
    }
    if (hash.empty()) {
      log::info("hashing " + path + " (" + std::to_string(st.st_size) + " bytes; once, cached in " + file + ")");
      hash = hash_now(path);
      json entry = want;
      entry["hash"] = hash;
      cache[key] = entry;
      for (auto it = cache.begin(); it != cache.end();) {  // files that are gone
        struct stat gone {};
        if (::stat(it.key().c_str(), &gone) != 0)
          it = cache.erase(it);
        else
          ++it;
      }
      try {
        write_file_atomic(file, cache.dump(1) + "\n");
      } catch (const std::exception& e) {
        log::warn(std::string("cannot update the hash cache: ") + e.what());
      }
    }
    ::close(lock);  // releases the flock
  }
  memo[key] = {want, hash};
  return hash;
}

std::string base_model_identity(const TrainConfig& cfg) {
  std::string desc;
  std::string text;
  if (read_model_file((fs::path(cfg.base_model) / "config.json").string(), text))
    desc += "config.json " + hex64(hash_bytes(text.data(), text.size())) + "\n";
  if (cfg.synthetic_weights) {
    desc += "synthetic seed " + std::to_string(cfg.seed) + "\n";
  } else {
    std::vector<fs::path> files;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(cfg.base_model, ec))
      if (e.path().extension() == ".safetensors") files.push_back(e.path());
    std::sort(files.begin(), files.end());
    // The full contents: the safetensors header (names, dtypes, shapes, offsets) and every tensor.
    for (const auto& p : files) {
      struct stat st {};
      if (::stat(p.c_str(), &st) != 0) continue;
      desc += p.filename().string() + " " + std::to_string(st.st_size) + " " + file_content_hash(p.string()) + "\n";
    }
  }
  return hex64(hash_bytes(desc.data(), desc.size()));
}

}  // namespace eo
