// Cache keys, the Python run and the cache folders of the axolotl formats. See prepare.h.
#include "runtime/data/prepare.h"
#include "runtime/data/build_paths.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>

#include "common/checksum.h"
#include "common/error.h"
#include "common/files.h"
#include "common/log.h"
#include "runtime/dataset_keys.h"
#include "runtime/signals.h"

namespace eo::data {
namespace {

namespace fs = std::filesystem;

// A file's FNV-1a fingerprint (common/checksum.h Fnv1a64), the hash the dataset cache's keys are
// made of; kept apart from hash_file, whose faster hash would change every key.
std::string fnv_fingerprint(const std::string& path) {
  if (const int fd = open_input_file(path, "dataset"); fd >= 0) ::close(fd);  // no FIFO or device
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UsageError("cannot read '" + path + "'");
  Fnv1a64 f;
  std::vector<char> buf(1 << 20);
  while (in) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    f.add(buf.data(), static_cast<std::size_t>(in.gcount()));
  }
  return f.hex();
}

// The tokenizer folder's files that can change tokens: everything but weights.
nlohmann::json hash_tokenizer(const std::string& dir) {
  static const std::vector<std::string> weights = {".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx"};
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    const std::string name = e.path().filename().string();
    const std::string ext = e.path().extension().string();
    if (std::find(weights.begin(), weights.end(), ext) != weights.end()) continue;
    if (name.size() > 11 && name.compare(name.size() - 11, 11, ".index.json") == 0) continue;
    names.push_back(name);
  }
  std::sort(names.begin(), names.end());
  nlohmann::json out = nlohmann::json::object();
  for (const auto& n : names) out[n] = fnv_fingerprint(dir + "/" + n);
  return out;
}

// The keys of one dataset entry that shape its tokens, as the tool reads them (empty = default).
nlohmann::json dataset_shape(const DatasetSpec& d) {
  nlohmann::json j = {{"type", d.type}};
  auto put = [&](const char* k, const std::string& v) {
    if (!v.empty()) j[k] = v;
  };
  put("field_messages", d.field_messages);
  put("message_field_role", d.message_field_role);
  put("message_field_content", d.message_field_content);
  put("message_field_training", d.message_field_training);
  put("train_on_eos", d.train_on_eos);
  put("chat_template", d.chat_template);
  put("chat_template_jinja", d.chat_template_jinja);
  put("field", d.field);
  if (!d.split.empty() && d.split != "train") j["split"] = d.split;
  put("train_on_eot", d.train_on_eot);
  if (d.type == "chat_template" && !d.fields_mapped) {  // axolotl's default reasoning_content mapping
    j["field_thinking"] = d.field_thinking.empty() ? "reasoning_content" : d.field_thinking;
    j["template_thinking_key"] = d.template_thinking_key.empty() ? "reasoning_content" : d.template_thinking_key;
  }
  if (d.roles_to_train) j["roles_to_train"] = *d.roles_to_train;
  if (!d.roles.empty()) {
    nlohmann::json r = nlohmann::json::object();
    for (const auto& [role, sources] : d.roles) r[role] = sources;
    j["roles"] = r;
  }
  if (d.drop_system_message) j["drop_system_message"] = true;
  return j;
}

// The data files a dataset's rows are read from, in order (a Hub dataset's snapshot files).
std::vector<std::string> files_of(const DatasetSpec& d) { return d.files.empty() ? std::vector<std::string>{d.path} : d.files; }

// The keys that pick a dataset's rows, beyond its files (seed only where shards shuffles).
nlohmann::json rows_shape(const DatasetSpec& d, std::int64_t seed) {
  nlohmann::json j = nlohmann::json::object();
  if (d.shards > 0) j = {{"shards", d.shards}, {"shards_idx", d.shards_idx}, {"seed", seed}};
  return j;
}

