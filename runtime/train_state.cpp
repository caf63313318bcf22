#include "runtime/train_state.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <mutex>
#include <random>
#include <set>
#include <sstream>

#include "common/checksum.h"
#include "common/error.h"
#include "common/fault_seam.h"
#include "common/files.h"
#include "common/log.h"
#include "common/text.h"
#include "models/lora.h"
#include "models/safetensors.h"
#include "runtime/config.h"
#include "runtime/hub.h"
#include "runtime/model_identity.h"

namespace eo {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

const char* kStateFile = "trainer_state.json";
// Written last into a checkpoint: every other file's size and hash, then a hash of those lines.
const char* kChecksumFile = "checksums.txt";
const char* kFormat = "eo-ddp-checkpoint-2";     // with kChecksumFile
const char* kOldFormat = "eo-ddp-checkpoint-1";  // without: its files cannot be verified
const char* kRunFile = "run.json";
const char* kLockFile = ".eo-ddp.lock";
const char* kCheckpointPrefix = "checkpoint-";
const char* kTmpPrefix = ".tmp-checkpoint-";  // a save in progress (or one a crash interrupted)
const char* kOldPrefix = ".old-checkpoint-";  // a checkpoint being replaced by a new save of its step
// Steps above this are no step eo-ddp writes (and parse without overflow everywhere).
constexpr std::int64_t kMaxStep = std::int64_t(1) << 50;

std::map<std::string, at::Tensor> load_all(const std::string& path) {
  std::map<std::string, at::Tensor> out;
  auto f = st::File::open(path);
  for (const auto& t : f->tensors()) out[t.name] = f->load(t.name);
  return out;
}

NamedTensors as_list(const std::map<std::string, at::Tensor>& m) { return NamedTensors(m.begin(), m.end()); }

// The step of "<prefix><digits>[-suffix]", or nullopt. A name that looks like ours but does not
// parse (checkpoint-99999999999999999999, checkpoint-x) is ignored with one warning per name.
std::optional<std::int64_t> parse_step(const std::string& name, const std::string& prefix, bool suffix_allowed,
                                       const std::string& where) {
  if (name.rfind(prefix, 0) != 0) return std::nullopt;
  const char* begin = name.data() + prefix.size();
  const char* end = name.data() + name.size();
  std::int64_t v = -1;
  const auto r = std::from_chars(begin, end, v);
  // Only the name eo-ddp writes: no leading zero (checkpoint-00041 is not checkpoint-41).
  const bool ok = r.ec == std::errc() && r.ptr != begin && v >= 0 && v <= kMaxStep && std::isdigit(*begin) &&
                  (*begin != '0' || r.ptr == begin + 1) && (r.ptr == end || (suffix_allowed && *r.ptr == '-'));
  if (ok) return v;
  static std::mutex mu;
  static std::set<std::string> warned;
  std::lock_guard<std::mutex> lk(mu);
  if (warned.insert(where + "/" + name).second)
    log::warn("ignoring " + where + "/" + name + ": not a checkpoint folder eo-ddp writes (" + prefix +
              "<step>, step 0.." + std::to_string(kMaxStep) + ")");
  return std::nullopt;
}

std::optional<std::int64_t> step_of(const fs::path& p) {
  return parse_step(p.filename().string(), kCheckpointPrefix, false, p.parent_path().string());
}

void remove_tree(const fs::path& p) { eo::remove_tree(p.string()); }  // common/files.h: not std::filesystem

json read_json_file(const fs::path& p, const std::string& what) {
  std::string text;
  if (!read_file_nofollow(p.string(), text)) EO_FAIL(what, ": ", p.string(), " is missing");
  try {
    return json::parse(text);
  } catch (const std::exception& e) {
    EO_FAIL(what, ": ", p.string(), " is not valid JSON: ", e.what());
  }
}

bool complete(const fs::path& checkpoint_dir) {
  struct stat st {};
  return ::lstat((checkpoint_dir / kStateFile).c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// output_dir/run.json: {"run_id", "lineage": [{"segment", "start_step"}, ...]}; nullopt if absent.
std::optional<json> read_run_file(const std::string& output_dir) {
  const fs::path p = fs::path(output_dir) / kRunFile;
  struct stat st {};
  if (::lstat(p.c_str(), &st) != 0) return std::nullopt;
  json j = read_json_file(p, "output_dir " + output_dir);
  if (!j.is_object() || !j.contains("run_id") || !j["run_id"].is_string() || !j.contains("lineage") || !j["lineage"].is_array())
    EO_FAIL(p.string(), " is not an eo-ddp run file (run_id, lineage); remove it or choose another output_dir");
  return j;
}

// A checkpoint (its own lineage, last entry = the segment that wrote it, at `step`) belongs to
// the run lineage `run` if its segment is in `run` and, when a later segment forked from it,
// its step is not past the fork.
bool in_lineage(const json& ckpt_lineage, std::int64_t step, const json& run) {
  if (!ckpt_lineage.is_array() || ckpt_lineage.empty() || !run.is_array()) return false;
  const std::string seg = ckpt_lineage.back().value("segment", std::string());
  for (std::size_t i = 0; i < run.size(); ++i) {
    if (run[i].value("segment", std::string()) != seg) continue;
    return i + 1 == run.size() || step <= run[i + 1].value("start_step", std::int64_t(-1));
  }
  return false;
}

struct Found {
  std::int64_t step;
  fs::path dir;
  json state;  // trainer_state.json
};

void warn_once(const std::string& text) {
  static std::mutex mu;
  static std::set<std::string> warned;
  std::lock_guard<std::mutex> lk(mu);
  if (warned.insert(text).second) log::warn(text);
}

std::string hex64(std::uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

// kChecksumFile of `dir`: every regular file in it (sorted), "hash bytes name" per line, then
// "self <hash of the lines above>". Written atomically, after every file it covers.
void write_checksums(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_regular_file() && !e.is_symlink() && e.path().filename() != kChecksumFile) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  std::string body =
      "# eo-ddp checkpoint checksums: hash (common/checksum.h hash_file), bytes, file; the last line hashes the lines "
      "above. A resume checks every file and falls back to the previous intact checkpoint.\n";
  for (const auto& n : names) {
    std::uint64_t h = 0, bytes = 0;
    EO_CHECK(hash_file((dir / n).string(), h, bytes), "cannot read back ", (dir / n).string(), ": ", std::strerror(errno));
    body += hex64(h) + " " + std::to_string(bytes) + " " + n + "\n";
  }
  body += "self " + hex64(hash_bytes(body.data(), body.size())) + "\n";
  write_file_atomic((dir / kChecksumFile).string(), body);
}

// Why checkpoint `dir` is not what was saved ("" when it is): checks kChecksumFile against
// itself, then every file it lists (or only trainer_state.json with state_only: cheap, for listing).
std::string damage(const fs::path& dir, bool state_only) {
  std::string text;
  if (!read_file_nofollow((dir / kChecksumFile).string(), text)) {
    // Written by an eo-ddp without checksums (its format says so), or a checksum file lost.
    std::string state;
    if (!read_file_nofollow((dir / kStateFile).string(), state)) return std::string(kStateFile) + " is missing";
    json j;
    try {
      j = json::parse(state);
    } catch (const std::exception&) {
      return std::string(kStateFile) + " is not valid JSON and there is no " + kChecksumFile;
    }
    if (j.is_object() && j.value("format", std::string(kOldFormat)) == kOldFormat) return "";
    return std::string(kChecksumFile) + " is missing";
  }
  const std::size_t last = text.size() >= 2 ? text.rfind('\n', text.size() - 2) : std::string::npos;
  const std::string body = last == std::string::npos ? std::string() : text.substr(0, last + 1);
  if (last == std::string::npos || text.compare(last + 1, std::string::npos, "self " + hex64(hash_bytes(body.data(), body.size())) + "\n") != 0)
    return std::string(kChecksumFile) + " does not match its own checksum";
  std::istringstream lines(body);
  bool state_listed = false;
  for (std::string line; std::getline(lines, line);) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream ls(line);
    std::string hash, name;
    std::uint64_t bytes = 0;
    if (!(ls >> hash >> bytes >> name) || name.find('/') != std::string::npos || name == "..")
      return std::string(kChecksumFile) + ": unreadable line '" + line + "'";
    if (name == kStateFile) state_listed = true;
    if (state_only && name != kStateFile) continue;
    const fs::path file = dir / name;
    struct stat st {};
    if (::lstat(file.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return name + " is missing (or not a plain file)";
    std::uint64_t h = 0, got = 0;
    if (!hash_file(file.string(), h, got)) return name + " cannot be read: " + std::strerror(errno);
    if (got != bytes || hex64(h) != hash)
      return name + " changed after it was saved (" + std::to_string(got) + " bytes, checksum " + hex64(h) + "; saved: " +
             std::to_string(bytes) + " bytes, checksum " + hash + ")";
  }
  if (!state_listed) return std::string(kChecksumFile) + " does not list " + kStateFile;
  return "";
}

// Every complete checkpoint-<step> folder of output_dir, oldest first. With `verify`, one whose
// trainer_state.json does not match its checksum is left out with a warning (its run id, step
// and lineage cannot be trusted).
std::vector<Found> complete_checkpoints(const std::string& output_dir, bool verify = false) {
  std::vector<Found> out;
  std::error_code ec;
  if (!fs::is_directory(output_dir, ec)) return out;
  for (const auto& e : fs::directory_iterator(output_dir)) {
    const auto step = step_of(e.path());
    if (!step || !e.is_directory() || e.is_symlink() || !complete(e.path())) continue;
    if (verify) {
      if (const std::string why = damage(e.path(), /*state_only=*/true); !why.empty()) {
        warn_once("ignoring damaged checkpoint " + e.path().string() + ": " + why);
        continue;
      }
    }
    json state;
    try {
      state = read_json_file(e.path() / kStateFile, "checkpoint " + e.path().string());
    } catch (const std::exception& ex) {
      log::warn(std::string("ignoring ") + ex.what());
      continue;
    }
    if (!state.is_object() || state.value("step", json()) != json(*step)) {
      warn_once("ignoring " + e.path().string() + ": its " + kStateFile + " is of step " +
                (state.is_object() ? state.value("step", json()).dump() : std::string("?")) + ", not " + std::to_string(*step));
      continue;
    }
    out.push_back({*step, e.path(), std::move(state)});
  }
  std::sort(out.begin(), out.end(), [](const Found& a, const Found& b) { return a.step < b.step; });
  return out;
}

bool belongs(const Found& f, const json& run) {
  return f.state.value("run_id", std::string()) == run["run_id"].get<std::string>() &&
         in_lineage(f.state.value("lineage", json::array()), f.step, run["lineage"]);
}

// A save that a crash interrupted while replacing checkpoint-N (see save_checkpoint): a complete
// temporary folder is trusted and renamed in; otherwise the moved-aside old one goes back.
// Incomplete temporary folders are dropped. Only called with the output_dir lock held.
void recover_interrupted_saves(const std::string& output_dir) {
  std::error_code ec;
  if (!fs::is_directory(output_dir, ec)) return;
  std::vector<fs::path> tmps, olds;
  for (const auto& e : fs::directory_iterator(output_dir)) {
    const std::string n = e.path().filename().string();
    if (n.rfind(kTmpPrefix, 0) == 0) tmps.push_back(e.path());
    if (n.rfind(kOldPrefix, 0) == 0) olds.push_back(e.path());
  }
  auto final_of = [&](const fs::path& p, const char* prefix) -> std::optional<fs::path> {
    const auto step = parse_step(p.filename().string(), prefix, true, output_dir);
    if (!step) return std::nullopt;
    return fs::path(output_dir) / (kCheckpointPrefix + std::to_string(*step));
  };
  for (const auto& t : tmps) {
    const auto fin = final_of(t, kTmpPrefix);
    if (fin && complete(t) && damage(t, false).empty() && !fs::exists(fs::symlink_status(*fin))) {
      fs::rename(t, *fin);
      fsync_path(output_dir);
      log::warn("completed the interrupted save of " + fin->string() + " from " + t.filename().string());
    } else {
      remove_tree(t);
    }
  }
  for (const auto& o : olds) {
    const auto fin = final_of(o, kOldPrefix);
    if (fin && !fs::exists(fs::symlink_status(*fin))) {
      fs::rename(o, *fin);
      fsync_path(output_dir);
      log::warn("restored " + fin->string() + " (its replacement was interrupted before the new one was complete)");
    } else {
      remove_tree(o);
    }
  }
}

// Where output_dir's folder could not be locked, the lock file must still be the one this process
// holds: deleted or replaced, another run may have taken the folder, and a save would mix with it.
void check_lock_still_held(const std::string& output_dir);

std::string random_id() {
  std::random_device rd;
  std::mt19937_64 g((std::uint64_t(rd()) << 32) ^ rd() ^
                    static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()));
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(g()));
  return buf;
}

std::string host_name() {
  char host[256] = {0};
  ::gethostname(host, sizeof host - 1);
  return host;
}

std::string now_text() {
  const std::time_t t = std::time(nullptr);
  char buf[64];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S", std::localtime(&t));
  return buf;
}

}  // namespace

std::string first_nonfinite(const NamedTensors& tensors) {
  for (const auto& [n, t] : tensors)
    if (t.defined() && t.is_floating_point() && !at::isfinite(t).all().item<bool>()) return n;
  return "";
}

std::string checkpoint_damage(const std::string& folder) { return damage(folder, /*state_only=*/false); }

model::LoraSpec lora_spec(const TrainConfig& cfg) {
  model::LoraSpec spec;
  spec.r = cfg.lora_r;
  spec.alpha = cfg.lora_alpha;
  spec.dropout = cfg.lora_dropout;
  spec.use_rslora = cfg.peft_use_rslora;
  spec.targets = cfg.lora_target_modules;
  spec.target_parameters = cfg.lora_target_parameters;
  spec.layers = cfg.peft_layers_to_transform;
  spec.seed = static_cast<std::uint64_t>(cfg.seed);
  return spec;
}

std::int64_t merge_aware_first_step(const TrainConfig& cfg, std::int64_t total_steps) {
  const double v = cfg.nvfp4_merge_aware_start_step.value_or(0);
  return v > 0 && v < 1 ? static_cast<std::int64_t>(v * static_cast<double>(total_steps)) : static_cast<std::int64_t>(v);
}

std::string merge_aware_start_text(const TrainConfig& cfg) {
  std::ostringstream o;
  o << cfg.nvfp4_merge_aware_start_step.value_or(0);
  return o.str();
}

void write_adapter(const std::string& dir, const NamedTensors& lora, const TrainConfig& cfg, bool merge_aware_trained) {
  // An adapter with NaN/Inf would load and generate garbage: never written.
  if (const std::string bad = first_nonfinite(lora); !bad.empty())
    EO_FAIL("not writing the adapter to ", dir, ": ", bad, " holds NaN/Inf values");
  fs::create_directories(dir);
  // peft's names and shapes: a stacked expert LoRA is written as its per-expert slices (cut on
  // the host, after one device copy per stacked tensor).
  NamedTensors stacked, cpu;
  for (const auto& [n, t] : lora) stacked.emplace_back(n, t.detach().to(at::kCPU));
  for (const auto& [n, t] : model::peft_lora_tensors(stacked)) cpu.emplace_back(n, t.contiguous());
  st::save((fs::path(dir) / "adapter_model.safetensors").string(), cpu);
  model::write_adapter_config(dir, lora_spec(cfg), hub::adapter_base_name(cfg), model::lora_decoder_prefix(cpu),
                              model::lora_fused_experts_path(cpu));
  if (merge_aware_trained) {
    // axolotl's write_merge_aware_metadata; peft ignores the key. encoder null: eo-ddp's quantiser is
    // torchao's algorithm (tests/ref/nvfp4_merge_ref.py) but not torchao, whose version axolotl
    // merge-lora would otherwise compare with its own.
    const std::string path = (fs::path(dir) / "adapter_config.json").string();
    std::string text;
    EO_CHECK(read_file_nofollow(path, text), "cannot read ", path, " to record nvfp4_merge_aware in it");
    json j = json::parse(text);
    json start = nullptr;
    if (const auto& v = cfg.nvfp4_merge_aware_start_step) start = *v >= 1 || *v == 0 ? json(static_cast<std::int64_t>(*v)) : json(*v);
    j["nvfp4_merge_aware"] = {{"scale_mode", "fresh"}, {"pts_policy", "base_fused_max"}, {"encoder", nullptr}, {"start_step", start}};
    write_file_atomic(path, j.dump(2) + "\n");
  }
  // What the adapter was trained on top of (peft's config has no place for it): `eo-ddp score
  // --adapter` evaluates on the same base unless told otherwise.
  nlohmann::json base;
  base["base_model"] = cfg.base_model;
  base["load_in_4bit"] = cfg.load_in_4bit;
  base["bnb_4bit_blocksize"] = cfg.bnb_4bit_blocksize;
  base["bnb_4bit_use_double_quant"] = cfg.bnb_4bit_use_double_quant;
  base["expert_quant"] = cfg.expert_quant;
  write_file_atomic((fs::path(dir) / kAdapterBaseFile).string(), base.dump(2) + "\n");
}

std::vector<std::string> copy_tokenizer_files(const std::string& base_model, const std::string& dir) {
  static const char* const kNames[] = {"tokenizer.json",     "tokenizer_config.json", "special_tokens_map.json",
                                       "added_tokens.json",  "chat_template.jinja",   "chat_template.json",
                                       "tokenizer.model",    "vocab.json",            "merges.txt",
                                       "vocab.txt",          "spiece.model"};
  std::vector<std::string> copied;
  for (const char* name : kNames) {
    const fs::path from = fs::path(base_model) / name;
    if (!fs::is_regular_file(from)) continue;
    std::string bytes;
    EO_CHECK(read_model_file(from.string(), bytes), "cannot read ", from.string(), " to copy it beside the adapter");
    write_file_atomic((fs::path(dir) / name).string(), bytes);
    copied.push_back(name);
  }
  return copied;
}

std::string save_checkpoint(const std::string& output_dir, const TrainingState& s, const TrainConfig& cfg, int keep,
                            std::int64_t keep_newest_before) {
  // A checkpoint with NaN/Inf could only be resumed into more of them.
  for (const NamedTensors* part : {&s.lora, &s.optimizer})
    if (const std::string bad = first_nonfinite(*part); !bad.empty())
      EO_FAIL("not saving checkpoint-", s.step, " in ", output_dir, ": ", bad, " holds NaN/Inf values");
  fs::create_directories(output_dir);
  check_lock_still_held(output_dir);
  const fs::path final_dir = fs::path(output_dir) / (kCheckpointPrefix + std::to_string(s.step));
  const std::string suffix = std::to_string(s.step) + "-" + std::to_string(::getpid());
  const fs::path tmp_dir = fs::path(output_dir) / (kTmpPrefix + suffix);
  const fs::path old_dir = fs::path(output_dir) / (kOldPrefix + suffix);
  const std::optional<json> run = read_run_file(output_dir);
  // Saves that died half-way (kill -9, node loss) are finished or dropped before this one starts,
  // so repeated crashes do not fill the disk with partial checkpoints.
  recover_interrupted_saves(output_dir);
  try {
    fs::create_directories(tmp_dir);
    write_adapter(tmp_dir.string(), s.lora, cfg, s.extra.is_object() && s.extra.value(kMergeAwareOnKey, false));
    st::save((tmp_dir / "optimizer.safetensors").string(), s.optimizer);
    // Test seam: die like kill -9 in the middle of a checkpoint write.
    if (faults::plan().kill_in_save == s.step) std::raise(SIGKILL);
    st::save((tmp_dir / "rng.safetensors").string(), s.rng);
    json j;
    j["step"] = s.step;
    j["data_cursor"] = s.data_cursor;
    j["extra"] = s.extra;
    j["world_size"] = s.world_size;
    j["format"] = kFormat;
    if (run) {
      j["run_id"] = (*run)["run_id"];
      j["lineage"] = (*run)["lineage"];
    }
    j["config"] = recorded_config(cfg);
    // Written last: a folder with trainer_state.json has every other file complete.
    write_file_atomic((tmp_dir / kStateFile).string(), j.dump(2) + "\n");
    write_checksums(tmp_dir);  // after every file it covers
    fsync_path(tmp_dir.string());
    // Replacing checkpoint-N (a requeued run re-saving its last step): move the old one aside,
    // rename the new one in, then delete the old. A crash in between leaves a complete temporary
    // folder (trusted) or the old one (restored) -- recover_interrupted_saves -- never nothing.
    const bool replacing = fs::exists(fs::symlink_status(final_dir));
    if (replacing) {
      fs::rename(final_dir, old_dir);
      fsync_path(output_dir);
      if (faults::plan().kill_in_replace == s.step) std::raise(SIGKILL);  // test seam
    }
    fs::rename(tmp_dir, final_dir);
    fsync_path(output_dir);
    if (replacing) remove_tree(old_dir);
  } catch (const std::exception& e) {
    // Disk full, quota, I/O error: the new checkpoint is dropped whole; the previous ones are untouched.
    try {
      if (fs::exists(fs::symlink_status(old_dir)) && !fs::exists(fs::symlink_status(final_dir))) fs::rename(old_dir, final_dir);
      remove_tree(tmp_dir);
    } catch (...) {
    }
    EO_FAIL("cannot save checkpoint ", final_dir.string(), ": ", e.what(), ". The previous checkpoints in ", output_dir,
            " are intact (resume_from_checkpoint: auto takes the newest); free space on that disk or choose another output_dir");
  }
  // Keep the newest `keep` checkpoints of this run's lineage; another run's are never touched.
  // The newest one before keep_newest_before is kept as well: the state from before the run's
  // first non-finite step, which a user may need to go back to.
  std::vector<Found> mine;
  for (auto& f : complete_checkpoints(output_dir))
    if (!run || belongs(f, *run)) mine.push_back(std::move(f));
  std::optional<std::size_t> kept;
  for (std::size_t i = 0; i < mine.size(); ++i)
    if (mine[i].step < keep_newest_before) kept = i;
  for (std::size_t i = 0; i + keep < mine.size(); ++i)
    if (i != kept) remove_tree(mine[i].dir);
  return final_dir.string();
}

std::optional<std::string> latest_checkpoint(const std::string& output_dir) {
  const std::optional<json> run = read_run_file(output_dir);
  std::vector<Found> mine;
  for (auto& f : complete_checkpoints(output_dir, /*verify=*/true))
    if (!run || belongs(f, *run)) mine.push_back(std::move(f));
  // Newest first; a damaged one is passed over with a warning, for the previous intact one.
  std::vector<std::string> damaged;
  for (auto it = mine.rbegin(); it != mine.rend(); ++it) {
    const std::string why = damage(it->dir, /*state_only=*/false);
    if (why.empty()) {
      if (!damaged.empty())
        warn_once("resuming from " + it->dir.string() + ", the newest intact checkpoint (damaged: " + join(damaged, ", ") + ")");
      return it->dir.string();
    }
    warn_once("checkpoint " + it->dir.string() + " is damaged: " + why + "; falling back to the previous checkpoint");
    damaged.push_back(it->dir.filename().string());
  }
  return std::nullopt;
}

TrainingState load_checkpoint(const std::string& folder, bool with_tensors) {
  const fs::path dir(folder);
  EO_CHECK(fs::exists(dir / kStateFile), "checkpoint ", folder, " is incomplete: no ", kStateFile,
           " (it was not finished; use an older checkpoint or resume_from_checkpoint: auto)");
  // What is loaded is what was saved: every file against the checksums written with it.
  if (const std::string why = damage(dir, /*state_only=*/false); !why.empty())
    throw UsageError("checkpoint " + folder + " is damaged: " + why + ". Resume from another checkpoint "
                     "(resume_from_checkpoint: auto takes the newest intact one of the run).");
  if (!fs::exists(dir / kChecksumFile))
    warn_once("checkpoint " + folder + " has no checksums (written by an older eo-ddp): its files cannot be verified");
  const json j = read_json_file(dir / kStateFile, "checkpoint " + folder);
  TrainingState s;
  try {
    s.step = j.at("step").get<std::int64_t>();
    s.data_cursor = j.at("data_cursor");
    s.extra = j.value("extra", nlohmann::json::object());
    s.world_size = j.value("world_size", 1);
    s.run_id = j.value("run_id", std::string());
    s.lineage = j.value("lineage", json::array());
    s.recorded = j.value("config", json());
  } catch (const std::exception& e) {
    EO_FAIL("checkpoint ", folder, ": ", kStateFile, " is missing fields: ", e.what());
  }
  if (!with_tensors) return s;
  // The adapter is stored in peft's per-expert form (write_adapter); the model trains it stacked.
  // ParamWrapper tensors (lora_target_parameters) need r and the parameters: from the adapter's config.
  const model::LoraSpec spec = model::read_adapter_config(dir.string());
  s.lora = model::stack_expert_lora(as_list(load_all((dir / "adapter_model.safetensors").string())), &spec);
  s.optimizer = as_list(load_all((dir / "optimizer.safetensors").string()));
  s.rng = as_list(load_all((dir / "rng.safetensors").string()));
  for (const NamedTensors* part : {&s.lora, &s.optimizer})
    if (const std::string bad = first_nonfinite(*part); !bad.empty())
      EO_FAIL("checkpoint ", folder, ": ", bad, " holds NaN/Inf values; training from it cannot recover. Resume from an "
              "earlier checkpoint (resume_from_checkpoint: <folder>)");
  return s;
}

// ---- resume compatibility -------------------------------------------------------------------

namespace {

// FNV-1a, 64 bit: a content fingerprint, not a security hash.
struct Fnv {
  std::uint64_t h = 1469598103934665603ull;
  void add(const void* p, std::size_t n) {
    const auto* b = static_cast<const unsigned char*>(p);
    for (std::size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  }
  void add(const std::string& s) { add(s.data(), s.size()); }
};

// The sampled fingerprint that checkpoints of earlier eo-ddp recorded (base_model_fingerprint):
// config.json, then for every *.safetensors file its name, size and 16 windows of 4 KiB. Only
// computed to resume such a checkpoint; base_model_identity replaced it.
std::string legacy_sampled_fingerprint(const TrainConfig& cfg) {
  Fnv f;
  std::string text;
  if (read_model_file((fs::path(cfg.base_model) / "config.json").string(), text)) f.add(text);
  if (cfg.synthetic_weights) {
    f.add("synthetic seed " + std::to_string(cfg.seed));
  } else {
    std::vector<fs::path> files;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(cfg.base_model, ec))
      if (e.path().extension() == ".safetensors") files.push_back(e.path());
    std::sort(files.begin(), files.end());
    std::vector<char> buf(4096);
    for (const auto& p : files) {
      const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) continue;
      struct stat st {};
      ::fstat(fd, &st);
      f.add(p.filename().string());
      f.add(&st.st_size, sizeof st.st_size);
      for (int w = 0; w < 16; ++w) {
        const off_t off = st.st_size <= off_t(buf.size()) ? 0 : off_t((st.st_size - off_t(buf.size())) / 15 * w);
        const ssize_t n = ::pread(fd, buf.data(), buf.size(), off);
        if (n > 0) f.add(buf.data(), static_cast<std::size_t>(n));
      }
      ::close(fd);
    }
  }
  char out[17];
  std::snprintf(out, sizeof out, "%016llx", static_cast<unsigned long long>(f.h));
  return out;
}

std::string show(const json& v) { return v.is_string() ? v.get<std::string>() : v.dump(); }

}  // namespace

