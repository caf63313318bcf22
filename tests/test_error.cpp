// EO_CHECK / EO_FAIL name the file and line that raised them, relative to the source tree.
#include <gtest/gtest.h>

#include <string>

#include "common/error.h"

namespace {

std::string message_of(void (*fn)(int*), int* line) {
  try {
    fn(line);
  } catch (const eo::Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Error, CheckNamesTheFileAndLine) {
  int line = 0;
  const std::string m = message_of(
      [](int* at) {
        const int value = 3;
        *at = __LINE__ + 1;
        EO_CHECK(value == 4, "value is ", value, ", expected 4");
      },
      &line);
  EXPECT_EQ(m, "value is 3, expected 4 (at tests/test_error.cpp:" + std::to_string(line) + ")");
}

TEST(Error, FailNamesTheFileAndLine) {
  int line = 0;
  const std::string m = message_of(
      [](int* at) {
        *at = __LINE__ + 1;
        EO_FAIL("cannot read ", "x.bin");
      },
      &line);
  EXPECT_EQ(m, "cannot read x.bin (at tests/test_error.cpp:" + std::to_string(line) + ")");
}

TEST(Error, CheckThatHoldsThrowsNothing) {
  EXPECT_NO_THROW(EO_CHECK(1 + 1 == 2, "never"));
}

TEST(Error, PathsOutsideTheTreeAreKept) {
  EXPECT_STREQ(eo::detail::source_path("/elsewhere/x.cpp"), "/elsewhere/x.cpp");
}

}  // namespace