// The top-level keys the tool reads (the same for every dataset).
nlohmann::json global_shape(const TrainConfig& cfg, const std::string& tokenizer) {
  nlohmann::json special = nlohmann::json::object();
  for (const auto& [k, v] : cfg.special_tokens) special[k] = v;
  return {{"tokenizer", tokenizer},
          {"tokenizer_type", cfg.tokenizer_type.empty() ? nlohmann::json() : nlohmann::json(cfg.tokenizer_type)},
          {"trust_remote_code", cfg.trust_remote_code},
          {"special_tokens", special},
          {"train_on_inputs", cfg.train_on_inputs},
          {"eot_tokens", cfg.eot_tokens.empty() ? nlohmann::json() : nlohmann::json(cfg.eot_tokens)},
          {"chat_template", cfg.chat_template},
          {"chat_template_jinja", cfg.chat_template_jinja.empty() ? nlohmann::json() : nlohmann::json(cfg.chat_template_jinja)}};
}

const DatasetSpec& spec_of(const TrainConfig& cfg, const PreparedDataset& p) {
  return (p.test ? cfg.test_datasets : cfg.datasets).at(p.index);
}

std::string exe_dir() {
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  return ec ? std::string() : exe.parent_path().string();
}

bool executable(const std::string& path) { return !path.empty() && ::access(path.c_str(), X_OK) == 0; }

// `name` as execv needs it: itself if it has a slash, else the first executable on PATH.
std::string resolve_program(const std::string& name) {
  if (name.find('/') != std::string::npos) return name;
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "/usr/local/bin:/usr/bin:/bin";
  for (std::size_t b = 0; b <= dirs.size();) {
    std::size_t e = dirs.find(':', b);
    if (e == std::string::npos) e = dirs.size();
    const std::string cand = (e > b ? dirs.substr(b, e - b) : std::string(".")) + "/" + name;
    if (executable(cand) && fs::is_regular_file(cand)) return cand;
    b = e + 1;
  }
  return name;
}

// What the manifest records of data.jsonl: its hash, bytes and rows (and the tool's token count).
nlohmann::json describe_cache_file(const std::string& file) {
  std::uint64_t h = 0, bytes = 0;
  if (!eo::hash_file(file, h, bytes)) EO_FAIL("cannot read ", file, ": ", std::strerror(errno));
  std::ifstream in(file, std::ios::binary);
  std::int64_t rows = 0;
  for (std::string line; std::getline(in, line);) rows += line.empty() ? 0 : 1;
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(h));
  return {{"hash", hex}, {"bytes", bytes}, {"rows", rows}};
}

// Why the cache folder `dir` cannot be used as it is ("" when it can): data.jsonl must be a plain
// file (not a link to something else) with the hash and size its manifest recorded when it was
// built. A cache of an older eo-ddp (no record) is rebuilt too.
std::string cache_problem(const std::string& dir) {
  const std::string file = dir + "/data.jsonl";
  struct stat st {};
  if (::lstat(file.c_str(), &st) != 0) return "no data.jsonl";
  if (!S_ISREG(st.st_mode)) return "data.jsonl is not a plain file (a link?)";
  std::string text;
  if (!read_file_nofollow(dir + "/manifest.json", text)) return "no manifest.json";
  const nlohmann::json m = nlohmann::json::parse(text, nullptr, false);
  if (!m.is_object() || !m.contains("data") || !m["data"].is_object()) return "its manifest records no hash of data.jsonl (an older eo-ddp)";
  const nlohmann::json now = describe_cache_file(file);
  for (const char* k : {"bytes", "hash", "rows"})
    if (m["data"].value(k, nlohmann::json()) != now[k])
      return "data.jsonl changed after it was built (" + std::string(k) + " " + now[k].dump() + ", the manifest has " +
             m["data"].value(k, nlohmann::json()).dump() + ")";
  return "";
}

}  // namespace