json recorded_config(const TrainConfig& cfg) {
  json datasets = json::array(), contents = json::array();
  for (const auto& d : cfg.datasets) {
    datasets.push_back(d.path);
    struct stat st {};
    contents.push_back(::stat(d.path.c_str(), &st) == 0 && S_ISREG(st.st_mode) ? json(file_content_hash(d.path)) : json());
  }
  return {{"base_model", cfg.base_model},
          {"base_model_identity", base_model_identity(cfg)},
          {"adapter", cfg.adapter},
          {"lora_r", cfg.lora_r},
          {"lora_alpha", cfg.lora_alpha},
          {"peft_use_rslora", cfg.peft_use_rslora},
          {"lora_target_modules", cfg.lora_target_modules},
          {"lora_target_parameters", cfg.lora_target_parameters},
          {"peft_layers_to_transform", cfg.peft_layers_to_transform},
          {"lora_dropout", cfg.lora_dropout},
          {"load_in_4bit", cfg.load_in_4bit},
          {"bnb_4bit_blocksize", cfg.bnb_4bit_blocksize},
          {"bnb_4bit_use_double_quant", cfg.bnb_4bit_use_double_quant},
          {"expert_quant", cfg.expert_quant},
          {"sequence_len", cfg.sequence_len},
          {"sample_packing", cfg.sample_packing},
          {"datasets", datasets},
          {"dataset_contents", contents},
          {"micro_batch_size", cfg.micro_batch_size},
          {"gradient_accumulation_steps", cfg.gradient_accumulation_steps},
          {"learning_rate", cfg.learning_rate},
          {"lr_scheduler", cfg.lr_scheduler},
          {"weight_decay", cfg.weight_decay},
          {"seed", cfg.seed}};
}

