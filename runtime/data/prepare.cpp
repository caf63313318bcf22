// Cache keys, the Python run and the cache folders of the axolotl formats. See prepare.h.
#include "runtime/data/prepare.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "common/files.h"
#include "common/log.h"

extern char** environ;

namespace eo::data {
namespace {

namespace fs = std::filesystem;

// FNV-1a, 64 bits: a stable content fingerprint (not a defence against crafted collisions; the
// cache is the user's own).
struct Fnv {
  std::uint64_t h = 1469598103934665603ull;
  void add(const void* data, std::size_t n) {
    const auto* p = static_cast<const unsigned char*>(data);
    for (std::size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  }
  void add(const std::string& s) { add(s.data(), s.size()); }
  std::string hex() const {
    char buf[17];
    std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
    return buf;
  }
};

std::string hash_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UsageError("cannot read '" + path + "'");
  Fnv f;
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
  for (const auto& n : names) out[n] = hash_file(dir + "/" + n);
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

// Runs argv, stdout to `stdout_path`, stderr line by line to our log; returns the exit status
// and the tool's last error line.
int run_tool(const std::vector<std::string>& argv, const std::string& stdout_path, std::string& error_line) {
  int pipe_fd[2];
  if (::pipe2(pipe_fd, O_CLOEXEC) != 0) EO_FAIL("pipe: ", std::strerror(errno));
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, stdout_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&fa, pipe_fd[1], 2);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = 0;
  const int rc = ::posix_spawnp(&pid, args[0], &fa, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  ::close(pipe_fd[1]);
  if (rc != 0) {
    ::close(pipe_fd[0]);
    EO_FAIL("cannot start ", argv[0], ": ", std::strerror(rc), " (set EO_DDP_PYTHON to a Python with transformers)");
  }
  std::string pending;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(pipe_fd[0], buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    pending.append(buf, static_cast<std::size_t>(n));
    for (std::size_t nl; (nl = pending.find('\n')) != std::string::npos;) {
      const std::string line = pending.substr(0, nl);
      pending.erase(0, nl + 1);
      if (line.find("error:") != std::string::npos) error_line = line;
      log::info(line);
    }
  }
  if (!pending.empty()) {
    if (pending.find("error:") != std::string::npos) error_line = pending;
    log::info(pending);
  }
  ::close(pipe_fd[0]);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  return 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
}

}  // namespace

std::size_t PreparePlan::missing() const {
  return static_cast<std::size_t>(std::count_if(datasets.begin(), datasets.end(), [](const auto& d) { return !d.ready; }));
}

std::string find_python() {
  if (const char* env = std::getenv("EO_DDP_PYTHON"); env && *env) return env;
#ifdef EO_DDP_PYTHON_DEFAULT
  if (executable(EO_DDP_PYTHON_DEFAULT)) return EO_DDP_PYTHON_DEFAULT;
#endif
  return "python3";
}

std::string find_tool(const std::string& name) {
  std::vector<std::string> looked;
  if (const char* env = std::getenv("EO_DDP_TOOLS_DIR"); env && *env) looked.push_back(std::string(env) + "/" + name);
  if (const std::string d = exe_dir(); !d.empty()) looked.push_back(d + "/../share/eo-ddp/tools/" + name);
#ifdef EO_DDP_SOURCE_DIR
  looked.push_back(std::string(EO_DDP_SOURCE_DIR) + "/tools/" + name);
#endif
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
  const nlohmann::json common = {{"tool", hash_file(find_tool("prepare_data.py"))},
                                 {"tokenizer_files", hash_tokenizer(plan.tokenizer)},
                                 {"keys", global_shape(cfg, "")}};
  for (auto& p : items) {
    const DatasetSpec& d = spec_of(cfg, p);
    const nlohmann::json material = {{"common", common}, {"data", hash_file(d.path)}, {"dataset", dataset_shape(d)}};
    Fnv f;
    f.add(material.dump());
    p.key = f.hex();
    p.dir = (fs::path(cfg.dataset_prepared_path) / p.key).string();
    p.ready = fs::is_regular_file(p.file()) && fs::is_regular_file(p.dir + "/manifest.json");
  }
  plan.datasets = std::move(items);
  return plan;
}

void run_preparation(const TrainConfig& cfg, PreparePlan& plan) {
  if (plan.missing() == 0) return;
  fs::create_directories(cfg.dataset_prepared_path);
  const std::string tmp = (fs::path(cfg.dataset_prepared_path) / (".tmp-prepare-" + std::to_string(::getpid()))).string();
  remove_tree(tmp);
  fs::create_directories(tmp);
  nlohmann::json spec = global_shape(cfg, plan.tokenizer);
  spec["datasets"] = nlohmann::json::array();
  std::vector<PreparedDataset*> todo;
  for (auto& p : plan.datasets) {
    if (p.ready) continue;
    const DatasetSpec& d = spec_of(cfg, p);
    nlohmann::json e = dataset_shape(d);
    e["path"] = d.path;
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
  const int rc = run_tool(argv, tmp + "/stats.json", error_line);
  if (rc != 0) {
    remove_tree(tmp);
    if (rc == 2 && !error_line.empty()) throw UsageError("datasets: " + error_line);
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
    write_file_atomic(tmp + "/" + p.key + "/manifest.json", manifest.dump(2) + "\n");
    std::error_code ec;
    fs::rename(tmp + "/" + p.key, p.dir, ec);  // another run may have finished it meanwhile: keep theirs
    if (ec && !(fs::is_regular_file(p.file()) && fs::is_regular_file(p.dir + "/manifest.json")))
      EO_FAIL("cannot move the prepared dataset into ", p.dir, ": ", ec.message());
    p.ready = true;
  }
  remove_tree(tmp);
}

void apply_preparation(TrainConfig& cfg, const PreparePlan& plan) {
  for (const auto& p : plan.datasets) (p.test ? cfg.test_datasets : cfg.datasets).at(p.index).prepared = p.file();
}

}  // namespace eo::data