// The tool runs in its own process group, so a terminal's Ctrl-C reaches eo-ddp alone, which
// ends the whole group on a stop request (Stopped) and on any failure; it also gets SIGTERM if
// eo-ddp dies without that chance (PR_SET_PDEATHSIG).
int run_tool(const std::vector<std::string>& argv, const std::string& stdout_path, std::string& error_line,
             const char* what) {
  const std::string program = resolve_program(argv[0]);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  int pipe_fd[2];
  if (::pipe2(pipe_fd, O_CLOEXEC) != 0) EO_FAIL("pipe: ", std::strerror(errno));
  const int out_fd = ::open(stdout_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (out_fd < 0) {
    ::close(pipe_fd[0]);
    ::close(pipe_fd[1]);
    EO_FAIL("cannot create ", stdout_path, ": ", std::strerror(errno));
  }
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid == 0) {  // only async-signal-safe calls until exec
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (::getppid() != parent) _exit(127);  // the parent is already gone
    ::dup2(out_fd, 1);
    ::dup2(pipe_fd[1], 2);
    ::execv(program.c_str(), args.data());
    const char msg[] = "error: cannot start eo-ddp's Python tool\n";
    ssize_t ignored = ::write(2, msg, sizeof msg - 1);
    (void)ignored;
    _exit(127);
  }
  const int fork_errno = errno;
  ::close(out_fd);
  ::close(pipe_fd[1]);
  if (pid < 0) {
    ::close(pipe_fd[0]);
    EO_FAIL("cannot start ", argv[0], ": ", std::strerror(fork_errno));
  }
  ::setpgid(pid, pid);  // also here: the group exists before any kill below, whoever runs first
  // The tool's exit status, after SIGKILL to anything left in its group. The group is signalled
  // while the tool is a zombie not yet reaped, so its id cannot have been reused.
  auto reap = [&](bool block) -> std::optional<int> {
    siginfo_t info {};
    while (::waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOWAIT | (block ? 0 : WNOHANG)) != 0)
      if (errno != EINTR) return std::nullopt;
    if (info.si_pid != pid) return std::nullopt;  // still running
    ::kill(-pid, SIGKILL);
    int status = 0;
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    return status;
  };
  auto end_group = [&] {
    ::kill(-pid, SIGTERM);
    for (int i = 0; i < 50; ++i, ::usleep(100000))  // 5 s to exit, then SIGKILL
      if (reap(false)) return;
    ::kill(-pid, SIGKILL);
    reap(true);
  };
  std::string pending;
  char buf[4096];
  try {
    for (;;) {
      // Polled, so a stop request is seen within 0.2 s whichever thread took the signal.
      struct pollfd pfd {pipe_fd[0], POLLIN, 0};
      const int ready = ::poll(&pfd, 1, 200);
      throw_if_stopped(what);
      if (ready <= 0) continue;
      const ssize_t n = ::read(pipe_fd[0], buf, sizeof buf);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      pending.append(buf, static_cast<std::size_t>(n));
      // A progress bar redraws its line after a carriage return: each redraw is a line here.
      for (std::size_t nl; (nl = pending.find_first_of("\r\n")) != std::string::npos;) {
        const std::string line = pending.substr(0, nl);
        pending.erase(0, nl + 1);
        if (line.empty()) continue;
        if (line.find("error:") != std::string::npos || line.find(": failed: ") != std::string::npos) error_line = line;
        log::info(line);
      }
    }
  } catch (...) {
    ::close(pipe_fd[0]);
    end_group();
    throw;
  }
  if (!pending.empty()) {
    if (pending.find("error:") != std::string::npos || pending.find(": failed: ") != std::string::npos) error_line = pending;
    log::info(pending);
  }
  ::close(pipe_fd[0]);
  const int status = reap(true).value_or(0);  // nothing of the tool's group outlives it
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  return 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
}

std::size_t PreparePlan::missing() const {
  return static_cast<std::size_t>(std::count_if(datasets.begin(), datasets.end(), [](const auto& d) { return !d.ready; }));
}

std::string find_python() {
  if (const char* env = std::getenv("EO_DDP_PYTHON"); env && *env) return env;
  if (const std::string built = build_python(); !built.empty() && executable(built)) return built;
  return "python3";
}

