// NF4 quantisation: bit-exact against bitsandbytes (fixtures from tests/ref/nf4_fixtures.py),
// a float64 model of the rounding rule that needs no Python, and the bitsandbytes checkpoint
// format (reading, validation, writing).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstring>
#include <map>

#include "common/error.h"
#include "models/nf4.h"
#include "models/nf4_bnb.h"
#include "models/safetensors.h"
#include "tests/test_paths.h"

namespace {

using eo::QuantizedWeight;

// The NF4 table as written in design.md §3.1 (independent of eo::nf4::kCode).
const double kTable[16] = {-1.0,
                           -0.6961928009986877,
                           -0.5250730514526367,
                           -0.39491748809814453,
                           -0.28444138169288635,
                           -0.18477343022823334,
                           -0.09105003625154495,
                           0.0,
                           0.07958029955625534,
                           0.16093020141124725,
                           0.24611230194568634,
                           0.33791524171829224,
                           0.44070982933044434,
                           0.5626170039176941,
                           0.7229568362236023,
                           1.0};

at::Tensor nibbles(const QuantizedWeight& q) {
  const at::Tensor b = q.packed.reshape({-1});
  return at::stack({at::bitwise_right_shift(b, 4), at::bitwise_and(b, 15)}, 1).reshape({-1}).slice(0, 0, q.numel());
}

bool same_bits(const at::Tensor& a, const at::Tensor& b) {  // exact, NaN-safe, -0 != +0
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const at::Tensor ac = a.contiguous(), bc = b.contiguous();
  return std::memcmp(ac.data_ptr(), bc.data_ptr(), ac.nbytes()) == 0;
}

// ---- float64 model: nearest code (ties to the lower one) and the error bound ----
void check_against_model(const at::Tensor& weight, int blocksize) {
  const QuantizedWeight q = eo::nf4::quantize(weight, blocksize);
  const at::Tensor x = weight.to(at::kDouble).reshape({-1});
  const at::Tensor codes = nibbles(q).to(at::kLong);
  const at::Tensor deq = eo::dequantize(q, at::kFloat).to(at::kDouble).reshape({-1});
  const at::Tensor absmax = q.absmax;
  const std::int64_t n = x.numel();
  ASSERT_EQ(absmax.numel(), (n + blocksize - 1) / blocksize);
  for (std::int64_t i = 0; i < n; ++i) {
    const double am = absmax[i / blocksize].item<double>();
    const double xi = x[i].item<double>();
    ASSERT_EQ(am >= std::fabs(xi), true) << "absmax below |x| at " << i;
    const double s = xi / am;
    const int c = static_cast<int>(codes[i].item<std::int64_t>());
    // nearest in float64; a value within 1e-6 of a midpoint may take either neighbour, and an
    // exact midpoint takes the lower one
    for (int j = 0; j < 16; ++j) {
      const double dc = std::fabs(kTable[c] - s), dj = std::fabs(kTable[j] - s);
      ASSERT_LE(dc, dj + 1e-6) << "element " << i << " scaled " << s << " got code " << c << " but " << j
                               << " is nearer";
      if (dc == dj && j != c) ASSERT_LT(c, j) << "tie at " << s << " must take the lower code";
    }
    const double gap = std::max(c > 0 ? kTable[c] - kTable[c - 1] : 0.0, c < 15 ? kTable[c + 1] - kTable[c] : 0.0);
    ASSERT_LE(std::fabs(deq[i].item<double>() - xi), 0.5 * gap * am * (1 + 1e-6) + 1e-30) << "element " << i;
    ASSERT_EQ(deq[i].item<double>(), static_cast<double>(static_cast<float>(kTable[c] * am)))
        << "dequantised value must be code * absmax in fp32 at " << i;
  }
}

TEST(Nf4Model, RandomWeightsQuantiseToNearestCode) {
  at::manual_seed(7);
  check_against_model(at::randn({37, 91}), 64);                 // partial last block, odd count
  check_against_model(at::randn({8, 128}) * 1e-3, 32);
  check_against_model(at::rand({5, 300}) * 2 - 1, 128);
}

TEST(Nf4Model, ExactMidpointsTakeTheLowerCode) {
  // absmax 1 (the first value), then every midpoint of the float64 table rounded to fp32
  std::vector<float> v = {1.0f};
  for (int i = 0; i < 15; ++i) v.push_back(static_cast<float>((kTable[i] + kTable[i + 1]) / 2));
  for (int i = 0; i < 16; ++i) v.push_back(static_cast<float>(kTable[i]));
  while (v.size() % 32) v.push_back(0.0f);
  check_against_model(at::tensor(v).view({1, -1}), 32);
}

TEST(Nf4Model, DynamicMapShape) {
  const at::Tensor map = eo::nf4::dynamic_map_signed();
  ASSERT_EQ(map.numel(), 256);
  EXPECT_EQ(map[255].item<float>(), 1.0f);
  EXPECT_TRUE((map.slice(0, 1) >= map.slice(0, 0, -1)).all().item<bool>());
  EXPECT_NEAR(map[0].item<float>(), -0.99297, 1e-5);  // bnb's map does not reach -1
}

TEST(Nf4Model, RejectsBadInput) {
  EXPECT_THROW(eo::nf4::quantize(at::randn({4, 64}), 48), eo::UsageError);
  EXPECT_THROW(eo::nf4::quantize(at::randn({4, 64}), 8192), eo::UsageError);
  EXPECT_THROW(eo::nf4::quantize(at::randn({256}), 64), eo::Error);
  EXPECT_THROW(eo::nf4::quantize(at::randn({4, 64}).to(at::kDouble), 64), eo::Error);
  at::Tensor w = at::randn({4, 64});
  w[1][3] = NAN;
  EXPECT_THROW(eo::nf4::quantize(w, 64), eo::Error);
  EXPECT_THROW(eo::nf4::quantize(at::full({2, 64}, 3e38f), 32, true), eo::Error);  // mean overflows
}

// ---- bit-exact against bitsandbytes ----
struct Fixtures {
  std::shared_ptr<eo::st::File> file;
  nlohmann::json cases;
};

const Fixtures& fixtures() {
  static Fixtures f = [] {
    const std::string path = std::string(EO_BINARY_DIR) + "/tests/nf4_fixtures.safetensors";
    Fixtures out;
    out.file = eo::st::File::open(path);  // throws (test fails) when the generator did not run
    out.cases = nlohmann::json::parse(out.file->metadata().at("cases"));
    return out;
  }();
  return f;
}

at::ScalarType dtype_of(const std::string& name) {
  return name == "bfloat16" ? at::kBFloat16 : name == "float16" ? at::kHalf : at::kFloat;
}

TEST(Nf4Bnb, QuantiseAndDequantiseMatchBitsandbytes) {
  const Fixtures& fx = fixtures();
  ASSERT_GT(fx.cases.size(), 100u);
  int nested_cases = 0;
  for (const auto& c : fx.cases) {
    const std::string name = c["name"];
    const auto get = [&](const std::string& key) { return fx.file->load(name + "." + key); };
    SCOPED_TRACE(name + " blocksize " + std::to_string(int(c["blocksize"])) + " " + std::string(c["dtype"]) +
                 (c["double_quant"].get<bool>() ? " nested" : ""));
    const at::Tensor x = get("x");
    ASSERT_EQ(x.scalar_type(), dtype_of(c["dtype"]));
    const QuantizedWeight q = eo::nf4::quantize(x, c["blocksize"], c["double_quant"]);
    EXPECT_TRUE(same_bits(q.packed, get("packed"))) << "packed bytes differ";
    if (c["double_quant"]) {
      ++nested_cases;
      ASSERT_TRUE(q.nested.has_value());
      EXPECT_TRUE(same_bits(q.nested->absmax_codes, get("absmax_codes"))) << "nested absmax codes differ";
      EXPECT_TRUE(same_bits(q.nested->nested_absmax, get("nested_absmax"))) << "nested absmax differs";
      EXPECT_EQ(q.nested->offset, get("offset")[0].item<float>()) << "offset differs";
      EXPECT_TRUE(same_bits(q.absmax_fp32(), get("absmax_fp32"))) << "dequantised absmax differs";
      EXPECT_TRUE(same_bits(q.nested->nested_code, get("mod.weight.nested_quant_map"))) << "dynamic map differs";
    } else {
      EXPECT_TRUE(same_bits(q.absmax, get("absmax"))) << "absmax differs";
    }
    const at::Tensor deq = eo::dequantize(q);
    EXPECT_EQ(deq.scalar_type(), x.scalar_type());
    EXPECT_TRUE(same_bits(deq, get("deq"))) << "dequantised weight differs";
  }
  EXPECT_GT(nested_cases, 10);
}

TEST(Nf4Bnb, ReadsBitsandbytesModuleState) {
  const Fixtures& fx = fixtures();
  for (const auto& c : fx.cases) {
    const std::string name = c["name"];
    SCOPED_TRACE(name);
    const auto get = [&](const std::string& key) { return fx.file->load(key); };
    const auto has = [&](const std::string& key) { return fx.file->find(key) != nullptr; };
    const std::string prefix = name + ".mod";
    ASSERT_TRUE(eo::nf4::is_bitsandbytes_4bit(has, prefix));
    const QuantizedWeight q = eo::nf4::from_bitsandbytes(get, has, prefix);
    EXPECT_EQ(q.blocksize, c["blocksize"].get<int>());
    EXPECT_EQ(q.dtype, dtype_of(c["dtype"]));
    EXPECT_EQ(q.nested.has_value(), c["double_quant"].get<bool>());
    EXPECT_TRUE(same_bits(eo::dequantize(q), fx.file->load(name + ".deq"))) << "dequantised weight differs";

    // Writing it back gives bitsandbytes' tensors (JSON compared as parsed objects).
    const auto written = eo::nf4::to_bitsandbytes(eo::nf4::quantize(fx.file->load(name + ".x"), c["blocksize"],
                                                                    c["double_quant"]),
                                                  prefix);
    std::size_t expected = 0;
    for (const auto& t : fx.file->tensors()) expected += t.name.rfind(prefix + ".", 0) == 0;
    EXPECT_EQ(written.size(), expected);
    for (const auto& [key, tensor] : written) {
      ASSERT_TRUE(has(key)) << key;
      const at::Tensor ref = fx.file->load(key);
      if (key.find("quant_state") != std::string::npos) {
        const auto as_json = [](const at::Tensor& t) {
          const char* p = reinterpret_cast<const char*>(t.data_ptr<std::uint8_t>());
          return nlohmann::json::parse(p, p + t.numel());
        };
        EXPECT_EQ(as_json(tensor), as_json(ref)) << key;
      } else {
        EXPECT_TRUE(same_bits(tensor, ref)) << key;
      }
    }
  }
}

// ---- checkpoint format: round trip and validation ----
struct FakeCheckpoint {
  std::map<std::string, at::Tensor> tensors;
  eo::nf4::TensorLookup get() const {
    return [this](const std::string& k) { return tensors.at(k); };
  }
  eo::nf4::TensorExists has() const {
    return [this](const std::string& k) { return tensors.count(k) > 0; };
  }
  void set_json(const std::string& key, const std::string& text) {
    at::Tensor t = at::empty({static_cast<std::int64_t>(text.size())}, at::kByte);
    std::memcpy(t.data_ptr(), text.data(), text.size());
    tensors[key] = t;
  }
};

FakeCheckpoint checkpoint_of(const QuantizedWeight& q, const std::string& prefix) {
  FakeCheckpoint ck;
  for (auto& [k, t] : eo::nf4::to_bitsandbytes(q, prefix)) ck.tensors[k] = t;
  return ck;
}

TEST(Nf4Format, RoundTrip) {
  at::manual_seed(3);
  for (bool nested : {false, true}) {
    const QuantizedWeight q = eo::nf4::quantize(at::randn({48, 130}).to(at::kBFloat16), 64, nested);
    const FakeCheckpoint ck = checkpoint_of(q, "model.layers.0.mlp.experts.3.up_proj");
    const QuantizedWeight r = eo::nf4::from_bitsandbytes(ck.get(), ck.has(), "model.layers.0.mlp.experts.3.up_proj");
    EXPECT_EQ(r.shape, q.shape);
    EXPECT_EQ(r.dtype, at::kBFloat16);
    EXPECT_TRUE(same_bits(r.packed, q.packed));
    EXPECT_TRUE(same_bits(r.absmax_fp32(), q.absmax_fp32()));
    EXPECT_TRUE(same_bits(eo::dequantize(r), eo::dequantize(q)));
    EXPECT_EQ(r.bytes(), q.bytes());
  }
}

void expect_error(const FakeCheckpoint& ck, const std::string& needle) {
  try {
    eo::nf4::from_bitsandbytes(ck.get(), ck.has(), "blk.w");
    ADD_FAILURE() << "expected an error containing '" << needle << "'";
  } catch (const eo::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("blk.w"), std::string::npos) << msg;
    EXPECT_NE(msg.find(needle), std::string::npos) << msg;
  }
}

