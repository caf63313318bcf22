// bitsandbytes' pre-quantised 4-bit checkpoint tensors <-> QuantizedWeight (see nf4_bnb.h).
#include "models/nf4_bnb.h"

#include <ATen/ATen.h>

#include <nlohmann/json.hpp>

#include <climits>
#include <cmath>
#include <cstring>
#include <limits>
#include <set>

#include "common/error.h"
#include "common/json_depth.h"

namespace eo::nf4 {

namespace {

const char* kStateNf4 = ".weight.quant_state.bitsandbytes__nf4";
const char* kStateFp4 = ".weight.quant_state.bitsandbytes__fp4";

// bnb writes str(torch.dtype).strip("torch.").
const char* dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kBFloat16: return "bfloat16";
    case at::kHalf: return "float16";
    default: EO_FAIL("nf4: dtype ", t, " cannot be stored in a bitsandbytes quant state.");
  }
}

// Validation helper: every message starts with the module and ends with what to do.
struct Module {
  std::string prefix;
  const TensorLookup& get;
  const TensorExists& has;

  template <typename... Args>
  [[noreturn]] void fail(Args&&... args) const {
    EO_FAIL("bitsandbytes 4-bit module '", prefix, "': ", std::forward<Args>(args)...,
            " The checkpoint is damaged or was not written by bitsandbytes; re-quantise the model.");
  }

  at::Tensor tensor(const std::string& suffix, at::ScalarType dtype, std::int64_t numel) const {
    const std::string name = prefix + suffix;
    if (!has(name)) fail("tensor ", name, " is missing.");
    at::Tensor t = get(name);
    if (!t.defined()) fail("tensor ", name, " could not be loaded.");
    if (t.scalar_type() != dtype) fail("tensor ", name, " has dtype ", t.scalar_type(), ", expected ", dtype, ".");
    if (t.numel() != numel) fail("tensor ", name, " has ", t.numel(), " elements (shape ", t.sizes(), "), expected ", numel, ".");
    return t.to(at::kCPU).contiguous().reshape({-1});
  }

  // An integer in [lo, hi]. Checked here rather than by get<int>: nlohmann converts a float such
  // as 1e30 with a plain cast (undefined behaviour) and wraps integers that do not fit.
  std::int64_t integer(const nlohmann::json& v, const std::string& what, std::int64_t lo, std::int64_t hi) const {
    bool ok = v.is_number_integer();
    if (ok && v.is_number_unsigned())  // the parser stores every non-negative integer as unsigned
      ok = v.get<std::uint64_t>() <= static_cast<std::uint64_t>(hi) && static_cast<std::int64_t>(v.get<std::uint64_t>()) >= lo;
    else if (ok)
      ok = v.get<std::int64_t>() >= lo && v.get<std::int64_t>() <= hi;
    if (!ok) fail(what, " is ", v.dump(), ", expected an integer in [", lo, ", ", hi, "].");
    return v.get<std::int64_t>();
  }
  std::int64_t integer(const nlohmann::json& state, const char* key, std::int64_t lo, std::int64_t hi) const {
    if (!state.contains(key)) fail("the quant state JSON lacks \"", key, "\".");
    return integer(state.at(key), detail::concat("the quant state JSON field \"", key, "\""), lo, hi);
  }

  template <typename T>
  T field(const nlohmann::json& state, const char* key) const {
    if (!state.contains(key)) fail("the quant state JSON lacks \"", key, "\".");
    try {
      return state.at(key).get<T>();
    } catch (const nlohmann::json::exception&) {
      fail("the quant state JSON field \"", key, "\" has the wrong type: ", state.at(key).dump(), ".");
    }
  }
};

at::ScalarType parse_dtype(const Module& m, const std::string& name) {
  if (name == "float32") return at::kFloat;
  if (name == "bfloat16") return at::kBFloat16;
  if (name == "float16") return at::kHalf;
  m.fail("the quant state dtype \"", name, "\" is not one of float32, bfloat16, float16.");
}

}  // namespace

bool is_bitsandbytes_4bit(const TensorExists& has, const std::string& prefix) {
  return has(prefix + kStateNf4) || has(prefix + kStateFp4);
}

