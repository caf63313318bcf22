// A gtest fixture with its own temporary folder (shared by the training and fault suites).
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "common/files.h"

namespace eo::testing {

// A test fixture with its own temporary folder dir_ (<tmp>/<prefix><test name>_<pid>), removed
// after a pass and kept after a failure for a look.
class TempDirTest : public ::testing::Test {
 protected:
  explicit TempDirTest(std::string prefix) : prefix_(std::move(prefix)) {}
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = std::filesystem::temp_directory_path() / (prefix_ + info->name() + "_" + std::to_string(::getpid()));
    eo::remove_tree(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override {
    if (!HasFailure()) eo::remove_tree(dir_);
  }
  std::filesystem::path dir_;

 private:
  std::string prefix_;
};

}  // namespace eo::testing