std::string find_tool(const std::string& name) {
  std::vector<std::string> looked;
  if (const char* env = std::getenv("EO_DDP_TOOLS_DIR"); env && *env) looked.push_back(std::string(env) + "/" + name);
  if (const std::string d = exe_dir(); !d.empty()) looked.push_back(d + "/../share/eo-ddp/tools/" + name);
  looked.push_back(std::string(build_source_dir()) + "/tools/" + name);
  for (const auto& p : looked)
    if (fs::is_regular_file(p)) return fs::weakly_canonical(p).string();
  std::string where;
  for (const auto& p : looked) where += "\n  " + p;
  EO_FAIL("cannot find eo-ddp's ", name, "; looked in:", where, "\n(install eo-ddp with cmake --install, or set EO_DDP_TOOLS_DIR)");
}

PreparePlan plan_preparation(const TrainConfig& cfg) {
  PreparePlan plan;
  plan.tokenizer = cfg.tokenizer_config.empty() ? cfg.base_model : cfg.tokenizer_config;
  std::vector<PreparedDataset> items;
  for (int test = 0; test < 2; ++test) {
    const auto& list = test ? cfg.test_datasets : cfg.datasets;
    for (std::size_t i = 0; i < list.size(); ++i)
      if (list[i].formatted()) {
        PreparedDataset p;
        p.test = test == 1;
        p.index = i;
        items.push_back(p);
      }
  }
  if (items.empty()) return plan;
  // Shared by every dataset: the tool's own rules, the tokenizer, the top-level keys.
  // The named chat templates the tool renders (tools/chat_templates): an edited one is a new cache.
  nlohmann::json templates = nlohmann::json::object();
  for (const auto& e : fs::directory_iterator(fs::path(find_tool("chat_templates/VERSION")).parent_path()))
    if (e.path().extension() == ".jinja") templates[e.path().filename().string()] = fnv_fingerprint(e.path().string());
  const nlohmann::json common = {{"tool", fnv_fingerprint(find_tool("prepare_data.py"))},
                                 {"templates", templates},
                                 {"tokenizer_files", hash_tokenizer(plan.tokenizer)},
                                 {"keys", global_shape(cfg, "")}};
  for (auto& p : items) {
    const DatasetSpec& d = spec_of(cfg, p);
    nlohmann::json data = nlohmann::json::array();
    for (const auto& f : files_of(d)) data.push_back(fnv_fingerprint(f));
    if (data.size() == 1) data = data[0];  // the key of a one-file dataset as before
    nlohmann::json shape = dataset_shape(d);
    shape.update(rows_shape(d, cfg.seed));
    const nlohmann::json material = {{"common", common}, {"data", data}, {"dataset", shape}};
    Fnv1a64 f;
    f.add(material.dump());
    p.key = f.hex();
    p.dir = (fs::path(cfg.dataset_prepared_path) / p.key).string();
    std::error_code ec;
    if (fs::exists(fs::symlink_status(p.dir, ec))) {
      const std::string why = cache_problem(p.dir);
      p.ready = why.empty();
      if (!p.ready)
        log::warn("dataset " + d.path + ": the cache in " + p.dir + " cannot be used (" + why + "); it is rebuilt");
    }
  }
  plan.datasets = std::move(items);
  return plan;
}