QuantizedWeight from_bitsandbytes(const TensorLookup& get, const TensorExists& has, const std::string& prefix) {
  const Module m{prefix, get, has};
  if (has(prefix + kStateFp4))
    throw UsageError(detail::concat("bitsandbytes 4-bit module '", prefix,
                                    "' is quantised as fp4; eo-ddp supports nf4 only. Re-quantise the model "
                                    "with bnb_4bit_quant_type=\"nf4\"."));
  if (!has(prefix + kStateNf4)) m.fail("tensor ", prefix, kStateNf4, " is missing.");

  // The JSON quant state, stored as raw UTF-8 bytes.
  const at::Tensor raw = get(prefix + kStateNf4);
  if (!raw.defined() || raw.scalar_type() != at::kByte || raw.dim() != 1)
    m.fail("tensor ", prefix, kStateNf4, " must be a 1-D U8 tensor of JSON bytes.");
  const at::Tensor raw_cpu = raw.to(at::kCPU).contiguous();
  const char* text = reinterpret_cast<const char*>(raw_cpu.data_ptr<std::uint8_t>());
  const nlohmann::json state = nlohmann::json::parse(
      text, text + raw_cpu.numel(),
      json_depth_limit([&] { m.fail("the quant state nests JSON deeper than ", kMaxJsonDepth, " levels."); }), false);
  if (state.is_discarded() || !state.is_object()) m.fail("the quant state is not a well-formed JSON object.");

  static const std::set<std::string> known = {"quant_type", "blocksize", "dtype", "shape",
                                              "nested_blocksize", "nested_dtype", "nested_offset"};
  for (const auto& item : state.items())
    if (!known.count(item.key())) m.fail("the quant state JSON has an unknown key \"", item.key(), "\".");

  const auto quant_type = m.field<std::string>(state, "quant_type");
  if (quant_type == "fp4")
    throw UsageError(detail::concat("bitsandbytes 4-bit module '", prefix, "' is quantised as fp4; eo-ddp supports "
                                    "nf4 only. Re-quantise the model with bnb_4bit_quant_type=\"nf4\"."));
  if (quant_type != "nf4") m.fail("quant_type is \"", quant_type, "\", expected \"nf4\".");

  QuantizedWeight q;
  q.blocksize = static_cast<int>(m.integer(state, "blocksize", INT_MIN, INT_MAX));
  const int bs = q.blocksize;
  if (bs < 32 || bs > 4096 || (bs & (bs - 1)) != 0) m.fail("blocksize ", bs, " is not a power of two in 32..4096.");
  q.dtype = parse_dtype(m, m.field<std::string>(state, "dtype"));
  const nlohmann::json shape = m.field<nlohmann::json>(state, "shape");
  if (!shape.is_array() || shape.size() != 2) m.fail("shape ", shape.dump(), " is not a 2-D [out, in] shape.");
  for (std::size_t i = 0; i < 2; ++i)
    q.shape.push_back(m.integer(shape[i], detail::concat("shape ", shape.dump(), " dimension ", i), 1, std::int64_t{1} << 31));
  const std::int64_t n = q.numel(), nblocks = q.nblocks();

  q.packed = m.tensor(".weight", at::kByte, (n + 1) / 2).view({(n + 1) / 2, 1});

  const at::Tensor quant_map = m.tensor(".weight.quant_map", at::kFloat, 16);
  for (int i = 0; i < 16; ++i)
    if (quant_map.data_ptr<float>()[i] != kCode[i])
      m.fail("quant_map[", i, "] = ", quant_map.data_ptr<float>()[i], " differs from the NF4 code ", kCode[i], ".");

  const bool nested_json = state.contains("nested_blocksize") || state.contains("nested_dtype") ||
                           state.contains("nested_offset");
  const bool nested_tensors = has(prefix + ".weight.nested_absmax") || has(prefix + ".weight.nested_quant_map");
  if (nested_json != nested_tensors)
    m.fail(nested_json ? "the quant state is nested but the nested_absmax / nested_quant_map tensors are missing."
                       : "nested_absmax / nested_quant_map tensors exist but the quant state is not nested.");

  if (!nested_json) {
    q.absmax = m.tensor(".weight.absmax", at::kFloat, nblocks);
    if (!(at::isfinite(q.absmax).all().item<bool>() && (q.absmax >= 0).all().item<bool>()))
      m.fail("absmax contains negative or non-finite values.");
    return q;
  }

  DoubleQuant dq;
  dq.nested_blocksize = static_cast<int>(m.integer(state, "nested_blocksize", INT_MIN, INT_MAX));
  if (dq.nested_blocksize <= 0 || dq.nested_blocksize > (1 << 20))
    m.fail("nested_blocksize ", dq.nested_blocksize, " is not a positive block size.");
  if (m.field<std::string>(state, "nested_dtype") != "float32")
    m.fail("nested_dtype is ", state.at("nested_dtype").dump(), ", expected \"float32\".");
  const double offset = m.field<double>(state, "nested_offset");
  // Checked in fp32, where it is used: 1e300 is a finite double but an infinite float.
  if (!std::isfinite(offset) || std::fabs(offset) > std::numeric_limits<float>::max()) m.fail("nested_offset ", offset, " is not a finite fp32 value.");
  dq.offset = static_cast<float>(offset);  // bnb: torch.tensor(float(offset)), fp32
  const std::int64_t nested_blocks = (nblocks + dq.nested_blocksize - 1) / dq.nested_blocksize;
  dq.absmax_codes = m.tensor(".weight.absmax", at::kByte, nblocks);
  dq.nested_absmax = m.tensor(".weight.nested_absmax", at::kFloat, nested_blocks);
  dq.nested_code = m.tensor(".weight.nested_quant_map", at::kFloat, 256);
  if (!at::isfinite(dq.nested_absmax).all().item<bool>() || !at::isfinite(dq.nested_code).all().item<bool>())
    m.fail("nested_absmax or nested_quant_map contains non-finite values.");
  q.nested = std::move(dq);
  return q;
}

