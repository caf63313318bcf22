// File-system helpers that must work the same in every build.
#pragma once

#include <string>

namespace eo {

// rm -r with POSIX calls (nftw). std::filesystem::remove_all crashed at run time in the CUDA
// build (libtorch 2.11 wheel) while the CPU build was fine; this has no such dependency.
// A missing path is not an error; a failure throws eo::Error naming the path.
void remove_tree(const std::string& path);

}  // namespace eo
