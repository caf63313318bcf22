// `eo-ddp generate`: a look at the model — a prompt (through its chat template) continued greedily
// or by sampling, the text streamed to the terminal, the prefill and decode rates printed.
// Tokenising and detokenising are the model's own tokenizer in Python (tools/chat_io.py), as the
// datasets are; the model is eo-ddp's, so what generates is what trained.
// Each new token runs the whole sequence again (no key-value cache): simple and exact, and slower
// than a server; serve a merged checkpoint for speed (docs/after-training.md).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <set>

#include "common/error.h"
#include "common/files.h"
#include "common/log.h"
#include "launch/commands.h"
#include "models/moe_model.h"
#include "runtime/data/prepare.h"
#include "runtime/hub.h"

#include <nlohmann/json.hpp>

namespace eo::launch {

namespace fs = std::filesystem;

namespace {

double number(const std::string& flag, const std::string& text, double lo, double hi) {
  try {
    std::size_t used = 0;
    const double v = std::stod(text, &used);
    if (used == text.size() && v >= lo && v <= hi) return v;
  } catch (const std::exception&) {
  }
  throw UsageError("generate: " + flag + " must be a number from " + std::to_string(lo) + " to " + std::to_string(hi) +
                   ", got '" + text + "'");
}

// tools/chat_io.py decode, fed one token id per line; its stdout is ours.
class Streamer {
 public:
  explicit Streamer(const std::string& model_dir) {
    const std::vector<std::string> argv = {data::find_python(), data::find_tool("chat_io.py"), "decode", "--model", model_dir};
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) throw Error("generate: pipe failed");
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    pid_ = ::fork();
    if (pid_ == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);
      ::dup2(fds[0], 0);
      ::execv(args[0], args.data());
      ::_exit(127);
    }
    ::close(fds[0]);
    if (pid_ < 0) throw Error("generate: cannot start " + argv[1]);
    fd_ = fds[1];
  }
  void token(std::int64_t id) {
    const std::string line = std::to_string(id) + "\n";
    if (::write(fd_, line.data(), line.size()) < 0) {
    }  // a streamer that died loses only the shown text; the ids are still generated
  }
  ~Streamer() {
    ::close(fd_);
    int status = 0;
    ::waitpid(pid_, &status, 0);
  }

 private:
  pid_t pid_ = -1;
  int fd_ = -1;
};

}  // namespace

