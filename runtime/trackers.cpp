#include "runtime/trackers.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <thread>

#include "common/files.h"
#include "common/log.h"
#include "runtime/config.h"
#include "runtime/data/prepare.h"

namespace eo {

namespace fs = std::filesystem;

namespace {

// How long the W&B side process may take to log what is left and finish after the last step
// (an offline run needs a second or two; a network sync more) before it is ended.
constexpr int kWandbFinishSeconds = 60;

const std::array<std::uint32_t, 256>& crc_table() {
  static const std::array<std::uint32_t, 256> t = [] {
    std::array<std::uint32_t, 256> out{};
    for (std::uint32_t i = 0; i < 256; ++i) {
      std::uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;  // reflected Castagnoli
      out[i] = c;
    }
    return out;
  }();
  return t;
}

// Protocol buffers' wire format, the little of it an Event needs.
void varint(std::string& out, std::uint64_t v) {
  while (v >= 0x80) {
    out += static_cast<char>((v & 0x7F) | 0x80);
    v >>= 7;
  }
  out += static_cast<char>(v);
}
void key(std::string& out, int field, int wire_type) { varint(out, (static_cast<std::uint64_t>(field) << 3) | wire_type); }
void fixed(std::string& out, const void* p, std::size_t n) { out.append(static_cast<const char*>(p), n); }  // little-endian hosts
void bytes_field(std::string& out, int field, const std::string& v) {
  key(out, field, 2);
  varint(out, v.size());
  out += v;
}

// Event { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
// Summary { repeated Value value = 1; }  Value { string tag = 1; float simple_value = 2; }
std::string event(double wall_time, std::int64_t step, const std::string* file_version,
                  const std::vector<std::pair<std::string, double>>* values) {
  std::string e;
  key(e, 1, 1);
  fixed(e, &wall_time, 8);
  if (step != 0) {
    key(e, 2, 0);
    varint(e, static_cast<std::uint64_t>(step));
  }
  if (file_version) bytes_field(e, 3, *file_version);
  if (values) {
    std::string summary;
    for (const auto& [tag, v] : *values) {
      std::string value;
      bytes_field(value, 1, tag);
      const float f = static_cast<float>(v);
      key(value, 2, 5);
      fixed(value, &f, 4);
      bytes_field(summary, 1, value);
    }
    bytes_field(e, 5, summary);
  }
  return e;
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

void flatten(const std::string& prefix, const nlohmann::json& j, std::vector<std::pair<std::string, double>>& out) {
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string tag = prefix.empty() ? it.key() : prefix + "/" + it.key();
    if (it->is_object()) flatten(tag, *it, out);
    else if (it->is_boolean()) out.emplace_back(tag, it->get<bool>() ? 1.0 : 0.0);
    else if (it->is_number()) out.emplace_back(tag, it->get<double>());
  }
}

}  // namespace

std::uint32_t crc32c(const void* data, std::size_t size) {
  const auto& t = crc_table();
  std::uint32_t c = 0xFFFFFFFFu;
  const auto* p = static_cast<const std::uint8_t*>(data);
  for (std::size_t i = 0; i < size; ++i) c = t[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

std::uint32_t masked_crc32c(const void* data, std::size_t size) {
  const std::uint32_t c = crc32c(data, size);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

std::vector<std::pair<std::string, double>> scalar_fields(const nlohmann::json& line) {
  std::vector<std::pair<std::string, double>> out;
  if (line.is_object()) flatten("", line, out);
  return out;
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir) {
  fs::create_directories(dir);
  char host[256] = "localhost";
  ::gethostname(host, sizeof host - 1);
  const double t = now_s();
  path_ = (fs::path(dir) / ("events.out.tfevents." + std::to_string(static_cast<long long>(t)) + "." + host + "." +
                            std::to_string(::getpid())))
              .string();
  fd_ = open_nofollow(path_, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  const std::string version = "brain.Event:2";
  record(event(t, 0, &version, nullptr));
}

TensorBoardWriter::~TensorBoardWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void TensorBoardWriter::scalars(std::int64_t step, double wall_time, const std::vector<std::pair<std::string, double>>& values) {
  record(event(wall_time, step, nullptr, &values));
}

// TFRecord: uint64 length, masked crc of the length, the data, masked crc of the data.
void TensorBoardWriter::record(const std::string& data) {
  std::string r;
  const std::uint64_t n = data.size();
  fixed(r, &n, 8);
  const std::uint32_t len_crc = masked_crc32c(&n, 8), data_crc = masked_crc32c(data.data(), data.size());
  fixed(r, &len_crc, 4);
  r += data;
  fixed(r, &data_crc, 4);
  write_all(fd_, r.data(), r.size(), path_);
}

Trackers::Trackers(const TrainConfig& cfg, const std::string& metrics_path) {
  if (cfg.use_tensorboard) {
    try {
      tensorboard_ = std::make_unique<TensorBoardWriter>((fs::path(cfg.output_dir) / "runs").string());
      log::info("use_tensorboard: TensorBoard events in " + tensorboard_->path());
    } catch (const std::exception& e) {
      log::warn(std::string("use_tensorboard: cannot write TensorBoard events (") + e.what() + "); training goes on without them");
    }
  }
  if (cfg.wandb_project.empty()) return;
  std::vector<std::string> argv;
  try {
    argv = {data::find_python(), data::find_tool("wandb_follow.py"), "--metrics", metrics_path, "--project", cfg.wandb_project,
            "--dir", cfg.output_dir, "--mode", cfg.wandb_mode};
  } catch (const std::exception& e) {
    log::warn(std::string("wandb_project: cannot start the W&B logger (") + e.what() + "); training goes on without it");
    return;
  }
  for (const auto& [flag, value] : {std::pair<const char*, const std::string*>{"--entity", &cfg.wandb_entity},
                                    {"--name", &cfg.wandb_name}, {"--run-id", &cfg.wandb_run_id}})
    if (!value->empty()) argv.insert(argv.end(), {flag, *value});
  wandb_log_ = (fs::path(cfg.output_dir) / "wandb_follow.log").string();
  int pipe_fds[2];
  if (::pipe2(pipe_fds, O_CLOEXEC) != 0) {
    log::warn(std::string("wandb_project: cannot start the W&B logger (pipe: ") + std::strerror(errno) + ")");
    return;
  }
  std::vector<char*> args;
  for (auto& a : argv) args.push_back(a.data());
  args.push_back(nullptr);
  const int out = ::open(wandb_log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644);
  const pid_t pid = ::fork();
  if (pid == 0) {
    // Its own process group: a Ctrl-C at the terminal stops training (which saves) but not the
    // logger's last lines; it ends with eo-ddp should eo-ddp die.
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    ::dup2(pipe_fds[0], 0);
    if (out >= 0) {
      ::dup2(out, 1);
      ::dup2(out, 2);
    }
    ::execvp(args[0], args.data());
    ::_exit(127);
  }
  ::close(pipe_fds[0]);
  if (out >= 0) ::close(out);
  if (pid < 0) {
    ::close(pipe_fds[1]);
    log::warn(std::string("wandb_project: cannot start the W&B logger (fork: ") + std::strerror(errno) + ")");
    return;
  }
  wandb_pid_ = pid;
  wandb_stdin_ = pipe_fds[1];
  log::info("wandb_project: " + cfg.wandb_project + " (mode " + cfg.wandb_mode + "), logged by a side process following " +
            metrics_path + " (its log: " + wandb_log_ + ")");
}

void Trackers::log(const nlohmann::json& line) {
  if (!tensorboard_) return;  // W&B reads metrics.jsonl itself
  try {
    tensorboard_->scalars(line.value("step", std::int64_t{0}), now_s(), scalar_fields(line));
  } catch (const std::exception& e) {
    log::warn(std::string("use_tensorboard: cannot append to the TensorBoard events (") + e.what() +
              "); training goes on without them");
    tensorboard_.reset();
  }
}

Trackers::~Trackers() {
  if (wandb_pid_ <= 0) return;
  ::close(wandb_stdin_);  // end of training: the side process logs what is left and finishes
  int status = 0;
  pid_t done = 0;
  for (int i = 0; i < kWandbFinishSeconds * 10 && (done = ::waitpid(wandb_pid_, &status, WNOHANG)) == 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  if (done == 0) {
    ::kill(-wandb_pid_, SIGKILL);
    ::waitpid(wandb_pid_, &status, 0);
    log::warn("wandb_project: the W&B logger did not finish within " + std::to_string(kWandbFinishSeconds) +
              " s of the last step and was ended; the run's metrics are in metrics.jsonl (its log: " + wandb_log_ + ")");
  } else if (done > 0 && !(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
    log::warn("wandb_project: the W&B logger failed (see " + wandb_log_ + "); the run's metrics are in metrics.jsonl");
  }
}

}  // namespace eo
