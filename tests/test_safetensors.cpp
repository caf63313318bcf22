// Tests for models/safetensors: round trips of every dtype, byte-exact interchange with the
// Python `safetensors` package in both directions (tests/ref/safetensors_ref.py), sharded
// checkpoints (written by huggingface_hub), refusal of pickles, and a hostile corpus of
// malformed files that must each fail with an eo::Error naming the file, tensor and problem.
#include "common/files.h"
#include "models/safetensors.h"

#include "common/error.h"
#include "tests/test_paths.h"

#include <ATen/ops/empty.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

namespace fs = std::filesystem;
using json = nlohmann::json;
using eo::st::DType;

namespace {

// A fresh folder per test (CTest runs the cases in parallel processes).
fs::path test_dir() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  fs::path d = fs::path(EO_BINARY_DIR) / "safetensors_test" / (std::string(info->test_suite_name()) + "." + info->name());
  eo::remove_tree(d);
  fs::create_directories(d);
  return d;
}

void write_bytes(const fs::path& p, const std::string& bytes) {
  std::ofstream(p, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::string le64(std::uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>(n >> (8 * i));
  return s;
}

std::string tensor_bytes(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  return std::string(static_cast<const char*>(c.data_ptr()), c.nbytes());
}

std::string to_hex(const std::string& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned char b : bytes) {
    out += digits[b >> 4];
    out += digits[b & 15];
  }
  return out;
}

const std::vector<std::pair<const char*, at::ScalarType>> kAllDTypes = {
    {"BOOL", at::kBool},     {"U8", at::kByte},       {"I8", at::kChar},       {"I16", at::kShort},
    {"U16", at::kUInt16},    {"F16", at::kHalf},      {"BF16", at::kBFloat16}, {"I32", at::kInt},
    {"U32", at::kUInt32},    {"F32", at::kFloat},     {"F64", at::kDouble},    {"I64", at::kLong},
    {"U64", at::kUInt64},    {"F8_E4M3", at::kFloat8_e4m3fn}, {"F8_E5M2", at::kFloat8_e5m2},
};

// Random bytes of every bit pattern (NaN, inf, subnormals, integer extremes); BOOL only 0/1.
at::Tensor random_tensor(at::ScalarType dtype, std::vector<std::int64_t> shape, std::mt19937& rng) {
  at::Tensor t = at::empty(shape, at::TensorOptions().dtype(dtype));
  auto* p = static_cast<std::uint8_t*>(t.data_ptr());
  for (std::size_t i = 0; i < t.nbytes(); ++i) p[i] = dtype == at::kBool ? rng() % 2 : rng() % 256;
  return t;
}

std::vector<std::pair<std::string, at::Tensor>> tensors_of_every_dtype(std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::pair<std::string, at::Tensor>> out;
  int i = 0;
  for (const auto& [name, dtype] : kAllDTypes)
    out.emplace_back("model.layers." + std::to_string(i) + "." + name + ".weight", random_tensor(dtype, {4, 3 + i++}, rng));
  out.emplace_back("scalar", random_tensor(at::kDouble, {}, rng));
  out.emplace_back("empty", random_tensor(at::kHalf, {0, 7}, rng));
  out.emplace_back("unicode.名前.ß", random_tensor(at::kInt, {2, 1, 3}, rng));
  return out;
}

int run_python(const std::string& args) {
  const std::string cmd = std::string(EO_PYTHON) + " " + EO_SOURCE_DIR + "/tests/ref/safetensors_ref.py " + args;
  return std::system(cmd.c_str());
}

// Runs f, expecting an eo::Error whose message contains every one of `parts`.
template <typename F>
void expect_error(F&& f, const std::vector<std::string>& parts) {
  try {
    f();
  } catch (const eo::Error& e) {
    const std::string msg = e.what();
    for (const auto& part : parts) EXPECT_NE(msg.find(part), std::string::npos) << "missing '" << part << "' in: " << msg;
    return;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected eo::Error, got another exception: " << e.what();
    return;
  }
  ADD_FAILURE() << "expected eo::Error containing '" << (parts.empty() ? "" : parts[0]) << "', nothing was thrown";
}

}  // namespace

