#pragma once
// Where the source tree and its build lie, and the Python of the reference stack. Defined in one
// file the build generates (build/tests/test_paths.cpp, tests/CMakeLists.txt), so that no test's
// object depends on where the tree was cloned.

namespace eo_test {
const char* source_dir();
const char* binary_dir();
const char* python();
}  // namespace eo_test

#define EO_SOURCE_DIR (::eo_test::source_dir())
#define EO_BINARY_DIR (::eo_test::binary_dir())
#define EO_PYTHON (::eo_test::python())