std::vector<std::string> check_resume_compatible(const TrainingState& s, const TrainConfig& cfg) {
  std::vector<std::string> warnings;
  if (!s.recorded.is_object())
    return {"the checkpoint records no config (written by an older eo-ddp): cannot check that base_model, lora_r, "
            "lora_alpha, target modules and sequence_len match it"};
  const json now = recorded_config(cfg);
  // Keys whose change makes the saved adapter or the data cursor mean something else.
  static const char* kRefuse[] = {"adapter",        "lora_r",          "lora_alpha",         "peft_use_rslora",
                                  "lora_target_modules", "lora_target_parameters", "peft_layers_to_transform",
                                  "load_in_4bit", "bnb_4bit_blocksize",
                                  "bnb_4bit_use_double_quant", "expert_quant", "sequence_len",   "sample_packing"};
  std::vector<std::string> problems;
  auto differs = [&](const char* key) { return s.recorded.contains(key) && s.recorded[key] != now[key]; };
  // Checkpoints of earlier eo-ddp recorded a sampled fingerprint instead of the full identity.
  const bool legacy = !s.recorded.contains("base_model_identity") && s.recorded.contains("base_model_fingerprint");
  const std::string id_key = legacy ? "base_model_fingerprint" : "base_model_identity";
  const json id_now = legacy ? json(legacy_sampled_fingerprint(cfg)) : now["base_model_identity"];
  if (s.recorded.contains(id_key) && s.recorded[id_key] != id_now) {
    problems.push_back("base_model: the checkpoint was trained on " + show(s.recorded.value("base_model", json("?"))) +
                       " (contents " + show(s.recorded[id_key]) + "), this config's " + cfg.base_model +
                       " has other contents (" + show(id_now) + ")");
  } else if (differs("base_model")) {
    warnings.push_back("base_model moved from " + show(s.recorded["base_model"]) + " to " + cfg.base_model +
                       " (same contents); resuming");
  }
  for (const char* key : kRefuse)
    if (differs(key))
      problems.push_back(std::string(key) + ": the checkpoint has " + show(s.recorded[key]) + ", this config " + show(now[key]));
  if (!problems.empty()) {
    std::string msg = "cannot resume from checkpoint at step " + std::to_string(s.step) + ": the config differs from the one "
                      "it was trained with in " + std::to_string(problems.size()) + (problems.size() == 1 ? " key" : " keys") + ":";
    for (const auto& p : problems) msg += "\n  - " + p;
    msg += "\nSet those keys back to the checkpoint's values, or start a fresh run (another output_dir, without "
           "resume_from_checkpoint).";
    throw UsageError(msg);
  }
  if (differs("dataset_contents") && !differs("datasets"))
    warnings.push_back("a dataset was edited since the checkpoint (its contents differ; datasets: " + show(now["datasets"]) +
                       "): the data cursor continues at the same rows of the new data, so this is not the run the "
                       "checkpoint continued exactly");
  for (auto it = now.begin(); it != now.end(); ++it) {
    const std::string& key = it.key();
    if (key == "base_model" || key == "base_model_identity" || key == "dataset_contents" || !s.recorded.contains(key)) continue;
    if (std::find(std::begin(kRefuse), std::end(kRefuse), key) != std::end(kRefuse)) continue;
    if (s.recorded[key] != it.value())
      warnings.push_back(key + " changed since the checkpoint (" + show(s.recorded[key]) + " -> " + show(it.value()) +
                         "); resuming with the new value");
  }
  return warnings;
}