TEST(SafetensorsDType, TableMatchesTheFormat) {
  EXPECT_STREQ(eo::st::dtype_name(DType::F8_E4M3), "F8_E4M3");
  EXPECT_EQ(eo::st::dtype_size(DType::BF16), 2u);
  EXPECT_EQ(eo::st::dtype_size(DType::U64), 8u);
  EXPECT_EQ(eo::st::dtype_size(DType::BOOL), 1u);
}

TEST(SafetensorsRoundTrip, EveryDTypeBytesShapesAndMetadata) {
  const fs::path path = test_dir() / "all.safetensors";
  const auto tensors = tensors_of_every_dtype(7);
  eo::st::save(path.string(), tensors, {{"step", "42"}});

  auto f = eo::st::File::open(path.string());
  ASSERT_EQ(f->tensors().size(), tensors.size());
  for (const auto& [name, t] : tensors) {
    SCOPED_TRACE(name);
    ASSERT_NE(f->find(name), nullptr);
    at::Tensor got = f->load(name);
    EXPECT_EQ(got.scalar_type(), t.scalar_type());
    EXPECT_EQ(got.sizes(), t.sizes());
    EXPECT_TRUE(got.device().is_cpu());
    EXPECT_EQ(tensor_bytes(got), tensor_bytes(t));
    if (t.nbytes()) EXPECT_EQ(std::memcmp(f->data(*f->find(name)), t.data_ptr(), t.nbytes()), 0);
  }
  EXPECT_EQ(f->metadata(), (std::map<std::string, std::string>{{"format", "pt"}, {"step", "42"}}));

  // Header padded so the data starts 8-aligned; no temporary left behind.
  const std::string raw = read_bytes(path);
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(raw[i]);
  EXPECT_EQ(n % 8, 0u);
  int entries = 0;
  for (const auto& e : fs::directory_iterator(path.parent_path())) ++entries, (void)e;
  EXPECT_EQ(entries, 1);
}

TEST(SafetensorsRoundTrip, NonContiguousTensorsAreSavedAsTheirValues) {
  const fs::path path = test_dir() / "nc.safetensors";
  std::mt19937 rng(3);
  at::Tensor base = random_tensor(at::kFloat, {5, 6}, rng);
  at::Tensor transposed = base.t();
  eo::st::save(path.string(), {{"t", transposed}});
  at::Tensor got = eo::st::File::open(path.string())->load("t");
  EXPECT_EQ(got.sizes(), transposed.sizes());
  EXPECT_EQ(tensor_bytes(got), tensor_bytes(transposed.contiguous()));
}

TEST(SafetensorsRoundTrip, OverwriteIsAtomicAndFailedSaveKeepsTheOldFile) {
  const fs::path dir = test_dir();
  const fs::path path = dir / "w.safetensors";
  std::mt19937 rng(5);
  at::Tensor a = random_tensor(at::kFloat, {3}, rng);
  eo::st::save(path.string(), {{"a", a}});
  const std::string before = read_bytes(path);

  // A duplicate name fails before anything is written.
  expect_error([&] { eo::st::save(path.string(), {{"x", a}, {"x", a}}); }, {path.string(), "'x'", "twice"});
  // An unsupported dtype too.
  at::Tensor c = at::empty({2}, at::TensorOptions().dtype(at::kComplexFloat));
  expect_error([&] { eo::st::save(path.string(), {{"c", c}}); }, {path.string(), "'c'", "no safetensors equivalent"});
  expect_error([&] { eo::st::save(path.string(), {{"a", a}}, {{"format", "tf"}}); }, {path.string(), "'pt'"});
  expect_error([&] { eo::st::save(path.string(), {{"__metadata__", a}}); }, {"reserved"});
  EXPECT_EQ(read_bytes(path), before);

  at::Tensor b = random_tensor(at::kBFloat16, {2, 2}, rng);
  eo::st::save(path.string(), {{"b", b}});
  auto f = eo::st::File::open(path.string());
  EXPECT_EQ(f->find("a"), nullptr);
  EXPECT_EQ(tensor_bytes(f->load("b")), tensor_bytes(b));
  int entries = 0;
  for (const auto& e : fs::directory_iterator(dir)) ++entries, (void)e;
  EXPECT_EQ(entries, 1) << "a temporary file was left behind";
}

