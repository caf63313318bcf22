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
#include "runtime/adapter_files.h"
#include "runtime/config.h"
#include "runtime/model_identity.h"
#include "runtime/output_dir.h"
#include "runtime/resume_check.h"

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
const char* kCheckpointPrefix = "checkpoint-";
const char* kTmpPrefix = ".tmp-checkpoint-";  // a save in progress (or one a crash interrupted)
const char* kOldPrefix = ".old-checkpoint-";  // a checkpoint being replaced by a new save of its step
// Where checkpoints of another run go that stood in this run's way (overwrite_output_dir, a step
// this run saves): kept, never pruned or resumed.
const char* kOtherRuns = "other-runs";
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

// Who wrote checkpoint folder `dir`: the run id its trainer_state.json records ("" when it has
// none or cannot be read: then it is not provably this run's either).
std::string writer_of(const fs::path& dir) {
  std::string text;
  if (!read_file_nofollow((dir / kStateFile).string(), text)) return "";
  try {
    const json j = json::parse(text);
    return j.is_object() ? j.value("run_id", std::string()) : std::string();
  } catch (const std::exception&) {
    return "";
  }
}

// Moves another run's checkpoint `dir` (in folder `root`, which the log calls `shown`) into
// root/other-runs/ under a name not taken yet: no run writes into, prunes or resumes it there.
void move_to_other_runs(const fs::path& root, const fs::path& dir, const std::string& shown, const std::string& why) {
  const fs::path others = root / kOtherRuns;
  std::error_code ec;
  fs::create_directory(others, ec);
  EO_CHECK(!ec || fs::is_directory(fs::symlink_status(others)), "cannot create ", shown, "/", kOtherRuns, ": ",
           ec.message());
  EO_CHECK(!fs::is_symlink(fs::symlink_status(others)), shown, "/", kOtherRuns, " is a symbolic link; remove it");
  const std::string base = dir.filename().string();
  const std::string id = writer_of(dir);
  std::string name = base + (id.empty() ? "" : "-run-" + id);
  for (int n = 2; fs::exists(fs::symlink_status(others / name)); ++n)
    name = base + (id.empty() ? "" : "-run-" + id) + "." + std::to_string(n);
  fs::rename(dir, others / name);
  fsync_path(others.string());
  fsync_path(root.string());
  log::warn("moved " + shown + "/" + base + " (written by " + (id.empty() ? std::string("another run") : "run " + id) +
            ") to " + shown + "/" + kOtherRuns + "/" + name + ": " + why + "; this run never writes into, prunes or "
            "resumes a checkpoint of another run");
}

std::string random_id() {
  std::random_device rd;
  std::mt19937_64 g((std::uint64_t(rd()) << 32) ^ rd() ^
                    static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()));
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(g()));
  return buf;
}

}  // namespace

std::string first_nonfinite(const NamedTensors& tensors) {
  for (const auto& [n, t] : tensors)
    if (t.defined() && t.is_floating_point() && !at::isfinite(t).all().item<bool>()) return n;
  return "";
}

std::string checkpoint_damage(const std::string& folder) { return damage(folder, /*state_only=*/false); }


std::string save_checkpoint(const std::string& output_dir, const TrainingState& s, const TrainConfig& cfg, int keep,
                            std::int64_t keep_newest_before) {
  // A checkpoint with NaN/Inf could only be resumed into more of them.
  for (const NamedTensors* part : {&s.lora, &s.optimizer})
    if (const std::string bad = first_nonfinite(*part); !bad.empty())
      EO_FAIL("not saving checkpoint-", s.step, " in ", output_dir, ": ", bad, " holds NaN/Inf values");
  fs::create_directories(output_dir);
  // Every file goes through the folder this run locked, never by its name (see held_output_dir).
  const std::string root = held_output_dir(output_dir);
  const std::string name = kCheckpointPrefix + std::to_string(s.step);
  const fs::path final_dir = fs::path(root) / name;
  const std::string suffix = std::to_string(s.step) + "-" + std::to_string(::getpid());
  const fs::path tmp_dir = fs::path(root) / (kTmpPrefix + suffix);
  const fs::path old_dir = fs::path(root) / (kOldPrefix + suffix);
  const std::optional<json> run = read_run_file(root);
  // Saves that died half-way (kill -9, node loss) are finished or dropped before this one starts,
  // so repeated crashes do not fill the disk with partial checkpoints.
  recover_interrupted_saves(root);
  // A folder of this step that another run wrote is never replaced: it moves to other-runs/.
  if (run && fs::exists(fs::symlink_status(final_dir)) && writer_of(final_dir) != (*run)["run_id"].get<std::string>())
    move_to_other_runs(root, final_dir, output_dir, "it is in the way of this run's " + name);
  try {
    fs::create_directories(tmp_dir);
    write_adapter(tmp_dir.string(), s.lora, adapter_record(cfg), s.extra.is_object() && s.extra.value(kMergeAwareOnKey, false));
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
      fsync_path(root);
      if (faults::plan().kill_in_replace == s.step) std::raise(SIGKILL);  // test seam
    }
    fs::rename(tmp_dir, final_dir);
    fsync_path(root);
    if (replacing) remove_tree(old_dir);
  } catch (const std::exception& e) {
    // Disk full, quota, I/O error: the new checkpoint is dropped whole; the previous ones are untouched.
    try {
      if (fs::exists(fs::symlink_status(old_dir)) && !fs::exists(fs::symlink_status(final_dir))) fs::rename(old_dir, final_dir);
      remove_tree(tmp_dir);
    } catch (...) {
    }
    // The error names files by the path written through (held_output_dir); the user knows output_dir.
    std::string why = e.what();
    if (root != output_dir)
      for (std::size_t at = why.find(root); at != std::string::npos; at = why.find(root, at + output_dir.size()))
        why.replace(at, root.size(), output_dir);
    EO_FAIL("cannot save checkpoint ", output_dir, "/", name, ": ", why, ". The previous checkpoints in ", output_dir,
            " are intact (resume_from_checkpoint: auto takes the newest); free space on that disk or choose another output_dir");
  }
  // Keep the newest `keep` checkpoints of this run's lineage; another run's are never touched.
  // The newest one before keep_newest_before is kept as well: the state from before the run's
  // first non-finite step, which a user may need to go back to.
  std::vector<Found> mine;
  for (auto& f : complete_checkpoints(root))
    if (!run || belongs(f, *run)) mine.push_back(std::move(f));
  std::optional<std::size_t> kept;
  for (std::size_t i = 0; i < mine.size(); ++i)
    if (mine[i].step < keep_newest_before) kept = i;
  for (std::size_t i = 0; i + keep < mine.size(); ++i)
    if (i != kept) remove_tree(mine[i].dir);
  return (fs::path(output_dir) / name).string();
}

