// safetensors reading (mmap + strict validation), checkpoint folders, atomic writing.
//
// Validation mirrors the reference Rust reader (huggingface/safetensors: read_metadata +
// Metadata::validate) and is a little stricter where a file could only be corrupt (duplicate
// JSON keys, BOOL bytes other than 0/1). Every malformation is an eo::Error whose message
// starts with the file path and names the tensor, so a user can tell which download or
// conversion went wrong.
#include "models/safetensors.h"

#include "common/error.h"
#include "common/files.h"
#include "common/json_depth.h"
#include "common/text.h"

#include <ATen/ops/empty.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <tuple>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace eo::st {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;  // the reference reader's limit

struct DTypeRow {
  DType dtype;
  const char* name;
  std::size_t size;
  at::ScalarType scalar;
};

// The one table tying safetensors dtype names to element sizes and libtorch scalar types.
// (U16/U32/U64 and both F8 types exist in libtorch since 2.3, so 2.11 and 2.13 both have them.)
const DTypeRow kDTypes[] = {
    {DType::BOOL, "BOOL", 1, at::kBool},       {DType::U8, "U8", 1, at::kByte},
    {DType::I8, "I8", 1, at::kChar},           {DType::I16, "I16", 2, at::kShort},
    {DType::U16, "U16", 2, at::kUInt16},       {DType::F16, "F16", 2, at::kHalf},
    {DType::BF16, "BF16", 2, at::kBFloat16},   {DType::I32, "I32", 4, at::kInt},
    {DType::U32, "U32", 4, at::kUInt32},       {DType::F32, "F32", 4, at::kFloat},
    {DType::F64, "F64", 8, at::kDouble},       {DType::I64, "I64", 8, at::kLong},
    {DType::U64, "U64", 8, at::kUInt64},       {DType::F8_E4M3, "F8_E4M3", 1, at::kFloat8_e4m3fn},
    {DType::F8_E5M2, "F8_E5M2", 1, at::kFloat8_e5m2},
};

const DTypeRow& row(DType d) {
  for (const auto& r : kDTypes)
    if (r.dtype == d) return r;
  EO_FAIL("internal error: safetensors dtype ", static_cast<int>(d), " has no table row");
}

std::string supported_dtype_names() {
  std::vector<std::string> names;
  for (const auto& r : kDTypes) names.push_back(r.name);
  return join(names, ", ");
}