TEST(SafetensorsRoundTrip, MissingTensorSuggestsTheClosestName) {
  const fs::path path = test_dir() / "m.safetensors";
  std::mt19937 rng(1);
  eo::st::save(path.string(), {{"model.norm.weight", random_tensor(at::kFloat, {2}, rng)}});
  auto f = eo::st::File::open(path.string());
  expect_error([&] { f->load("model.norm.wieght"); }, {path.string(), "'model.norm.wieght'", "did you mean 'model.norm.weight'"});
}

// Python writes, we read: identical dtype, shape and bytes (manifest bytes come from the torch
// tensors in Python, not from the file).
TEST(SafetensorsPython, FileWrittenByPythonReadsBackByteExact) {
  const fs::path dir = test_dir();
  const fs::path file = dir / "py.safetensors", manifest = dir / "py.json";
  ASSERT_EQ(run_python("write " + file.string() + " " + manifest.string()), 0);
  json want = json::parse(std::ifstream(manifest));
  const json want_meta = want["__metadata__"];
  want.erase("__metadata__");

  auto f = eo::st::File::open(file.string());
  ASSERT_EQ(f->tensors().size(), want.size());
  ASSERT_GE(want.size(), 15u);
  for (const auto& [name, w] : want.items()) {
    SCOPED_TRACE(name);
    const eo::st::TensorInfo* info = f->find(name);
    ASSERT_NE(info, nullptr);
    EXPECT_EQ(eo::st::dtype_name(info->dtype), w["dtype"].get<std::string>());
    EXPECT_EQ(info->shape, w["shape"].get<std::vector<std::int64_t>>());
    at::Tensor t = f->load(name);
    EXPECT_EQ(t.sizes().vec(), w["shape"].get<std::vector<std::int64_t>>());
    EXPECT_EQ(to_hex(tensor_bytes(t)), w["hex"].get<std::string>());
  }
  for (const auto& [k, v] : want_meta.items()) EXPECT_EQ(f->metadata().at(k), v.get<std::string>());
}

// We write, Python reads with safetensors.torch.load_file: identical dtype, shape, bytes and
// metadata, header length a multiple of 8 (checked by the script).
TEST(SafetensorsPython, FileWrittenByUsLoadsInPython) {
  const fs::path dir = test_dir();
  const fs::path file = dir / "eo.safetensors", manifest = dir / "eo.json";
  const auto tensors = tensors_of_every_dtype(11);
  json m;
  for (const auto& [name, t] : tensors) {
    std::string dt;
    for (const auto& [n, s] : kAllDTypes)
      if (s == t.scalar_type()) dt = n;
    m[name] = {{"dtype", dt}, {"shape", t.sizes().vec()}, {"hex", to_hex(tensor_bytes(t))}};
  }
  m["__metadata__"] = {{"format", "pt"}, {"writer", "eo-ddp"}};
  std::ofstream(manifest) << m.dump();
  eo::st::save(file.string(), tensors, {{"writer", "eo-ddp"}});
  EXPECT_EQ(run_python("check " + file.string() + " " + manifest.string()), 0);
}