TEST(Nf4Format, Validation) {
  const QuantizedWeight q = eo::nf4::quantize(at::randn({8, 64}), 64, true);
  const std::string state = "blk.w.weight.quant_state.bitsandbytes__nf4";
  const std::string good = nlohmann::json::parse(
      std::string(reinterpret_cast<const char*>(checkpoint_of(q, "blk.w").tensors.at(state).data_ptr()),
                  checkpoint_of(q, "blk.w").tensors.at(state).numel())).dump();

  {  // fp4 is refused as a usage error
    FakeCheckpoint ck = checkpoint_of(q, "blk.w");
    ck.tensors["blk.w.weight.quant_state.bitsandbytes__fp4"] = ck.tensors.at(state);
    ck.tensors.erase(state);
    EXPECT_THROW(eo::nf4::from_bitsandbytes(ck.get(), ck.has(), "blk.w"), eo::UsageError);
    auto j = nlohmann::json::parse(good);
    j["quant_type"] = "fp4";
    ck = checkpoint_of(q, "blk.w");
    ck.set_json(state, j.dump());
    EXPECT_THROW(eo::nf4::from_bitsandbytes(ck.get(), ck.has(), "blk.w"), eo::UsageError);
  }
  {
    FakeCheckpoint ck = checkpoint_of(q, "blk.w");
    ck.set_json(state, "{\"quant_type\": \"nf4\", ");
    expect_error(ck, "well-formed JSON");
  }
  const auto with = [&](const std::string& key, const nlohmann::json& value) {
    FakeCheckpoint ck = checkpoint_of(q, "blk.w");
    auto j = nlohmann::json::parse(good);
    if (value.is_null()) j.erase(key); else j[key] = value;
    ck.set_json(state, j.dump());
    return ck;
  };
  expect_error(with("blocksize", 48), "blocksize");
  expect_error(with("blocksize", "64"), "blocksize");
  expect_error(with("dtype", "int8"), "dtype");
  expect_error(with("shape", nlohmann::json::array({8, 65})), "elements");
  expect_error(with("shape", nlohmann::json::array({512})), "shape");
  expect_error(with("nested_offset", nullptr), "nested");
  expect_error(with("extra", 1), "unknown key");
  {
    FakeCheckpoint ck = checkpoint_of(q, "blk.w");
    ck.tensors["blk.w.weight.quant_map"] = ck.tensors["blk.w.weight.quant_map"].clone();
    ck.tensors["blk.w.weight.quant_map"][5] = 0.5f;
    expect_error(ck, "quant_map[5]");
    ck = checkpoint_of(q, "blk.w");
    ck.tensors.erase("blk.w.weight.nested_absmax");
    expect_error(ck, "nested");
    ck = checkpoint_of(q, "blk.w");
    ck.tensors["blk.w.weight.absmax"] = at::zeros({1}, at::kFloat);
    expect_error(ck, "dtype");
    ck = checkpoint_of(q, "blk.w");
    ck.tensors.erase(state);
    expect_error(ck, "missing");
  }
}

}  // namespace
