// libFuzzer: the model.safetensors.index.json of a sharded checkpoint through
// eo::st::Checkpoint::open. The folder holds two fixed, valid shards written by eo::st::save
// (tensors a, b in model-00001-of-00002.safetensors, c in model-00002-of-00002.safetensors) and
// one 3-byte broken shard, broken.safetensors; the fuzzer varies only the index.
#include <ATen/ops/arange.h>

#include <cstdint>
#include <string>

#include "common/error.h"
#include "fuzz/fuzz_common.h"
#include "models/safetensors.h"

namespace {

const std::string& folder() {
  static const std::string dir = [] {
    const std::string d = eo::fuzz::scratch_dir() + "/checkpoint";
    std::filesystem::create_directories(d);
    eo::st::save(d + "/model-00001-of-00002.safetensors",
                 {{"a", at::arange(4, at::kFloat)}, {"b", at::arange(2, at::kLong)}});
    eo::st::save(d + "/model-00002-of-00002.safetensors", {{"c", at::arange(3, at::kBFloat16)}});
    eo::fuzz::write_file(d + "/broken.safetensors", std::string("\x01\x00\x00", 3));
    std::filesystem::create_directories(d + "/subfolder.safetensors");
    return d;
  }();
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string& dir = folder();
  eo::fuzz::write_file(dir + "/model.safetensors.index.json", data, size);
  try {
    const auto ck = eo::st::Checkpoint::open(dir);
    for (const auto& name : ck.names()) {
      EO_FUZZ_ASSERT(ck.has(name));
      const auto& info = ck.info(name);
      EO_FUZZ_ASSERT(static_cast<std::uint64_t>(ck.load(name).nbytes()) == info.end - info.begin);
    }
    EO_FUZZ_ASSERT(!ck.has("zz"));
    ck.load("zz");  // must throw naming the tensor
    EO_FUZZ_ASSERT(false);
  } catch (const eo::Error&) {
  }
  return 0;
}
