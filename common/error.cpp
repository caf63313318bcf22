#include "common/error.h"

#include <cstring>

namespace eo::detail {

const char* source_path(const char* file) {
  // This file's own __FILE__ ends in "common/error.cpp"; what precedes it is how the build names
  // the source tree, the same prefix every other file of the tree is compiled with.
  static const char kSelf[] = __FILE__;
  static const char kTail[] = "common/error.cpp";
  const std::size_t self = sizeof(kSelf) - 1, tail = sizeof(kTail) - 1;
  if (self < tail || std::strcmp(kSelf + self - tail, kTail) != 0) return file;
  const std::size_t root = self - tail;
  return std::strncmp(file, kSelf, root) == 0 ? file + root : file;
}

}  // namespace eo::detail