TEST(SafetensorsCheckpoint, ShardedByHuggingFaceHub) {
  const fs::path dir = test_dir();
  const fs::path folder = dir / "ckpt", manifest = dir / "ckpt.json";
  ASSERT_EQ(run_python("shard " + folder.string() + " " + manifest.string()), 0);
  ASSERT_TRUE(fs::exists(folder / "model.safetensors.index.json"));
  ASSERT_FALSE(fs::exists(folder / "model.safetensors"));
  const json want = json::parse(std::ifstream(manifest));

  auto ckpt = eo::st::Checkpoint::open(folder.string());
  std::vector<std::string> want_names;
  for (const auto& [name, _] : want.items()) want_names.push_back(name);
  EXPECT_EQ(ckpt.names(), want_names);  // both sorted
  for (const auto& [name, w] : want.items()) {
    SCOPED_TRACE(name);
    EXPECT_TRUE(ckpt.has(name));
    EXPECT_EQ(eo::st::dtype_name(ckpt.info(name).dtype), w["dtype"].get<std::string>());
    EXPECT_EQ(to_hex(tensor_bytes(ckpt.load(name))), w["hex"].get<std::string>());
  }
  EXPECT_FALSE(ckpt.has("lm_head.weight"));
  expect_error([&] { ckpt.load("model.embed_tokens.wieght"); }, {"'model.embed_tokens.wieght'", "did you mean"});
}

TEST(SafetensorsCheckpoint, SingleFile) {
  const fs::path folder = test_dir();
  std::mt19937 rng(2);
  at::Tensor w = random_tensor(at::kBFloat16, {4, 4}, rng);
  eo::st::save((folder / "model.safetensors").string(), {{"w", w}});
  auto ckpt = eo::st::Checkpoint::open(folder.string());
  EXPECT_EQ(ckpt.names(), std::vector<std::string>{"w"});
  EXPECT_EQ(tensor_bytes(ckpt.load("w")), tensor_bytes(w));
}

TEST(SafetensorsCheckpoint, BadIndexesAreRefused) {
  const fs::path folder = test_dir();
  std::mt19937 rng(4);
  at::Tensor t = random_tensor(at::kFloat, {2}, rng);
  eo::st::save((folder / "s1.safetensors").string(), {{"a", t}, {"b", t}});
  eo::st::save((folder / "s2.safetensors").string(), {{"c", t}, {"b", t}});
  eo::st::save((folder / "s3.safetensors").string(), {{"d", t}});
  const fs::path index = folder / "model.safetensors.index.json";
  auto open_with = [&](const json& weight_map) {
    std::ofstream(index) << json{{"metadata", {{"total_size", 8}}}, {"weight_map", weight_map}}.dump();
    return eo::st::Checkpoint::open(folder.string());
  };

  expect_error([&] { open_with({{"a", "s1.safetensors"}, {"b", "s1.safetensors"}, {"c", "s2.safetensors"}}); },
               {index.string(), "'b'", "two shards", "s1.safetensors", "s2.safetensors"});
  expect_error([&] { open_with({{"a", "s1.safetensors"}, {"x", "missing.safetensors"}}); },
               {index.string(), "'x'", "'missing.safetensors'", "missing"});
  expect_error([&] { open_with({{"a", "s3.safetensors"}, {"d", "s3.safetensors"}}); },
               {index.string(), "'a'", "'s3.safetensors'", "no shard contains it"});
  expect_error([&] { open_with({{"d", "../s3.safetensors"}}); }, {index.string(), "not a plain file name"});
  expect_error([&] { open_with({{"d", 3}}); }, {index.string(), "'d'", "expected a file name"});
  std::ofstream(index) << "{\"weight_map\": [";
  expect_error([&] { eo::st::Checkpoint::open(folder.string()); }, {index.string(), "not valid JSON"});

  // A well-formed index over s3 alone works.
  auto ok = open_with({{"d", "s3.safetensors"}});
  EXPECT_EQ(ok.names(), std::vector<std::string>{"d"});
}

TEST(SafetensorsCheckpoint, PickledOnlyFolderIsRefusedNotUnpickled) {
  const fs::path folder = test_dir();
  // Not a valid pickle at all: if anything tried to read it, the message would differ.
  write_bytes(folder / "pytorch_model.bin", "\x80\x02garbage");
  write_bytes(folder / "extra.pth", "x");
  try {
    eo::st::Checkpoint::open(folder.string());
    ADD_FAILURE() << "a pickled-only folder was accepted";
  } catch (const eo::UsageError& e) {
    const std::string msg = e.what();
    for (const char* part : {"pytorch_model.bin", "extra.pth", "never unpickles", "save_pretrained", "safe_serialization=True"})
      EXPECT_NE(msg.find(part), std::string::npos) << part << " missing in: " << msg;
  }
}

