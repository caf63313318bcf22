#include "runtime/train_state.h"

#include <fcntl.h>
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "common/error.h"
#include "common/files.h"
#include "models/lora.h"
#include "models/safetensors.h"
#include "runtime/config.h"

namespace eo {
namespace fs = std::filesystem;

namespace {

const char* kStateFile = "trainer_state.json";
const char* kCheckpointPrefix = "checkpoint-";

std::map<std::string, at::Tensor> load_all(const std::string& path) {
  std::map<std::string, at::Tensor> out;
  auto f = st::File::open(path);
  for (const auto& t : f->tensors()) out[t.name] = f->load(t.name);
  return out;
}

NamedTensors as_list(const std::map<std::string, at::Tensor>& m) { return NamedTensors(m.begin(), m.end()); }

std::int64_t step_of(const fs::path& p) {
  const std::string n = p.filename().string();
  if (n.rfind(kCheckpointPrefix, 0) != 0) return -1;
  const std::string digits = n.substr(std::strlen(kCheckpointPrefix));
  if (digits.empty() || !std::all_of(digits.begin(), digits.end(), ::isdigit)) return -1;
  return std::stoll(digits);
}

void remove_tree(const fs::path& p) { eo::remove_tree(p.string()); }  // common/files.h: not std::filesystem

}  // namespace

void fsync_path(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  EO_CHECK(fd >= 0, "cannot open ", path, " to sync it: ", std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  EO_CHECK(rc == 0, "fsync of ", path, " failed: ", std::strerror(err));
}

void write_file_atomic(const std::string& path, const std::string& contents) {
  // POSIX calls, each checked: a full disk (ENOSPC), a file-size limit (EFBIG) or an I/O error
  // surfaces at write, fsync or close, and must leave no file under the final name.
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  EO_CHECK(fd >= 0, "cannot create ", tmp, ": ", std::strerror(errno));
  auto fail = [&](const char* what, int err) {
    ::close(fd);
    ::unlink(tmp.c_str());
    EO_FAIL(what, " ", tmp, " failed: ", std::strerror(err));
  };
  const char* p = contents.data();
  std::size_t left = contents.size();
  while (left > 0) {
    const ssize_t w = ::write(fd, p, left);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) fail("writing", w < 0 ? errno : EIO);
    p += w;
    left -= static_cast<std::size_t>(w);
  }
  if (::fsync(fd) != 0) fail("fsync of", errno);
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    EO_FAIL("closing ", tmp, " failed: ", std::strerror(err));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    EO_FAIL("cannot rename ", tmp, " to ", path, ": ", std::strerror(err));
  }
  fsync_path(fs::path(path).parent_path().empty() ? "." : fs::path(path).parent_path().string());
}

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
}

std::string save_checkpoint(const std::string& output_dir, const TrainingState& s, const TrainConfig& cfg, int keep) {
  fs::create_directories(output_dir);
  const fs::path final_dir = fs::path(output_dir) / (kCheckpointPrefix + std::to_string(s.step));
  const fs::path tmp_dir = fs::path(output_dir) / (".tmp-" + final_dir.filename().string() + "-" + std::to_string(::getpid()));
  // Temporary folders of saves that died half-way (kill -9, node loss) are never resumed from:
  // drop them (this one's included) so repeated crashes do not fill the disk with partial checkpoints.
  for (const auto& e : fs::directory_iterator(output_dir))
    if (e.path().filename().string().rfind(std::string(".tmp-") + kCheckpointPrefix, 0) == 0) remove_tree(e.path());
  try {
    fs::create_directories(tmp_dir);
    write_adapter(tmp_dir.string(), s.lora, cfg);
    st::save((tmp_dir / "optimizer.safetensors").string(), s.optimizer);
    // Fault injection for tests: die like kill -9 in the middle of a checkpoint write.
    if (const char* crash = std::getenv("EO_DDP_FAULT_KILL_IN_SAVE"); crash && std::to_string(s.step) == crash)
      std::raise(SIGKILL);
    st::save((tmp_dir / "rng.safetensors").string(), s.rng);
    nlohmann::json j;
    j["step"] = s.step;
    j["data_cursor"] = s.data_cursor;
    j["extra"] = s.extra;
    j["world_size"] = s.world_size;
    j["format"] = "eo-ddp-checkpoint-1";
    // Written last: a folder with trainer_state.json has every other file complete.
    write_file_atomic((tmp_dir / kStateFile).string(), j.dump(2) + "\n");
    fsync_path(tmp_dir.string());
    // Replace an existing checkpoint of the same step (re-run after resume) only once the new one is whole.
    remove_tree(final_dir);
    fs::rename(tmp_dir, final_dir);
    fsync_path(output_dir);
  } catch (const std::exception& e) {
    // Disk full, quota, I/O error: the new checkpoint is dropped whole; the previous ones are untouched.
    try {
      remove_tree(tmp_dir);
    } catch (...) {
    }
    EO_FAIL("cannot save checkpoint ", final_dir.string(), ": ", e.what(), ". The previous checkpoints in ", output_dir,
            " are intact (resume_from_checkpoint: auto takes the newest); free space on that disk or choose another output_dir");
  }
  // Keep the newest `keep` checkpoints.
  std::vector<std::pair<std::int64_t, fs::path>> all;
  for (const auto& e : fs::directory_iterator(output_dir))
    if (e.is_directory() && step_of(e.path()) >= 0) all.emplace_back(step_of(e.path()), e.path());
  std::sort(all.begin(), all.end());
  for (std::size_t i = 0; i + keep < all.size(); ++i) remove_tree(all[i].second);
  return final_dir.string();
}

std::optional<std::string> latest_checkpoint(const std::string& output_dir) {
  if (!fs::is_directory(output_dir)) return std::nullopt;
  std::int64_t best = -1;
  std::optional<std::string> found;
  for (const auto& e : fs::directory_iterator(output_dir)) {
    const std::int64_t step = step_of(e.path());
    if (step > best && e.is_directory() && fs::exists(e.path() / kStateFile)) {
      best = step;
      found = e.path().string();
    }
  }
  return found;
}

TrainingState load_checkpoint(const std::string& folder) {
  const fs::path dir(folder);
  EO_CHECK(fs::exists(dir / kStateFile), "checkpoint ", folder, " is incomplete: no ", kStateFile,
           " (it was not finished; use an older checkpoint or resume_from_checkpoint: auto)");
  std::ifstream in(dir / kStateFile);
  nlohmann::json j;
  try {
    in >> j;
  } catch (const std::exception& e) {
    EO_FAIL("checkpoint ", folder, ": ", kStateFile, " is not valid JSON: ", e.what());
  }
  TrainingState s;
  try {
    s.step = j.at("step").get<std::int64_t>();
    s.data_cursor = j.at("data_cursor");
    s.extra = j.value("extra", nlohmann::json::object());
    s.world_size = j.value("world_size", 1);
  } catch (const std::exception& e) {
    EO_FAIL("checkpoint ", folder, ": ", kStateFile, " is missing fields: ", e.what());
  }
  // The adapter is stored in peft's per-expert form (write_adapter); the model trains it stacked.
  s.lora = model::stack_expert_lora(as_list(load_all((dir / "adapter_model.safetensors").string())));
  s.optimizer = as_list(load_all((dir / "optimizer.safetensors").string()));
  s.rng = as_list(load_all((dir / "rng.safetensors").string()));
  return s;
}

}  // namespace eo