// ---- output_dir ownership ---------------------------------------------------------------------

void check_output_dir_writable(const std::string& output_dir, const std::string& key) {
  std::error_code ec;
  fs::path p = fs::absolute(output_dir, ec);
  if (ec) p = output_dir;
  // The folder itself, or the nearest ancestor that exists (the run would create the rest).
  fs::path probe = p;
  while (!fs::exists(fs::symlink_status(probe, ec)) && probe.has_parent_path() && probe != probe.parent_path())
    probe = probe.parent_path();
  const std::string fix = "; choose another " + key + " or make it writable";
  if (!fs::is_directory(probe, ec))
    throw UsageError(key + " " + output_dir + ": " + probe.string() + " exists and is not a folder" + fix);
  if (::access(probe.c_str(), W_OK | X_OK) != 0)
    throw UsageError(key + " " + output_dir + " is not writable: " + probe.string() + ": " + std::strerror(errno) + fix);
  // access() is not enough (root ignores modes; some file systems refuse only at write): create
  // something. In a folder that does not exist yet, a probe folder in its nearest ancestor.
  if (probe != p) {
    const std::string d = (probe / (".eo-ddp-write-probe." + std::to_string(::getpid()))).string();
    if (::mkdir(d.c_str(), 0700) != 0)
      throw UsageError(key + " " + output_dir + " cannot be created in " + probe.string() + ": " + std::strerror(errno) + fix);
    ::rmdir(d.c_str());
    return;
  }
  const std::string file = (p / (".eo-ddp-write-probe." + std::to_string(::getpid()))).string();
  const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) throw UsageError(key + " " + output_dir + " is not writable: " + std::strerror(errno) + fix);
  const ssize_t w = ::write(fd, "x", 1);
  const int err = errno;
  ::close(fd);
  ::unlink(file.c_str());
  if (w != 1) throw UsageError(key + " " + output_dir + " is not writable: " + std::strerror(err) + fix);
}