std::vector<std::pair<std::string, at::Tensor>> to_bitsandbytes(const QuantizedWeight& q, const std::string& prefix) {
  EO_CHECK(q.packed.defined() && q.shape.size() == 2, "nf4::to_bitsandbytes: module '", prefix,
           "' has no quantised weight.");
  std::vector<std::pair<std::string, at::Tensor>> out;
  const std::string w = prefix + ".weight";
  const std::int64_t n = q.numel();
  out.emplace_back(w, q.packed.to(at::kCPU).contiguous().view({(n + 1) / 2, 1}));

  // Key order as bnb's as_dict: tensors absmax, quant_map, nested_*; JSON in its field order.
  nlohmann::ordered_json state;
  state["quant_type"] = "nf4";
  state["blocksize"] = q.blocksize;
  state["dtype"] = dtype_name(q.dtype);
  state["shape"] = q.shape;
  const at::Tensor code = at::tensor(at::ArrayRef<float>(kCode.data(), kCode.size()), at::kFloat);
  if (!q.nested) {
    out.emplace_back(w + ".absmax", q.absmax.to(at::kCPU, at::kFloat).contiguous());
    out.emplace_back(w + ".quant_map", code);
  } else {
    const DoubleQuant& dq = *q.nested;
    out.emplace_back(w + ".absmax", dq.absmax_codes.to(at::kCPU).contiguous());
    out.emplace_back(w + ".quant_map", code);
    out.emplace_back(w + ".nested_absmax", dq.nested_absmax.to(at::kCPU, at::kFloat).contiguous());
    out.emplace_back(w + ".nested_quant_map", dq.nested_code.to(at::kCPU, at::kFloat).contiguous());
    state["nested_blocksize"] = dq.nested_blocksize;
    state["nested_dtype"] = "float32";
    state["nested_offset"] = static_cast<double>(dq.offset);
  }
  const std::string json = state.dump();
  at::Tensor bytes = at::empty({static_cast<std::int64_t>(json.size())}, at::kByte);
  std::memcpy(bytes.data_ptr<std::uint8_t>(), json.data(), json.size());
  out.emplace_back(w + ".quant_state.bitsandbytes__nf4", bytes);
  return out;
}

}  // namespace eo::nf4