int run_generate(const Args& args) {
  ArgReader reader(args);
  std::string model_dir = reader.value("--model");
  const std::string adapter_dir = reader.value("--adapter"), prompt = reader.value("--prompt"), chat = reader.value("--chat");
  const double temperature = number("--temperature", reader.value("--temperature", "0"), 0, 100);
  const double top_p = number("--top-p", reader.value("--top-p", "1"), 1e-6, 1);
  const auto max_new = static_cast<std::int64_t>(number("--max-new-tokens", reader.value("--max-new-tokens", "128"), 1, 1 << 20));
  const auto seed = static_cast<std::uint64_t>(number("--seed", reader.value("--seed", "0"), 0, 1e15));
  const std::string dtype = reader.value("--dtype", "fp32");
  const bool raw = reader.flag("--raw"), json = reader.flag("--json"), in_4bit = reader.flag("--load-in-4bit");
  reader.finish("generate");
  if (model_dir.empty()) throw UsageError("generate: --model DIR is required (see eo-ddp generate --help)");
  if (prompt.empty() == chat.empty()) throw UsageError("generate: give one of --prompt TEXT and --chat FILE");
  if (dtype != "fp32" && dtype != "bf16") throw UsageError("generate: --dtype must be fp32 or bf16, got '" + dtype + "'");
  if (const hub::Resolution r = hub::resolve(hub::Repo::Model, model_dir, "", hub::Need::Everything, true, "generate: --model");
      !r.problem.empty())
    throw UsageError("generate: --model " + r.problem);
  else model_dir = r.path;
  if (!adapter_dir.empty() && !fs::is_directory(adapter_dir))
    throw UsageError("generate: --adapter " + adapter_dir + " is not a folder");

  // The prompt's ids and the ids that end a turn, from the model's tokenizer.
  const fs::path tmp = fs::temp_directory_path() / ("eo-generate-" + std::to_string(::getpid()) + ".json");
  std::vector<std::string> argv = {data::find_python(), data::find_tool("chat_io.py"), "encode", "--model", model_dir};
  if (!chat.empty()) argv.insert(argv.end(), {"--chat", chat});
  else argv.insert(argv.end(), {"--prompt", prompt});
  if (raw) argv.push_back("--raw");
  std::string error_line, text;
  const int rc = data::run_tool(argv, tmp.string(), error_line, "tokenising the prompt");
  read_file_nofollow(tmp.string(), text);
  fs::remove(tmp);
  if (rc != 0) throw UsageError("generate: the tokenizer of " + model_dir + " failed: " + error_line);
  const auto enc = nlohmann::json::parse(text);
  std::vector<std::int64_t> ids = enc.at("ids").get<std::vector<std::int64_t>>();
  const auto stop_list = enc.at("stop").get<std::vector<std::int64_t>>();
  const std::set<std::int64_t> stop(stop_list.begin(), stop_list.end());

  model::LoadOptions lo;
  lo.dtype = dtype == "bf16" ? at::kBFloat16 : at::kFloat;
  lo.load_in_4bit = in_4bit;
  lo.device = at::hasCUDA() ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
  auto m = model::MoeModel::load(model_dir, lo);
  if (!adapter_dir.empty()) m->load_adapter(adapter_dir);

  c10::NoGradGuard no_grad;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  std::unique_ptr<Streamer> streamer;
  if (!json) streamer = std::make_unique<Streamer>(model_dir);
  const std::size_t prompt_len = ids.size();
  using clock = std::chrono::steady_clock;
  double prefill_s = 0;
  const auto start = clock::now();
  for (std::int64_t t = 0; t < max_new; ++t) {
    model::Batch b;
    b.input_ids = at::tensor(ids, at::kLong).view({1, static_cast<std::int64_t>(ids.size())}).to(lo.device);
    at::Tensor logits = m->forward(b).logits[0][-1].to(at::kCPU, at::kFloat);
    std::int64_t next;
    if (temperature == 0) {
      next = logits.argmax().item<std::int64_t>();
    } else {
      // top-p: the smallest set of most likely tokens whose probability reaches top_p.
      const auto [sorted, order] = at::softmax(logits / temperature, -1).sort(-1, /*descending=*/true);
      const at::Tensor before = sorted.cumsum(-1) - sorted;
      const at::Tensor kept = sorted.masked_fill(before >= top_p, 0);
      next = order[at::multinomial(kept, 1, false, gen).item<std::int64_t>()].item<std::int64_t>();
    }
    if (t == 0) prefill_s = std::chrono::duration<double>(clock::now() - start).count();
    ids.push_back(next);
    if (streamer) streamer->token(next);
    if (stop.count(next)) break;
  }
  const double total_s = std::chrono::duration<double>(clock::now() - start).count();
  streamer.reset();
  const auto generated = static_cast<std::int64_t>(ids.size() - prompt_len);
  const double prefill_rate = static_cast<double>(prompt_len) / std::max(prefill_s, 1e-9);
  const double decode_rate = generated > 1 ? static_cast<double>(generated - 1) / std::max(total_s - prefill_s, 1e-9) : 0;
  if (json) {
    nlohmann::json out = {{"prompt_ids", std::vector<std::int64_t>(ids.begin(), ids.begin() + prompt_len)},
                          {"ids", std::vector<std::int64_t>(ids.begin() + prompt_len, ids.end())},
                          {"prefill_tokens_per_s", prefill_rate},
                          {"decode_tokens_per_s", decode_rate}};
    std::printf("%s\n", out.dump().c_str());
  }
  char line[256];
  std::snprintf(line, sizeof line, "generate: %zu prompt tokens at %.1f tok/s (prefill), %lld new tokens at %.2f tok/s (decode, %s)",
                prompt_len, prefill_rate, static_cast<long long>(generated), decode_rate,
                temperature == 0 ? "greedy" : "sampled");
  log::info(line);
  return kExitOk;
}

}  // namespace eo::launch
