#include "runtime/train_state.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <ATen/ATen.h>

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

#include "common/error.h"
#include "common/fault_seam.h"
#include "common/files.h"
#include "common/log.h"
#include "common/text.h"
#include "models/lora.h"
#include "models/safetensors.h"
#include "runtime/config.h"

namespace eo {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

const char* kStateFile = "trainer_state.json";
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
  const bool ok = r.ec == std::errc() && r.ptr != begin && v >= 0 && v <= kMaxStep && std::isdigit(*begin) &&
                  (r.ptr == end || (suffix_allowed && *r.ptr == '-'));
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

// Every complete checkpoint-<step> folder of output_dir, oldest first.
std::vector<Found> complete_checkpoints(const std::string& output_dir) {
  std::vector<Found> out;
  std::error_code ec;
  if (!fs::is_directory(output_dir, ec)) return out;
  for (const auto& e : fs::directory_iterator(output_dir)) {
    const auto step = step_of(e.path());
    if (!step || !e.is_directory() || e.is_symlink() || !complete(e.path())) continue;
    json state;
    try {
      state = read_json_file(e.path() / kStateFile, "checkpoint " + e.path().string());
    } catch (const std::exception& ex) {
      log::warn(std::string("ignoring ") + ex.what());
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
    if (fin && complete(t) && !fs::exists(fs::symlink_status(*fin))) {
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

void write_adapter(const std::string& dir, const NamedTensors& lora, const TrainConfig& cfg) {
  fs::create_directories(dir);
  // peft's adapter_config.json; only peft_type is required to load, the rest documents the run.
  nlohmann::json c;
  c["peft_type"] = "LORA";
  c["task_type"] = "CAUSAL_LM";
  c["r"] = cfg.lora_r;
  c["lora_alpha"] = cfg.lora_alpha;
  c["lora_dropout"] = cfg.lora_dropout;
  c["target_modules"] = cfg.lora_target_modules;
  if (!cfg.lora_target_parameters.empty()) c["target_parameters"] = cfg.lora_target_parameters;
  c["bias"] = "none";
  c["use_rslora"] = cfg.peft_use_rslora;
  c["fan_in_fan_out"] = false;
  c["base_model_name_or_path"] = cfg.base_model;
  c["inference_mode"] = true;
  c["init_lora_weights"] = true;
  c["modules_to_save"] = nullptr;
  // peft's names and shapes: a stacked expert LoRA is written as its per-expert slices (cut on
  // the host, after one device copy per stacked tensor).
  NamedTensors stacked, cpu;
  for (const auto& [n, t] : lora) stacked.emplace_back(n, t.detach().to(at::kCPU));
  for (const auto& [n, t] : model::peft_lora_tensors(stacked)) cpu.emplace_back(n, t.contiguous());
  st::save((fs::path(dir) / "adapter_model.safetensors").string(), cpu);
  write_file_atomic((fs::path(dir) / "adapter_config.json").string(), c.dump(2) + "\n");
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
    EO_CHECK(read_file_nofollow(from.string(), bytes), "cannot read ", from.string(), " to copy it beside the adapter");
    write_file_atomic((fs::path(dir) / name).string(), bytes);
    copied.push_back(name);
  }
  return copied;
}

std::string save_checkpoint(const std::string& output_dir, const TrainingState& s, const TrainConfig& cfg, int keep) {
  fs::create_directories(output_dir);
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
    write_adapter(tmp_dir.string(), s.lora, cfg);
    st::save((tmp_dir / "optimizer.safetensors").string(), s.optimizer);
    // Test seam: die like kill -9 in the middle of a checkpoint write.
    if (faults::plan().kill_in_save == s.step) std::raise(SIGKILL);
    st::save((tmp_dir / "rng.safetensors").string(), s.rng);
    json j;
    j["step"] = s.step;
    j["data_cursor"] = s.data_cursor;
    j["extra"] = s.extra;
    j["world_size"] = s.world_size;
    j["format"] = "eo-ddp-checkpoint-1";
    if (run) {
      j["run_id"] = (*run)["run_id"];
      j["lineage"] = (*run)["lineage"];
    }
    j["config"] = recorded_config(cfg);
    // Written last: a folder with trainer_state.json has every other file complete.
    write_file_atomic((tmp_dir / kStateFile).string(), j.dump(2) + "\n");
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
  std::vector<Found> mine;
  for (auto& f : complete_checkpoints(output_dir))
    if (!run || belongs(f, *run)) mine.push_back(std::move(f));
  for (std::size_t i = 0; i + keep < mine.size(); ++i) remove_tree(mine[i].dir);
  return final_dir.string();
}

std::optional<std::string> latest_checkpoint(const std::string& output_dir) {
  const std::optional<json> run = read_run_file(output_dir);
  std::optional<std::string> found;
  for (const auto& f : complete_checkpoints(output_dir))
    if (!run || belongs(f, *run)) found = f.dir.string();
  return found;
}

TrainingState load_checkpoint(const std::string& folder, bool with_tensors) {
  const fs::path dir(folder);
  EO_CHECK(fs::exists(dir / kStateFile), "checkpoint ", folder, " is incomplete: no ", kStateFile,
           " (it was not finished; use an older checkpoint or resume_from_checkpoint: auto)");
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

// Identity of the base model's contents without reading all of it: config.json, then for every
// *.safetensors file its name, size and 16 windows of 4 KiB spread over the file (the header and
// samples of every region of the weights). A copy in another folder fingerprints the same; another
// checkpoint of the same shapes (a fine-tune) differs.
std::string base_model_fingerprint(const TrainConfig& cfg) {
  Fnv f;
  std::string text;
  if (read_file_nofollow((fs::path(cfg.base_model) / "config.json").string(), text)) f.add(text);
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

std::string base_model_identity(const TrainConfig& cfg) { return base_model_fingerprint(cfg); }

json recorded_config(const TrainConfig& cfg) {
  json datasets = json::array();
  for (const auto& d : cfg.datasets) datasets.push_back(d.path);
  return {{"base_model", cfg.base_model},
          {"base_model_fingerprint", base_model_fingerprint(cfg)},
          {"adapter", cfg.adapter},
          {"lora_r", cfg.lora_r},
          {"lora_alpha", cfg.lora_alpha},
          {"peft_use_rslora", cfg.peft_use_rslora},
          {"lora_target_modules", cfg.lora_target_modules},
          {"lora_target_parameters", cfg.lora_target_parameters},
          {"lora_dropout", cfg.lora_dropout},
          {"load_in_4bit", cfg.load_in_4bit},
          {"bnb_4bit_blocksize", cfg.bnb_4bit_blocksize},
          {"bnb_4bit_use_double_quant", cfg.bnb_4bit_use_double_quant},
          {"expert_quant", cfg.expert_quant},
          {"sequence_len", cfg.sequence_len},
          {"sample_packing", cfg.sample_packing},
          {"datasets", datasets},
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
                                  "lora_target_modules", "lora_target_parameters", "load_in_4bit", "bnb_4bit_blocksize",
                                  "bnb_4bit_use_double_quant", "expert_quant", "sequence_len",   "sample_packing"};
  std::vector<std::string> problems;
  auto differs = [&](const char* key) { return s.recorded.contains(key) && s.recorded[key] != now[key]; };
  if (differs("base_model_fingerprint")) {
    problems.push_back("base_model: the checkpoint was trained on " + show(s.recorded.value("base_model", json("?"))) +
                       " (fingerprint " + show(s.recorded["base_model_fingerprint"]) + "), this config's " + cfg.base_model +
                       " has other contents (fingerprint " + show(now["base_model_fingerprint"]) + ")");
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
  for (auto it = now.begin(); it != now.end(); ++it) {
    const std::string& key = it.key();
    if (key == "base_model" || key == "base_model_fingerprint" || !s.recorded.contains(key)) continue;
    if (std::find(std::begin(kRefuse), std::end(kRefuse), key) != std::end(kRefuse)) continue;
    if (s.recorded[key] != it.value())
      warnings.push_back(key + " changed since the checkpoint (" + show(s.recorded[key]) + " -> " + show(it.value()) +
                         "); resuming with the new value");
  }
  return warnings;
}

// ---- output_dir ownership ---------------------------------------------------------------------

void check_output_dir_writable(const std::string& output_dir) {
  std::error_code ec;
  fs::path p = fs::absolute(output_dir, ec);
  if (ec) p = output_dir;
  // The folder itself, or the nearest ancestor that exists (the run would create the rest).
  fs::path probe = p;
  while (!fs::exists(fs::symlink_status(probe, ec)) && probe.has_parent_path() && probe != probe.parent_path())
    probe = probe.parent_path();
  const std::string fix = "; choose another output_dir or make it writable";
  if (!fs::is_directory(probe, ec))
    throw UsageError("output_dir " + output_dir + ": " + probe.string() + " exists and is not a folder" + fix);
  if (::access(probe.c_str(), W_OK | X_OK) != 0)
    throw UsageError("output_dir " + output_dir + " is not writable: " + probe.string() + ": " + std::strerror(errno) + fix);
  // access() is not enough (root ignores modes; some file systems refuse only at write): create
  // something. In a folder that does not exist yet, a probe folder in its nearest ancestor.
  if (probe != p) {
    const std::string d = (probe / (".eo-ddp-write-probe." + std::to_string(::getpid()))).string();
    if (::mkdir(d.c_str(), 0700) != 0)
      throw UsageError("output_dir " + output_dir + " cannot be created in " + probe.string() + ": " + std::strerror(errno) + fix);
    ::rmdir(d.c_str());
    return;
  }
  const std::string file = (p / (".eo-ddp-write-probe." + std::to_string(::getpid()))).string();
  const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) throw UsageError("output_dir " + output_dir + " is not writable: " + std::strerror(errno) + fix);
  const ssize_t w = ::write(fd, "x", 1);
  const int err = errno;
  ::close(fd);
  ::unlink(file.c_str());
  if (w != 1) throw UsageError("output_dir " + output_dir + " is not writable: " + std::strerror(err) + fix);
}

namespace {

// Exclusive flock on output_dir/.eo-ddp.lock for the life of the returned handle (the kernel drops
// it when the process dies, so a crashed run never leaves a stale lock). The file holds the
// holder's pid, host and start time, for the message of the run that is refused.
std::shared_ptr<void> lock_output_dir(const std::string& output_dir) {
  const std::string path = (fs::path(output_dir) / kLockFile).string();
  const int fd = open_nofollow(path, O_RDWR | O_CREAT, 0644);
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    std::string holder;
    char buf[512];
    const ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
    if (n > 0) holder.assign(buf, static_cast<std::size_t>(n));
    while (!holder.empty() && (holder.back() == '\n' || holder.back() == ' ')) holder.pop_back();
    ::close(fd);
    if (err == EWOULDBLOCK)
      throw UsageError("output_dir " + output_dir + " is in use by another eo-ddp run (" +
                       (holder.empty() ? std::string("holder unknown") : holder) + "; lock " + path +
                       "). Two runs in one folder would overwrite each other's checkpoints. Wait for that run to end, "
                       "stop it, or choose another output_dir.");
    EO_FAIL("cannot lock ", path, ": ", std::strerror(err));
  }
  const std::string me = "pid " + std::to_string(::getpid()) + " on host " + host_name() + ", started " + now_text() + "\n";
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, me.data(), me.size(), 0) != static_cast<ssize_t>(me.size())) {
    const int err = errno;
    ::close(fd);
    EO_FAIL("cannot write ", path, ": ", std::strerror(err));
  }
  return std::shared_ptr<void>(new int(fd), [](void* p) {
    ::close(*static_cast<int*>(p));  // releases the flock
    delete static_cast<int*>(p);
  });
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
  for (const auto& f : complete_checkpoints(dir)) {
    const std::string id = f.state.value("run_id", std::string());
    if (id.empty() ? resume.empty() : id != claim.run_id) foreign.push_back(f.dir.filename().string());
  }
  if (!foreign.empty() && !cfg.overwrite_output_dir) {
    const std::string what = "checkpoints of another run (" + join(foreign, ", ") + ")";
    throw UsageError("output_dir " + dir + " holds " + what + (resume.empty() ? std::string() : ", not of the run of " + resume) +
                     ". A run here would mix its checkpoints with them (and `auto` could later resume the wrong one). "
                     "Either continue that run (resume_from_checkpoint: auto), choose another output_dir, or set "
                     "overwrite_output_dir: true to start this run here anyway (the other run's checkpoints are then "
                     "left in place, never pruned and never resumed).");
  }
  if (!foreign.empty())
    claim.warnings.push_back("overwrite_output_dir: true: " + dir + " holds checkpoints of another run (" + join(foreign, ", ") +
                          "); they are left in place and not part of this run");
  json run = {{"format", "eo-ddp-run-1"}, {"run_id", claim.run_id}, {"lineage", lineage}};
  write_file_atomic((fs::path(dir) / kRunFile).string(), run.dump(2) + "\n");
  return claim;
}

}  // namespace eo