std::optional<std::string> latest_checkpoint(const std::string& output_dir) {
  const std::optional<json> run = read_run_file(output_dir);
  std::vector<Found> mine;
  for (auto& f : complete_checkpoints(output_dir, /*verify=*/true)) {
    if (!run || belongs(f, *run)) {
      mine.push_back(std::move(f));
      continue;
    }
    const std::string id = f.state.value("run_id", std::string());
    warn_once("resume_from_checkpoint: auto ignores " + f.dir.string() + ": " +
              (id == (*run)["run_id"].get<std::string>()
                   ? std::string("a segment of this run that a later resume from an earlier step abandoned")
                   : "written by " + (id.empty() ? std::string("a run without a run id") : "run " + id) +
                         ", not by the run of run.json (" + (*run)["run_id"].get<std::string>() + ")"));
  }
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


RunClaim claim_output_dir(const TrainConfig& cfg, int world_size) {
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
    claim.warnings = check_resume_compatible(s, cfg, world_size);
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
  std::vector<fs::path> foreign_dirs;
  // Checkpoints without a run id (older eo-ddp) are foreign to a fresh run only: resuming one of
  // them adopts the folder.
  for (const auto& f : complete_checkpoints(dir, /*verify=*/true)) {
    const std::string id = f.state.value("run_id", std::string());
    if (id.empty() ? resume.empty() : id != claim.run_id) {
      foreign.push_back(f.dir.filename().string());
      foreign_dirs.push_back(f.dir);
    }
  }
  // Resuming the run that run.json names: the folder is already this run's.
  const std::optional<json> owner = read_run_file(dir);
  const bool owns = !resume.empty() && owner && (*owner)["run_id"].get<std::string>() == claim.run_id;
  // `auto` found nothing, yet the run of run.json has checkpoints here: every one is damaged
  // (each named in a warning above), which is not another run's doing.
  if (owner && resume.empty() && cfg.resume_from_checkpoint == "auto" && !cfg.overwrite_output_dir) {
    std::vector<std::string> damaged;
    for (const auto& f : complete_checkpoints(dir))
      if (belongs(f, *owner)) damaged.push_back(f.dir.filename().string());
    if (!damaged.empty())
      throw UsageError("resume_from_checkpoint: auto: every checkpoint of the run in " + dir + " (" + join(damaged, ", ") +
                       ") is damaged (the warnings above say how), so there is none to continue. Restore one from a "
                       "copy, or set overwrite_output_dir: true to start a fresh run here (the damaged ones are then "
                       "moved to " + dir + "/" + kOtherRuns + "/).");
  }
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
                     "moved to " + dir + "/" + kOtherRuns + "/, never written into, pruned or resumed).");
  }
  if (!foreign.empty() && owns && !cfg.overwrite_output_dir) {
    claim.warnings.push_back("resuming the run of run.json: " + dir + " holds checkpoints of another run (" +
                             join(foreign, ", ") + "); they are not part of this run: `auto` never resumes them, "
                             "pruning never counts them, and a save at one of their steps moves it to " + dir + "/" +
                             kOtherRuns + "/ first");
  } else if (!foreign.empty()) {
    // overwrite_output_dir: the folder becomes this run's; the other run's checkpoints are kept,
    // out of its way, where no run writes, prunes or resumes.
    for (const auto& f : foreign_dirs)
      move_to_other_runs(dir, f, dir, "overwrite_output_dir: true starts a fresh run in " + dir);
    claim.warnings.push_back("overwrite_output_dir: true: moved " + std::to_string(foreign.size()) +
                             " checkpoint(s) of another run (" + join(foreign, ", ") + ") to " + dir + "/" + kOtherRuns +
                             "/; this run starts fresh in " + dir);
  }
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