std::string shape_str(const std::vector<std::int64_t>& shape) {
  std::ostringstream os;
  os << "[";
  for (std::size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << "]";
  return os.str();
}

std::string offsets_str(std::uint64_t begin, std::uint64_t end) {
  return detail::concat("data_offsets [", begin, ", ", end, "]");
}

// nlohmann keeps the last of duplicate keys silently; a callback sees every key, so we record
// the first duplicate (and the object holding it) and refuse the header afterwards.
struct DuplicateKeyFinder {
  struct Frame {
    std::set<std::string> keys;
    std::string last_key;
  };
  std::vector<Frame> frames;
  std::string duplicate, owner;  // owner: the key of the object holding the duplicate ("" = top)
  std::string path;              // for the nesting-limit error

  bool operator()(int depth, json::parse_event_t event, json& parsed) {
    // Refused while parsing: error messages dump() values, which recurses per level (see json_depth.h).
    if (depth >= kMaxJsonDepth &&
        (event == json::parse_event_t::object_start || event == json::parse_event_t::array_start))
      EO_FAIL(path, ": header nests JSON deeper than ", kMaxJsonDepth, " levels; not a safetensors header");
    switch (event) {
      case json::parse_event_t::object_start: frames.emplace_back(); break;
      case json::parse_event_t::object_end: frames.pop_back(); break;
      case json::parse_event_t::key: {
        const std::string key = parsed.get<std::string>();
        Frame& top = frames.back();
        if (!top.keys.insert(key).second && duplicate.empty()) {
          duplicate = key;
          owner = frames.size() >= 2 ? frames[frames.size() - 2].last_key : "";
        }
        top.last_key = key;
        break;
      }
      default: break;
    }
    return true;
  }
};

// One header entry -> TensorInfo, checking every field's JSON type. `where` prefixes errors.
TensorInfo parse_entry(const std::string& where, const std::string& name, const json& entry) {
  EO_CHECK(entry.is_object(), where, "header entry is a JSON ", entry.type_name(),
           ", expected an object {\"dtype\", \"shape\", \"data_offsets\"}");
  TensorInfo t;
  t.name = name;

  auto dtype_it = entry.find("dtype");
  EO_CHECK(dtype_it != entry.end(), where, "missing \"dtype\"");
  EO_CHECK(dtype_it->is_string(), where, "\"dtype\" is a JSON ", dtype_it->type_name(), ", expected a string");
  const auto& dtype_name_str = dtype_it->get_ref<const std::string&>();
  const DTypeRow* found = nullptr;
  for (const auto& r : kDTypes)
    if (dtype_name_str == r.name) found = &r;
  EO_CHECK(found, where, "unknown dtype '", dtype_name_str, "' (supported: ", supported_dtype_names(), ")");
  t.dtype = found->dtype;

  auto shape_it = entry.find("shape");
  EO_CHECK(shape_it != entry.end(), where, "missing \"shape\"");
  EO_CHECK(shape_it->is_array(), where, "\"shape\" is a JSON ", shape_it->type_name(), ", expected an array of integers");
  for (const auto& dim : *shape_it) {
    EO_CHECK(dim.is_number_integer(), where, "shape ", shape_it->dump(), " has a non-integer dimension ", dim.dump());
    EO_CHECK(dim.is_number_unsigned(), where, "shape ", shape_it->dump(), " has a negative dimension ", dim.dump());
    const auto d = dim.get<std::uint64_t>();
    EO_CHECK(d <= static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()), where, "shape ",
             shape_it->dump(), " has a dimension ", d, " too large for a tensor (over 2^63 - 1)");
    t.shape.push_back(static_cast<std::int64_t>(d));
  }

  auto off_it = entry.find("data_offsets");
  EO_CHECK(off_it != entry.end(), where, "missing \"data_offsets\"");
  EO_CHECK(off_it->is_array() && off_it->size() == 2, where, "\"data_offsets\" is ", off_it->dump(),
           ", expected an array of two integers [begin, end]");
  for (const auto& o : *off_it)
    EO_CHECK(o.is_number_unsigned(), where, "\"data_offsets\" ", off_it->dump(),
             " must hold two non-negative integers below 2^64");
  t.begin = (*off_it)[0].get<std::uint64_t>();
  t.end = (*off_it)[1].get<std::uint64_t>();
  EO_CHECK(t.begin <= t.end, where, offsets_str(t.begin, t.end), " end before they begin");

  // numel * size with overflow checks: a hostile header may declare astronomically large shapes.
  std::uint64_t bytes = found->size;
  for (std::int64_t d : t.shape) {
    const auto ud = static_cast<std::uint64_t>(d);
    EO_CHECK(ud == 0 || bytes <= std::numeric_limits<std::uint64_t>::max() / ud, where, "shape ", shape_str(t.shape),
             " of ", found->name, " overflows: its byte size does not fit in 64 bits");
    bytes *= ud;
  }
  // libtorch strides are products of the trailing dimensions (zeros counted as 1) and must fit in
  // int64 even for an empty tensor: [0, 2^62, 8] holds no bytes yet at::empty cannot make it.
  std::uint64_t extent = 1;
  for (std::int64_t d : t.shape) {
    const auto ud = std::max<std::uint64_t>(static_cast<std::uint64_t>(d), 1);
    EO_CHECK(extent <= static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()) / ud, where, "shape ",
             shape_str(t.shape), " is too large for a tensor: the product of its non-zero dimensions exceeds 2^63 - 1");
    extent *= ud;
  }
  EO_CHECK(bytes == t.end - t.begin, where, "shape ", shape_str(t.shape), " of ", found->name, " needs ", bytes,
           " bytes but ", offsets_str(t.begin, t.end), " hold ", t.end - t.begin,
           " (shape, dtype and data length disagree)");
  return t;
}

}  // namespace