namespace {

// Exclusive flocks for the life of the returned handle (the kernel drops them when the process
// dies, so a crashed run never leaves a stale lock): on output_dir itself (an fd of the folder,
// so deleting the lock file cannot let a second run in) and on output_dir/.eo-ddp.lock, which
// holds the holder's pid, host and start time for the message of the run that is refused. Where
// the file system cannot lock a folder, save_checkpoint checks instead that the lock file is
// still the one held (held_locks).
struct HeldLock {
  int file_fd = -1, dir_fd = -1;
};
std::mutex g_locks_mu;
std::map<std::string, HeldLock> g_locks;  // by output_dir as given to claim_output_dir

std::string read_holder(int fd) {
  std::string holder;
  char buf[512];
  const ssize_t n = fd < 0 ? 0 : ::pread(fd, buf, sizeof buf - 1, 0);
  if (n > 0) holder.assign(buf, static_cast<std::size_t>(n));
  if (const auto at = holder.find("held by "); at != std::string::npos) holder = holder.substr(at + 8);
  if (const auto nl = holder.find('\n'); nl != std::string::npos) holder.resize(nl);
  return holder;
}

[[noreturn]] void refuse_in_use(const std::string& output_dir, const std::string& path, const std::string& holder) {
  throw UsageError("output_dir " + output_dir + " is in use by another eo-ddp run (" +
                   (holder.empty() ? std::string("holder unknown") : holder) + "; lock " + path +
                   "). Two runs in one folder would overwrite each other's checkpoints. Wait for that run to end, "
                   "stop it, or choose another output_dir.");
}

std::shared_ptr<void> lock_output_dir(const std::string& output_dir) {
  const std::string path = (fs::path(output_dir) / kLockFile).string();
  const int dir_fd = ::open(output_dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  EO_CHECK(dir_fd >= 0, "cannot open ", output_dir, ": ", std::strerror(errno));
  bool dir_locked = true;
  if (::flock(dir_fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    if (err == EWOULDBLOCK) {
      const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
      const std::string holder = read_holder(fd);
      if (fd >= 0) ::close(fd);
      ::close(dir_fd);
      refuse_in_use(output_dir, output_dir + " itself", holder);
    }
    dir_locked = false;  // e.g. NFS: the lock file alone, checked at every save
  }
  const int fd = open_nofollow(path, O_RDWR | O_CREAT, 0644);
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    const std::string holder = read_holder(fd);
    ::close(fd);
    ::close(dir_fd);
    if (err == EWOULDBLOCK) refuse_in_use(output_dir, path, holder);
    EO_FAIL("cannot lock ", path, ": ", std::strerror(err));
  }
  const std::string me = "eo-ddp run lock: held by pid " + std::to_string(::getpid()) + " on host " + host_name() +
                         ", started " + now_text() +
                         "\nWhile that process runs, no other eo-ddp run may use this folder. The lock ends with the "
                         "process; this file is left behind and is harmless then (deleting it is too).\n";
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, me.data(), me.size(), 0) != static_cast<ssize_t>(me.size())) {
    const int err = errno;
    ::close(fd);
    ::close(dir_fd);
    EO_FAIL("cannot write ", path, ": ", std::strerror(err));
  }
  {
    std::lock_guard<std::mutex> lk(g_locks_mu);
    g_locks[output_dir] = {fd, dir_locked ? dir_fd : -1};
  }
  if (!dir_locked) ::close(dir_fd);
  return std::shared_ptr<void>(new HeldLock{fd, dir_locked ? dir_fd : -1}, [output_dir](void* p) {
    auto* h = static_cast<HeldLock*>(p);
    {
      std::lock_guard<std::mutex> lk(g_locks_mu);
      g_locks.erase(output_dir);
    }
    ::close(h->file_fd);  // releases the flocks
    if (h->dir_fd >= 0) ::close(h->dir_fd);
    delete h;
  });
}

