// libFuzzer: a bitsandbytes 4-bit quant state through eo::nf4::from_bitsandbytes.
// Input: one flags byte, then the bytes of the quant-state JSON (the U8 tensor
// `P.weight.quant_state.bitsandbytes__nf4`). The harness supplies the module's other tensors
// shaped as bitsandbytes would write them for the JSON's shape / blocksize (when those are small
// integers), and the flags damage them so the tensor checks are reached too:
//   bit 0 drop P.weight        bit 1 absmax of the wrong dtype   bit 2 a NaN / negative absmax
//   bit 3 nested tensors present even when the JSON is not nested (and absent when it is)
//   bit 4 a wrong quant_map entry   bit 5 an fp4 quant state too   bit 6 one element too many
#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <optional>
#include <string>

#include "common/error.h"
#include "fuzz/fuzz_common.h"
#include "models/nf4.h"
#include "models/nf4_bnb.h"

namespace {

// A small non-negative integer field of the JSON, else nullopt (the harness then leaves the
// dependent tensors out, which the parser must report).
std::optional<std::int64_t> small_int(const nlohmann::json& j, const char* key) {
  if (!j.is_object() || !j.contains(key) || !j.at(key).is_number_integer()) return std::nullopt;
  const auto v = j.at(key).get<std::int64_t>();
  if (v <= 0 || v > (1 << 16)) return std::nullopt;
  return v;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  const std::uint8_t flags = data[0];
  const std::string prefix = "model.layers.0.mlp.experts.0.up_proj";
  const std::string w = prefix + ".weight";
  std::map<std::string, at::Tensor> tensors;

  at::Tensor raw = at::empty({static_cast<std::int64_t>(size - 1)}, at::kByte);
  if (size > 1) std::memcpy(raw.data_ptr<std::uint8_t>(), data + 1, size - 1);
  tensors[w + ".quant_state.bitsandbytes__nf4"] = raw;
  if (flags & 32) tensors[w + ".quant_state.bitsandbytes__fp4"] = raw;

  const auto state = nlohmann::json::parse(data + 1, data + size, nullptr, false);
  std::int64_t numel = -1;
  if (state.is_object() && state.contains("shape") && state["shape"].is_array() && state["shape"].size() == 2) {
    const auto& s = state["shape"];
    if (s[0].is_number_integer() && s[1].is_number_integer()) {
      const auto r = s[0].get<std::int64_t>(), c = s[1].get<std::int64_t>();
      if (r > 0 && c > 0 && r <= (1 << 12) && c <= (1 << 12)) numel = r * c;
    }
  }
  const auto blocksize = small_int(state, "blocksize");
  const bool nested = state.is_object() && state.contains("nested_blocksize");
  const std::int64_t extra = (flags & 64) ? 1 : 0;
  if (numel > 0 && blocksize) {
    const std::int64_t nblocks = (numel + *blocksize - 1) / *blocksize;
    if (!(flags & 1)) tensors[w] = at::zeros({(numel + 1) / 2 + extra, 1}, at::kByte);
    at::Tensor code = at::tensor(at::ArrayRef<float>(eo::nf4::kCode.data(), eo::nf4::kCode.size()), at::kFloat);
    if (flags & 16) code[3] = 0.5f;
    tensors[w + ".quant_map"] = code;
    const bool want_uint8_absmax = nested != bool(flags & 2);
    at::Tensor absmax = want_uint8_absmax ? at::full({nblocks}, 7, at::kByte) : at::ones({nblocks}, at::kFloat);
    if ((flags & 4) && absmax.scalar_type() == at::kFloat) absmax[0] = (flags & 8) ? NAN : -1.0f;
    tensors[w + ".absmax"] = absmax;
    if (nested != bool(flags & 8)) {
      const auto nbs = small_int(state, "nested_blocksize").value_or(256);
      tensors[w + ".nested_absmax"] = at::ones({(nblocks + nbs - 1) / nbs + extra}, at::kFloat);
      tensors[w + ".nested_quant_map"] = at::linspace(-1, 1, 256, at::kFloat);
    }
  }

  const eo::nf4::TensorLookup get = [&](const std::string& name) {
    auto it = tensors.find(name);
    EO_FUZZ_ASSERT(it != tensors.end());  // the parser must ask `has` first
    return it->second;
  };
  const eo::nf4::TensorExists has = [&](const std::string& name) { return tensors.count(name) != 0; };
  EO_FUZZ_ASSERT(eo::nf4::is_bitsandbytes_4bit(has, prefix));
  try {
    const eo::QuantizedWeight q = eo::nf4::from_bitsandbytes(get, has, prefix);
    EO_FUZZ_ASSERT(q.shape.size() == 2 && q.shape[0] > 0 && q.shape[1] > 0);
    EO_FUZZ_ASSERT(q.packed.numel() == (q.numel() + 1) / 2);
    EO_FUZZ_ASSERT(q.nested ? q.nested->absmax_codes.numel() == q.nblocks() : q.absmax.numel() == q.nblocks());
    if (q.nested) EO_FUZZ_ASSERT(std::isfinite(q.nested->offset));
    EO_FUZZ_ASSERT(q.blocksize >= 32 && q.blocksize <= 4096);
    const auto back = eo::nf4::to_bitsandbytes(q, prefix);  // writing what was read must work
    EO_FUZZ_ASSERT(!back.empty());
  } catch (const eo::Error&) {
  }
  return 0;
}