const char* dtype_name(DType d) { return row(d).name; }
std::size_t dtype_size(DType d) { return row(d).size; }

// ---------------------------------------------------------------------------------------------
// File

std::shared_ptr<File> File::open(const std::string& path) {
  std::shared_ptr<File> f(new File());  // owns the mapping from here on, even if we throw
  f->path_ = path;
  const std::string& p = f->path_;

  const int fd = open_input_file(path, "safetensors file");  // no FIFO or device, never blocks
  EO_CHECK(fd >= 0, p, ": cannot open safetensors file: ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    EO_FAIL(p, ": not a regular file");
  }
  const auto file_size = static_cast<std::uint64_t>(st.st_size);
  if (file_size > 0) {
    void* m = ::mmap(nullptr, file_size, PROT_READ, MAP_PRIVATE, fd, 0);
    const int map_errno = errno;
    ::close(fd);
    EO_CHECK(m != MAP_FAILED, p, ": cannot mmap ", file_size, " bytes: ", std::strerror(map_errno));
    f->map_ = m;
    f->map_size_ = file_size;
  } else {
    ::close(fd);
  }
  const auto* bytes = static_cast<const std::uint8_t*>(f->map_);

  // 8-byte little-endian header length, bounded and inside the file.
  EO_CHECK(file_size >= 8, p, ": file is ", file_size,
           " bytes, shorter than the 8-byte header length; it is truncated or not a safetensors file");
  std::uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | bytes[i];
  EO_CHECK(header_len <= kMaxHeaderBytes, p, ": header length ", header_len, " exceeds the limit of ",
           kMaxHeaderBytes, " bytes; the file is corrupt or not a safetensors file");
  EO_CHECK(header_len <= file_size - 8, p, ": header length ", header_len, " runs past the end of the file (",
           file_size, " bytes); the file is truncated");
  EO_CHECK(header_len >= 2 && bytes[8] == '{', p,
           ": header does not start with '{' (a safetensors header is a JSON object); not a safetensors file");

  // UTF-8 JSON object (nlohmann rejects ill-formed UTF-8 inside strings and stray bytes outside).
  const char* text = reinterpret_cast<const char*>(bytes + 8);
  DuplicateKeyFinder dups;
  dups.path = p;
  json header;
  try {
    header = json::parse(text, text + header_len, std::ref(dups));
  } catch (const json::exception& e) {
    EO_FAIL(p, ": header is not valid UTF-8 JSON: ", e.what());
  }
  EO_CHECK(header.is_object(), p, ": header is a JSON ", header.type_name(), ", expected an object");
  if (!dups.duplicate.empty()) {
    if (dups.owner.empty()) EO_FAIL(p, ": tensor '", dups.duplicate, "': duplicate key in the header");
    if (dups.owner == "__metadata__") EO_FAIL(p, ": __metadata__ has duplicate key '", dups.duplicate, "'");
    EO_FAIL(p, ": tensor '", dups.owner, "': duplicate key '", dups.duplicate, "' in the header");
  }

  for (const auto& [key, value] : header.items()) {
    if (key == "__metadata__") {
      EO_CHECK(value.is_object(), p, ": __metadata__ is a JSON ", value.type_name(),
               ", expected an object mapping strings to strings");
      for (const auto& [mk, mv] : value.items()) {
        EO_CHECK(mv.is_string(), p, ": __metadata__ must map strings to strings, but key '", mk, "' holds a JSON ",
                 mv.type_name(), " (", mv.dump(), ")");
        f->metadata_[mk] = mv.get<std::string>();
      }
      continue;
    }
    f->tensors_.push_back(parse_entry(p + ": tensor '" + key + "': ", key, value));
  }

  // Sorted by offset the tensors must tile the data area exactly: from 0, no holes or overlaps,
  // and the file ends at the last byte. (Empty tensors may share an offset.)
  std::sort(f->tensors_.begin(), f->tensors_.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  const std::uint64_t data_size = file_size - 8 - header_len;
  std::uint64_t expected = 0;
  const TensorInfo* prev = nullptr;
  for (const auto& t : f->tensors_) {
    const std::string where = p + ": tensor '" + t.name + "': " + offsets_str(t.begin, t.end);
    if (t.begin > expected) {
      if (prev) EO_FAIL(where, " leave a hole of ", t.begin - expected, " bytes after tensor '", prev->name,
                        "' (which ends at ", expected, "); tensors must be contiguous");
      EO_FAIL(where, " leave a hole of ", t.begin, " bytes at the start of the data; tensors must start at 0");
    }
    EO_CHECK(t.begin == expected, where, " overlap tensor '", prev->name, "' ", offsets_str(prev->begin, prev->end));
    EO_CHECK(t.end <= data_size, where, " run past the end of the file: the data area holds only ", data_size,
             " bytes; the file is truncated");
    expected = t.end;
    prev = &t;
  }
  if (expected < data_size) {
    if (prev) EO_FAIL(p, ": tensor '", prev->name, "': ", data_size - expected, " trailing bytes after this last tensor (",
                      offsets_str(prev->begin, prev->end), ", data area ", data_size, " bytes); the file is corrupt");
    EO_FAIL(p, ": ", data_size, " trailing bytes after a header that declares no tensors; the file is corrupt");
  }

  f->data_start_ = 8 + header_len;
  for (std::size_t i = 0; i < f->tensors_.size(); ++i) f->index_[f->tensors_[i].name] = i;
  return f;
}

File::~File() {
  if (map_) ::munmap(map_, map_size_);
}

const TensorInfo* File::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

const std::uint8_t* File::data(const TensorInfo& t) const {
  return static_cast<const std::uint8_t*>(map_) + data_start_ + t.begin;
}

at::Tensor File::load(const std::string& name) const {
  const TensorInfo* t = find(name);
  if (!t) {
    std::vector<std::string> names;
    for (const auto& ti : tensors_) names.push_back(ti.name);
    auto guess = closest_match(name, names);
    EO_FAIL(path_, ": tensor '", name, "' is not in this file (it holds ", tensors_.size(), " tensors)",
            guess ? "; did you mean '" + *guess + "'?" : std::string());
  }
  const DTypeRow& r = row(t->dtype);
  const std::size_t nbytes = t->end - t->begin;
  if (t->dtype == DType::BOOL) {
    // A bool byte other than 0/1 is undefined behaviour for every kernel that reads it.
    const std::uint8_t* src = data(*t);
    for (std::size_t i = 0; i < nbytes; ++i)
      EO_CHECK(src[i] <= 1, path_, ": tensor '", name, "': BOOL element ", i, " holds byte ", int(src[i]),
               ", expected 0 or 1; the file is corrupt");
  }
  at::Tensor out = at::empty(t->shape, at::TensorOptions().dtype(r.scalar).device(at::kCPU));
  if (nbytes) std::memcpy(out.data_ptr(), data(*t), nbytes);
  return out;
}

// ---------------------------------------------------------------------------------------------
// Checkpoint

namespace {

// A shard named by an index must be a plain file in the folder (no paths, no "..").
bool is_plain_file_name(const std::string& s) {
  return !s.empty() && s != "." && s != ".." && s.find('/') == std::string::npos && s.find('\0') == std::string::npos;
}

std::vector<std::string> folder_entries(const fs::path& folder) {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(folder, ec)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

Checkpoint Checkpoint::open(const std::string& folder) {
  Checkpoint c;
  c.folder_ = folder;
  const fs::path dir(folder);
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    throw UsageError(detail::concat("checkpoint folder '", folder, "' does not exist or is not a folder"));

  const fs::path single = dir / "model.safetensors";
  const fs::path index = dir / "model.safetensors.index.json";

  if (fs::exists(single, ec)) {  // transformers prefers the single file too
    c.files_.push_back(File::open(single.string()));
    for (const auto& t : c.files_[0]->tensors()) c.where_[t.name] = 0;
    return c;
  }

  if (fs::exists(index, ec)) {
    const std::string ip = index.string();
    std::string in;
    EO_CHECK(read_input_file(ip, in, "shard index", kMaxTextFileBytes), ip, ": cannot read the shard index");
    json j;
    try {
      j = json::parse(in);
    } catch (const json::exception& e) {
      EO_FAIL(ip, ": not valid JSON: ", e.what());
    }
    EO_CHECK(j.is_object(), ip, ": expected a JSON object with \"weight_map\"");
    auto wm = j.find("weight_map");
    EO_CHECK(wm != j.end() && wm->is_object(), ip, ": missing \"weight_map\" object {tensor name: shard file}");

    // Open every shard once, in name order, checking the index names files in this folder.
    std::map<std::string, std::size_t> shard_index;  // shard file -> index into files_
    for (const auto& [name, shard] : wm->items()) {
      EO_CHECK(shard.is_string(), ip, ": tensor '", name, "': shard is a JSON ", shard.type_name(),
               ", expected a file name");
      shard_index.emplace(shard.get<std::string>(), 0);
    }
    for (auto& [shard, i] : shard_index) {
      EO_CHECK(is_plain_file_name(shard), ip, ": shard '", shard, "' is not a plain file name in the folder");
      const fs::path sp = dir / shard;
      if (!fs::is_regular_file(sp, ec)) {
        std::string example;
        for (const auto& [name, s] : wm->items())
          if (s == shard) { example = name; break; }
        EO_FAIL(ip, ": tensor '", example, "' is mapped to shard '", shard, "', which is missing from ", folder,
                "; the download is incomplete");
      }
      i = c.files_.size();
      c.files_.push_back(File::open(sp.string()));
    }

    // Every tensor lives in exactly one shard, and it is the one the index names.
    for (std::size_t fi = 0; fi < c.files_.size(); ++fi) {
      for (const auto& t : c.files_[fi]->tensors()) {
        auto [it, fresh] = c.where_.emplace(t.name, fi);
        EO_CHECK(fresh, ip, ": tensor '", t.name, "' is in two shards: ", c.files_[it->second]->path(), " and ",
                 c.files_[fi]->path());
      }
    }
    for (const auto& [name, shard] : wm->items()) {
      const std::size_t want = shard_index.at(shard.get<std::string>());
      auto it = c.where_.find(name);
      EO_CHECK(it != c.where_.end(), ip, ": tensor '", name, "' is mapped to shard '", shard.get<std::string>(),
               "' but no shard contains it");
      EO_CHECK(it->second == want, ip, ": tensor '", name, "' is mapped to shard '", shard.get<std::string>(),
               "' but it is in ", c.files_[it->second]->path());
    }
    return c;
  }

  // No safetensors: explain pickles rather than unpickle them (loading a pickle runs code).
  std::vector<std::string> pickles, others;
  for (const auto& n : folder_entries(dir)) {
    if (ends_with(n, ".bin") || ends_with(n, ".pt") || ends_with(n, ".pth")) pickles.push_back(n);
    if (ends_with(n, ".safetensors")) others.push_back(n);
  }
  if (!pickles.empty())
    throw UsageError(detail::concat(
        "checkpoint folder '", folder, "' holds only pickled PyTorch weights (", join(pickles, ", "),
        "). eo-ddp never unpickles files (a pickle can run arbitrary code). Convert once in Python: "
        "`from transformers import AutoModelForCausalLM; AutoModelForCausalLM.from_pretrained('",
        folder, "', torch_dtype='auto').save_pretrained('", folder,
        "-safetensors', safe_serialization=True)`, copy the tokenizer files, and point base_model there."));
  throw UsageError(detail::concat(
      "checkpoint folder '", folder, "' has no weights: looked for model.safetensors, model.safetensors.index.json",
      " (and pickled *.bin / *.pt / *.pth to explain how to convert them)",
      others.empty() ? std::string() : "; found " + join(others, ", ") + " but no index naming them"));
}

bool Checkpoint::has(const std::string& name) const { return where_.count(name) != 0; }

const TensorInfo& Checkpoint::info(const std::string& name) const {
  auto it = where_.find(name);
  if (it == where_.end()) {
    auto guess = closest_match(name, names());
    EO_FAIL("checkpoint ", folder_, ": no tensor '", name, "'",
            guess ? "; did you mean '" + *guess + "'?" : std::string());
  }
  return *files_[it->second]->find(name);
}

at::Tensor Checkpoint::load(const std::string& name) const {
  const TensorInfo& t = info(name);  // throws naming the tensor when missing
  const std::size_t shard = where_.at(name);
  at::Tensor out = files_[shard]->load(name);
  read_.touched.resize(files_.size());
  if (!read_.touched[shard]) {
    read_.touched[shard] = true;
    ++read_.shards;
  }
  read_.bytes += t.end - t.begin;
  return out;
}

std::uint64_t Checkpoint::total_bytes() const {
  std::uint64_t n = 0;
  for (const auto& f : files_)
    for (const auto& t : f->tensors()) n += t.end - t.begin;
  return n;
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> out;
  for (const auto& [name, _] : where_) out.push_back(name);
  return out;  // std::map keeps them sorted
}

// ---------------------------------------------------------------------------------------------
// save



void save(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
          const std::map<std::string, std::string>& metadata) {
  // Contiguous CPU copies with their dtype rows; names must be unique.
  struct Item {
    std::string name;
    const DTypeRow* row;
    at::Tensor data;
  };
  std::vector<Item> items;
  std::set<std::string> seen;
  for (const auto& [name, t] : tensors) {
    const std::string where = path + ": tensor '" + name + "': ";
    EO_CHECK(seen.insert(name).second, where, "name appears twice; tensor names must be unique");
    EO_CHECK(name != "__metadata__", where, "the name is reserved for the metadata");
    EO_CHECK(t.defined(), where, "undefined tensor");
    EO_CHECK(t.layout() == at::kStrided, where, "only dense (strided) tensors can be saved");
    const DTypeRow* r = nullptr;
    for (const auto& dr : kDTypes)
      if (dr.scalar == t.scalar_type()) r = &dr;
    EO_CHECK(r, where, "dtype ", t.scalar_type(), " has no safetensors equivalent (supported: ", supported_dtype_names(),
             ")");
    items.push_back({name, r, t.to(at::kCPU).resolve_conj().resolve_neg().contiguous()});
  }
  // Like the Python writer: widest dtypes first, so every tensor is aligned to its element size.
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    return a.row->size != b.row->size ? a.row->size > b.row->size : a.name < b.name;
  });

  json header = json::object();
  json meta = json::object();
  for (const auto& [k, v] : metadata) meta[k] = v;
  if (meta.contains("format") && meta["format"] != "pt")
    throw UsageError(detail::concat(path, ": __metadata__ 'format' is '", metadata.at("format"),
                                    "'; it must be 'pt' (transformers refuses other formats)"));
  meta["format"] = "pt";
  header["__metadata__"] = meta;
  std::uint64_t offset = 0;
  for (const auto& it : items) {
    const std::uint64_t n = it.data.nbytes();
    header[it.name] = {{"dtype", it.row->name}, {"shape", it.data.sizes().vec()}, {"data_offsets", {offset, offset + n}}};
    offset += n;
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const json::exception& e) {
    EO_FAIL(path, ": cannot encode the header (tensor names and metadata must be valid UTF-8): ", e.what());
  }
  text.append((8 - text.size() % 8) % 8, ' ');  // 8 + N stays 8-aligned
  EO_CHECK(text.size() <= kMaxHeaderBytes, path, ": header would be ", text.size(), " bytes, over the ",
           kMaxHeaderBytes, "-byte limit readers enforce; save fewer tensors per file");

  // Atomic (common/files.h): a temporary in the same folder, fsync, rename over the target, fsync the folder.
  std::uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<std::uint8_t>(static_cast<std::uint64_t>(text.size()) >> (8 * i));
  write_file_atomic(path, [&](int fd, const std::string& tmp) {
    write_all(fd, len, 8, tmp);
    write_all(fd, text.data(), text.size(), tmp);
    for (const auto& it : items)
      if (it.data.nbytes()) write_all(fd, it.data.data_ptr(), it.data.nbytes(), tmp);
  });
}

}  // namespace eo::st