TEST(SafetensorsCheckpoint, EmptyOrMissingFolderListsWhatWasLookedFor) {
  const fs::path folder = test_dir();
  write_bytes(folder / "consolidated.safetensors", "");
  expect_error([&] { eo::st::Checkpoint::open(folder.string()); },
               {folder.string(), "model.safetensors", "model.safetensors.index.json", "consolidated.safetensors"});
  expect_error([&] { eo::st::Checkpoint::open((folder / "nope").string()); }, {"nope", "does not exist"});
}

// ---------------------------------------------------------------------------------------------
// Hostile corpus: each malformed file must give an eo::Error naming the file and the problem.

namespace {

struct Hostile {
  const char* label;
  std::string bytes;  // the whole file
  std::vector<std::string> expect;
};

std::string st_file(const std::string& header, const std::string& data) { return le64(header.size()) + header + data; }

std::vector<Hostile> hostile_corpus() {
  const std::string f8 = std::string(8, '\x01');
  std::vector<Hostile> c = {
      {"empty file", "", {"shorter than the 8-byte header"}},
      {"5 bytes", std::string("\x10\x00\x00\x00\x00", 5), {"shorter than the 8-byte header"}},
      {"header length past EOF", le64(1000) + "{}", {"header length 1000", "runs past the end"}},
      {"header length over 100 MB", le64(100'000'001) + "{}", {"100000001", "exceeds the limit"}},
      {"header length 2^64-1", le64(~0ull) + "{}", {"exceeds the limit"}},
      {"header length zero", le64(0), {"does not start with '{'"}},
      {"header not JSON", st_file("{not json}", ""), {"not valid UTF-8 JSON"}},
      {"JSON array", st_file("[1, 2]", ""), {"JSON object"}},
      {"JSON string", st_file("\"abc\"", ""), {"JSON object"}},
      {"trailing garbage after JSON", st_file("{} x", ""), {"not valid UTF-8 JSON"}},
      {"invalid UTF-8", st_file("{\"\xff\xfe\": 1}", ""), {"not valid UTF-8 JSON"}},
      {"entry not an object", st_file(R"({"a": 3})", ""), {"'a'", "header entry is a JSON number"}},
      {"missing dtype", st_file(R"({"a": {"shape": [2], "data_offsets": [0, 8]}})", f8), {"'a'", "missing \"dtype\""}},
      {"missing shape", st_file(R"({"a": {"dtype": "F32", "data_offsets": [0, 8]}})", f8), {"'a'", "missing \"shape\""}},
      {"missing offsets", st_file(R"({"a": {"dtype": "F32", "shape": [2]}})", f8), {"'a'", "missing \"data_offsets\""}},
      {"bad dtype", st_file(R"({"a": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 8]}})", f8), {"'a'", "unknown dtype 'Q7'"}},
      {"dtype not string", st_file(R"({"a": {"dtype": 5, "shape": [2], "data_offsets": [0, 8]}})", f8), {"'a'", "\"dtype\" is a JSON number"}},
      {"shape not array", st_file(R"({"a": {"dtype": "F32", "shape": 2, "data_offsets": [0, 8]}})", f8), {"'a'", "\"shape\" is a JSON number"}},
      {"negative dim", st_file(R"({"a": {"dtype": "F32", "shape": [-2, -1], "data_offsets": [0, 8]}})", f8), {"'a'", "negative dimension -2"}},
      {"float dim", st_file(R"({"a": {"dtype": "F32", "shape": [2.5], "data_offsets": [0, 8]}})", f8), {"'a'", "non-integer dimension 2.5"}},
      {"dim past 2^64", st_file(R"({"a": {"dtype": "F32", "shape": [18446744073709551616], "data_offsets": [0, 8]}})", f8), {"'a'", "non-integer"}},
      {"dim past 2^63", st_file(R"({"a": {"dtype": "U8", "shape": [9223372036854775808], "data_offsets": [0, 8]}})", f8), {"'a'", "too large"}},
      {"numel*size overflows", st_file(R"({"a": {"dtype": "F64", "shape": [4294967296, 4294967296, 16], "data_offsets": [0, 8]}})", f8), {"'a'", "overflows"}},
      {"numel overflows to 0", st_file(R"({"a": {"dtype": "U8", "shape": [4294967296, 4294967296], "data_offsets": [0, 0]}})", ""), {"'a'", "overflows"}},
      {"shape/dtype/length mismatch", st_file(R"({"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 8]}})", f8), {"'a'", "needs 24 bytes", "hold 8"}},
      {"dtype size mismatch", st_file(R"({"a": {"dtype": "F64", "shape": [2], "data_offsets": [0, 8]}})", f8), {"'a'", "needs 16 bytes"}},
      {"offsets one number", st_file(R"({"a": {"dtype": "U8", "shape": [8], "data_offsets": [8]}})", f8), {"'a'", "two integers"}},
      {"offsets three numbers", st_file(R"({"a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8, 8]}})", f8), {"'a'", "two integers"}},
      {"offsets negative", st_file(R"({"a": {"dtype": "U8", "shape": [8], "data_offsets": [-1, 7]}})", f8), {"'a'", "non-negative"}},
      {"offsets strings", st_file(R"({"a": {"dtype": "U8", "shape": [8], "data_offsets": ["0", "8"]}})", f8), {"'a'", "non-negative"}},
      {"offsets reversed", st_file(R"({"a": {"dtype": "U8", "shape": [0], "data_offsets": [10, 8]}})", f8), {"'a'", "data_offsets [10, 8]", "end before"}},
      {"overlap", st_file(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})", std::string(12, 'x')),
       {"'b'", "data_offsets [4, 12]", "overlap tensor 'a'"}},
      {"same offsets twice", st_file(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", f8),
       {"'b'", "overlap tensor 'a'"}},
      {"hole", st_file(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "b": {"dtype": "F32", "shape": [2], "data_offsets": [12, 20]}})", std::string(20, 'x')),
       {"'b'", "hole of 4 bytes after tensor 'a'"}},
      {"hole at start", st_file(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})", std::string(12, 'x')), {"'a'", "hole of 4 bytes at the start"}},
      {"offsets past EOF", st_file(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", "abcd"), {"'a'", "run past the end of the file", "holds only 4"}},
      {"huge offsets past EOF", st_file(R"({"a": {"dtype": "U8", "shape": [1000000000000], "data_offsets": [0, 1000000000000]}})", f8), {"'a'", "run past the end"}},
      {"trailing bytes", st_file(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", f8 + "tail"), {"'a'", "4 trailing bytes"}},
      {"trailing bytes, no tensors", st_file("{}", "abc"), {"3 trailing bytes"}},
      {"metadata value not string", st_file(R"({"__metadata__": {"format": "pt", "n": 1}})", ""), {"__metadata__", "key 'n'", "JSON number"}},
      {"metadata not object", st_file(R"({"__metadata__": ["format", "pt"]})", ""), {"__metadata__ is a JSON array"}},
      {"metadata nested", st_file(R"({"__metadata__": {"x": {"y": "z"}}})", ""), {"__metadata__", "key 'x'", "JSON object"}},
      {"duplicate tensor", st_file(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", f8),
       {"'a'", "duplicate key"}},
      {"duplicate field", st_file(R"({"a": {"dtype": "F32", "dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", f8), {"'a'", "duplicate key 'dtype'"}},
      {"duplicate metadata key", st_file(R"({"__metadata__": {"format": "pt", "format": "pt"}})", ""), {"__metadata__", "duplicate key 'format'"}},
  };
  return c;
}

}  // namespace

TEST(SafetensorsHostile, EveryMalformedFileIsRefusedWithASpecificMessage) {
  const fs::path dir = test_dir();
  int i = 0;
  for (const auto& h : hostile_corpus()) {
    SCOPED_TRACE(h.label);
    const fs::path p = dir / ("hostile_" + std::to_string(i++) + ".safetensors");
    write_bytes(p, h.bytes);
    std::vector<std::string> parts = h.expect;
    parts.push_back(p.string());
    expect_error([&] { eo::st::File::open(p.string()); }, parts);
  }
}

TEST(SafetensorsHostile, ValidCornerCasesAreAccepted) {
  const fs::path dir = test_dir();
  // No tensors at all; empty tensors sharing an offset; header padded with trailing spaces.
  write_bytes(dir / "none.safetensors", st_file("{}", ""));
  EXPECT_TRUE(eo::st::File::open((dir / "none.safetensors").string())->tensors().empty());
  write_bytes(dir / "empties.safetensors",
              st_file(R"({"e": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}, "f": {"dtype": "I64", "shape": [3, 0], "data_offsets": [0, 0]}, "g": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}})" + std::string(6, ' '), "zz"));
  auto f = eo::st::File::open((dir / "empties.safetensors").string());
  EXPECT_EQ(f->load("f").sizes(), (std::vector<std::int64_t>{3, 0}));
  EXPECT_EQ(f->load("g")[1].item<std::uint8_t>(), 'z');
}

TEST(SafetensorsHostile, BoolBytesOtherThanZeroOrOneAreRefusedOnLoad) {
  const fs::path p = test_dir() / "bool.safetensors";
  write_bytes(p, st_file(R"({"mask": {"dtype": "BOOL", "shape": [3], "data_offsets": [0, 3]}})", std::string("\x01\x00\x02", 3)));
  auto f = eo::st::File::open(p.string());
  expect_error([&] { f->load("mask"); }, {p.string(), "'mask'", "BOOL element 2 holds byte 2"});
}

// Truncating a valid file at every byte must fail cleanly (never crash or read past the end).
TEST(SafetensorsHostile, TruncatedAtEveryByte) {
  const fs::path dir = test_dir();
  const fs::path full = dir / "full.safetensors";
  std::mt19937 rng(9);
  eo::st::save(full.string(), {{"a", random_tensor(at::kFloat, {3}, rng)}, {"b", random_tensor(at::kHalf, {5}, rng)},
                               {"c", random_tensor(at::kByte, {2}, rng)}});
  const std::string bytes = read_bytes(full);
  const fs::path p = dir / "cut.safetensors";
  for (std::size_t n = 0; n < bytes.size(); ++n) {
    SCOPED_TRACE("truncated to " + std::to_string(n) + " of " + std::to_string(bytes.size()) + " bytes");
    write_bytes(p, bytes.substr(0, n));
    expect_error([&] { eo::st::File::open(p.string()); }, {p.string()});
  }
}

// Random byte corruption: either a clean eo::Error or a file whose every tensor loads.
TEST(SafetensorsHostile, RandomCorruptionNeverCrashes) {
  const fs::path dir = test_dir();
  const fs::path full = dir / "full.safetensors";
  std::mt19937 rng(17);
  eo::st::save(full.string(), {{"a", random_tensor(at::kFloat, {3}, rng)}, {"m", random_tensor(at::kBool, {4}, rng)}});
  const std::string bytes = read_bytes(full);
  const fs::path p = dir / "mut.safetensors";
  int refused = 0;
  for (int trial = 0; trial < 1500; ++trial) {
    std::string b = bytes;
    for (int k = 0, flips = 1 + rng() % 3; k < flips; ++k) b[rng() % b.size()] = static_cast<char>(rng() % 256);
    write_bytes(p, b);
    try {
      auto f = eo::st::File::open(p.string());
      for (const auto& t : f->tensors()) f->load(t.name);
    } catch (const eo::Error& e) {
      ++refused;
      EXPECT_NE(std::string(e.what()).find(p.string()), std::string::npos) << e.what();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "not an eo::Error: " << e.what();
    }
  }
  EXPECT_GT(refused, 100);  // most corruptions of the header must be caught
}