void run_preparation(const TrainConfig& cfg, PreparePlan& plan) {
  if (plan.missing() == 0) return;
  fs::create_directories(cfg.dataset_prepared_path);
  // The work folder names this host and process: one that a killed run of this host left (its
  // process gone) is removed here; another host's, which this host cannot see alive, is left.
  char host[256] = {0};
  ::gethostname(host, sizeof host - 1);
  const std::string mine = std::string(".tmp-prepare-") + host + "-";
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(cfg.dataset_prepared_path, ec)) {
    const std::string n = e.path().filename().string();
    if (n.rfind(mine, 0) != 0 || n.find_first_not_of("0123456789", mine.size()) != std::string::npos || n.size() == mine.size())
      continue;
    const long pid = std::strtol(n.c_str() + mine.size(), nullptr, 10);
    if (pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
      remove_tree(e.path().string());
      log::info("removed " + e.path().string() + ", left by a tokenising run that was killed");
    }
  }
  const std::string tmp = (fs::path(cfg.dataset_prepared_path) / (mine + std::to_string(::getpid()))).string();
  remove_tree(tmp);
  fs::create_directories(tmp);
  nlohmann::json spec = global_shape(cfg, plan.tokenizer);
  spec["dataset_defaults"] = dataset_key_defaults();  // the tool keeps no copy of them
  spec["datasets"] = nlohmann::json::array();
  std::vector<PreparedDataset*> todo;
  for (auto& p : plan.datasets) {
    if (p.ready) continue;
    const DatasetSpec& d = spec_of(cfg, p);
    nlohmann::json e = dataset_shape(d);
    e.update(rows_shape(d, cfg.seed));
    e["path"] = d.path;
    e["files"] = files_of(d);
    fs::create_directories(tmp + "/" + p.key);
    e["output"] = tmp + "/" + p.key + "/data.jsonl";
    spec["datasets"].push_back(e);
    todo.push_back(&p);
    log::info("tokenising " + d.path + " (type " + d.type + ") with the tokenizer of " + plan.tokenizer + " into " + p.dir);
  }
  write_file_atomic(tmp + "/spec.json", spec.dump(2));
  const std::vector<std::string> argv = {find_python(), find_tool("prepare_data.py"), tmp + "/spec.json"};
  log::info("running " + argv[0] + " " + argv[1]);
  std::string error_line;
  int rc = 0;
  try {
    rc = run_tool(argv, tmp + "/stats.json", error_line, "while tokenising the datasets");
  } catch (...) {  // a stop request: no half-written cache left behind
    remove_tree(tmp);
    throw;
  }
  if (rc != 0) {
    remove_tree(tmp);
    if (rc == 2 && !error_line.empty()) throw UsageError("datasets: " + error_line);
    // The tool named what failed: that, not a guess about the interpreter.
    if (error_line.find("prepare_data.py: failed: ") != std::string::npos) EO_FAIL("tokenising the datasets ", error_line);
    EO_FAIL("tokenising the datasets failed: ", argv[0], " ", argv[1], " exited with status ", rc,
            " (its messages are above; does ", argv[0], " have transformers? set EO_DDP_PYTHON to choose the interpreter)");
  }
  nlohmann::json stats;
  {
    std::string text;
    read_file_nofollow(tmp + "/stats.json", text);
    stats = nlohmann::json::parse(text, nullptr, false);
  }
  for (std::size_t i = 0; i < todo.size(); ++i) {
    PreparedDataset& p = *todo[i];
    const DatasetSpec& d = spec_of(cfg, p);
    nlohmann::json manifest = {{"source", d.path}, {"dataset", dataset_shape(d)}, {"keys", global_shape(cfg, plan.tokenizer)}};
    if (stats.is_object() && stats.contains("datasets") && i < stats["datasets"].size()) manifest["stats"] = stats["datasets"][i];
    manifest["data"] = describe_cache_file(tmp + "/" + p.key + "/data.jsonl");  // checked at every use
    if (manifest.contains("stats") && manifest["stats"].is_object() && manifest["stats"].contains("tokens"))
      manifest["data"]["tokens"] = manifest["stats"]["tokens"];
    write_file_atomic(tmp + "/" + p.key + "/manifest.json", manifest.dump(2) + "\n");
    std::error_code ec;
    if (fs::exists(fs::symlink_status(p.dir, ec)) && !cache_problem(p.dir).empty()) remove_tree(p.dir);  // the damaged one
    fs::rename(tmp + "/" + p.key, p.dir, ec);  // another run may have finished it meanwhile: keep theirs
    if (ec && !cache_problem(p.dir).empty())
      EO_FAIL("cannot move the prepared dataset into ", p.dir, ": ", ec.message());
    p.ready = true;
  }
  remove_tree(tmp);
}

void apply_preparation(TrainConfig& cfg, const PreparePlan& plan) {
  for (const auto& p : plan.datasets) (p.test ? cfg.test_datasets : cfg.datasets).at(p.index).prepared = p.file();
}

}  // namespace eo::data
