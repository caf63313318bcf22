// Shared by the suites that compare against Python-generated reference fixtures.
#pragma once

#include <gtest/gtest.h>
#include "tests/test_paths.h"
#include <sys/wait.h>

#include <ATen/ATen.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <string>

namespace eo::testing {

// max |got - want| / max |want|, in float64.
inline double rel_err(const at::Tensor& got, const at::Tensor& want) {
  const at::Tensor a = got.detach().to(at::kDouble), b = want.detach().to(at::kDouble);
  EXPECT_EQ(a.sizes(), b.sizes());
  return (a - b).abs().max().item<double>() / std::max(b.abs().max().item<double>(), 1e-30);
}

// Runs a shell command, returns its exit code and (optionally) its combined output.
inline int sh(const std::string& cmd, std::string* out = nullptr) {
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  std::string text;
  std::array<char, 4096> buf;
  while (std::size_t n = fread(buf.data(), 1, buf.size(), p)) text.append(buf.data(), n);
  const int status = pclose(p);
  if (out) *out = text;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// BUILD/tests/<folder>/<arch>/, made once by tests/ref/<script> ARCH ROOT (under a lock, so suites
// running in parallel generate each fixture once); the folder holds ref.safetensors when done.
inline std::string python_fixture(const std::string& script, const std::string& folder, const std::string& arch) {
  namespace fs = std::filesystem;
  const fs::path root = fs::path(EO_BINARY_DIR) / "tests" / folder;
  const fs::path dir = root / arch, marker = dir / "ref.safetensors";
  // Missing, or older than the script or the tiny-model builder that made it (a fixture left by
  // an earlier checkout): the script, under the lock, rebuilds it (it checks the same dates).
  const fs::path sources[] = {fs::path(EO_SOURCE_DIR) / "tests" / "ref" / script,
                              fs::path(EO_SOURCE_DIR) / "tools" / "make_tiny_model.py"};
  bool stale = !fs::exists(marker);
  for (const auto& src : sources)
    stale = stale || (fs::exists(src) && fs::last_write_time(src) > fs::last_write_time(marker));
  if (stale) {
    fs::create_directories(root);
    const std::string cmd = "flock " + (root / (arch + ".lock")).string() + " " + EO_PYTHON + " " + EO_SOURCE_DIR +
                            "/tests/ref/" + script + " " + arch + " " + root.string();
    std::string log;
    EXPECT_EQ(sh(cmd, &log), 0) << log;
  }
  return dir.string();
}

}  // namespace eo::testing