void check_lock_still_held(const std::string& output_dir) {
  std::lock_guard<std::mutex> lk(g_locks_mu);
  const auto it = g_locks.find(output_dir);
  if (it == g_locks.end() || it->second.dir_fd >= 0) return;
  const std::string path = (fs::path(output_dir) / kLockFile).string();
  struct stat held {}, now {};
  if (::fstat(it->second.file_fd, &held) == 0 && ::lstat(path.c_str(), &now) == 0 && held.st_dev == now.st_dev &&
      held.st_ino == now.st_ino)
    return;
  EO_FAIL("the lock file ", path, " was deleted or replaced during this run, and this file system cannot lock the folder "
          "itself: another run may be using ", output_dir, " now. Not saving into it; check for another run there, then "
          "resume (resume_from_checkpoint: auto)");
}

}  // namespace

RunClaim claim_output_dir(const TrainConfig& cfg) {
  const std::string& dir = cfg.output_dir;
  check_output_dir_writable(dir);
  fs::create_directories(dir);
  RunClaim claim;
  claim.lock = lock_output_dir(dir);
  recover_interrupted_saves(dir);

  // Which checkpoint this segment continues.
  std::string resume = cfg.resume_from_checkpoint;
  if (resume == "auto") {
    resume = latest_checkpoint(dir).value_or("");
    claim.notes.push_back(resume.empty() ? "resume_from_checkpoint: auto found no checkpoint of this run in " + dir +
                                               "; starting fresh"
                                         : "resume_from_checkpoint: auto -> " + resume);
  }
  json lineage = json::array();
  const std::string segment = random_id();
  if (!resume.empty()) {
    const TrainingState s = load_checkpoint(resume, /*with_tensors=*/false);
    // Before run.json changes: a refused resume must not move the lineage that `auto` follows.
    claim.warnings = check_resume_compatible(s, cfg);
    claim.run_id = s.run_id;
    if (!s.run_id.empty() && s.lineage.is_array()) lineage = s.lineage;
    lineage.push_back({{"segment", segment}, {"start_step", s.step}});
  } else {
    lineage.push_back({{"segment", segment}, {"start_step", 0}});
  }
  if (claim.run_id.empty()) claim.run_id = random_id();
  claim.resume = resume;

  // Another run's checkpoints (or a run file naming another run) in this folder.
  std::vector<std::string> foreign;
  // Checkpoints without a run id (older eo-ddp) are foreign to a fresh run only: resuming one of
  // them adopts the folder.
  for (const auto& f : complete_checkpoints(dir, /*verify=*/true)) {
    const std::string id = f.state.value("run_id", std::string());
    if (id.empty() ? resume.empty() : id != claim.run_id) foreign.push_back(f.dir.filename().string());
  }
  // Resuming the run that run.json names: the folder is already this run's (another run's
  // checkpoints in it were accepted by overwrite_output_dir when it started).
  const std::optional<json> owner = read_run_file(dir);
  const bool owns = !resume.empty() && owner && (*owner)["run_id"].get<std::string>() == claim.run_id;
  if (!foreign.empty() && !cfg.overwrite_output_dir && !owns && cfg.resume_from_checkpoint == "auto")
    throw UsageError("output_dir " + dir + " holds checkpoints of another run (" + join(foreign, ", ") + ") and "
                     "resume_from_checkpoint: auto found no checkpoint of the run that " + dir + "/run.json names" +
                     (owner ? " (run id " + (*owner)["run_id"].get<std::string>() + ")" : std::string()) +
                     (owner ? ", which may have been edited or replaced" : std::string()) +
                     ". Name the checkpoint to continue (resume_from_checkpoint: " + dir + "/checkpoint-<step>), "
                     "choose another output_dir, or set overwrite_output_dir: true to start a fresh run here.");
  if (!foreign.empty() && !cfg.overwrite_output_dir && !owns) {
    const std::string what = "checkpoints of another run (" + join(foreign, ", ") + ")";
    throw UsageError("output_dir " + dir + " holds " + what + (resume.empty() ? std::string() : ", not of the run of " + resume) +
                     ". A run here would mix its checkpoints with them (and `auto` could later resume the wrong one). "
                     "Either continue that run (resume_from_checkpoint: auto), choose another output_dir, or set "
                     "overwrite_output_dir: true to start this run here anyway (the other run's checkpoints are then "
                     "left in place, never pruned and never resumed).");
  }
  if (!foreign.empty())
    claim.warnings.push_back((owns && !cfg.overwrite_output_dir ? std::string("resuming the run of run.json: ") : "overwrite_output_dir: true: ") + dir + " holds checkpoints of another run (" + join(foreign, ", ") +
                          "); they are left in place and not part of this run");
  json run = {{"format", "eo-ddp-run-1"}, {"run_id", claim.run_id}, {"lineage", lineage}};
  write_file_atomic((fs::path(dir) / kRunFile).string(), run.dump(2) + "\n");
  return claim;
}

