// libFuzzer: one .safetensors file (8-byte header length, JSON header, data) through
// eo::st::File::open, then every tensor it declares loaded.
#include <cstdint>
#include <string>

#include "common/error.h"
#include "fuzz/fuzz_common.h"
#include "models/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const std::string path = eo::fuzz::scratch_dir() + "/model.safetensors";
  eo::fuzz::write_file(path, data, size);
  try {
    const auto file = eo::st::File::open(path);
    std::uint64_t total = 0;
    for (const auto& t : file->tensors()) {
      EO_FUZZ_ASSERT(file->find(t.name) == &t);
      const at::Tensor x = file->load(t.name);  // throws for BOOL bytes other than 0/1
      EO_FUZZ_ASSERT(static_cast<std::uint64_t>(x.nbytes()) == t.end - t.begin);
      total += t.end - t.begin;
    }
    EO_FUZZ_ASSERT(total <= size);  // the tensors tile the data area, which is inside the file
    file->load("\x01 not a tensor name");  // must throw naming the file
    EO_FUZZ_ASSERT(false);
  } catch (const eo::Error&) {
  }
  return 0;
}