std::string resume_folder(const TrainConfig& cfg) {
  if (cfg.resume_from_checkpoint != "auto") return cfg.resume_from_checkpoint;
  const auto latest = latest_checkpoint(cfg.output_dir);
  if (!latest) log::info("resume_from_checkpoint: auto found no checkpoint in " + cfg.output_dir + "; starting fresh");
  return latest.value_or("");
}

TrainingState resume_lora(const std::string& folder, const NamedTensors& lora) {
  TrainingState s = load_checkpoint(folder);
  std::map<std::string, at::Tensor> saved(s.lora.begin(), s.lora.end());
  for (const auto& [n, p] : lora) {
    auto it = saved.find(n);
    EO_CHECK(it != saved.end(), "checkpoint ", folder, " has no tensor ", n, " (different model or lora_target_modules?)");
    EO_CHECK(it->second.sizes() == p.sizes(), "checkpoint ", folder, ": ", n, " has shape ", it->second.sizes(),
             ", the model ", p.sizes(), " (different lora_r?)");
    at::NoGradGuard ng;
    p.copy_(it->second);
  }
  EO_CHECK(saved.size() == lora.size(), "checkpoint ", folder, " has ", saved.size(), " LoRA tensors, the model ", lora.size());
  return s;
}

}  // namespace eo
