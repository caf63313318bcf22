// `eo-ddp generate`: a look at the model — a prompt (through its chat template) continued greedily
// or by sampling, the text streamed to the terminal, the prefill and decode rates printed.
// Tokenising and detokenising are the model's own tokenizer in Python (tools/chat_io.py), as the
// datasets are; the model is eo-ddp's, so what generates is what trained.
// The prompt runs once (prefill), then each new token alone against the layers' cached keys and
// values (models/kv_cache.h); --no-kv-cache runs the whole sequence again for every token instead.
// With --expert-offload the 4-bit experts live in host homes and stream into a device slot block by
// block, as in training (offload/engine.h), so generate runs wherever training ran. A server is
// faster still: serve a merged checkpoint (docs/after-training.md).
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
#include <optional>
#include <set>

#include "common/error.h"
#include "common/files.h"
#include "common/log.h"
#include "common/text.h"
#include "launch/commands.h"
#include "models/kv_cache.h"
#include "models/moe_model.h"
#include "offload/engine.h"
#include "runtime/adapter_files.h"
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

// "1, 2 3" -> ids, each in [0, vocab).
std::vector<std::int64_t> parse_ids(const std::string& text, std::int64_t vocab) {
  std::vector<std::int64_t> ids;
  std::string cur;
  auto flush = [&] {
    if (cur.empty()) return;
    const double v = number("--prompt-ids", cur, 0, static_cast<double>(vocab - 1));
    if (v != static_cast<double>(static_cast<std::int64_t>(v)))
      throw UsageError("generate: --prompt-ids must be whole token ids, got '" + cur + "'");
    ids.push_back(static_cast<std::int64_t>(v));
    cur.clear();
  };
  for (const char ch : text) {
    if (ch == ',' || ch == ' ') flush();
    else cur += ch;
  }
  flush();
  if (ids.empty()) throw UsageError("generate: --prompt-ids is empty; give token ids such as --prompt-ids 1,2,3");
  return ids;
}

// The end-of-sequence ids of generation_config.json (else config.json): where --prompt-ids stops.
std::set<std::int64_t> eos_ids(const std::string& model_dir) {
  for (const char* name : {"generation_config.json", "config.json"}) {
    const fs::path path = fs::path(model_dir) / name;
    std::string text;
    if (!fs::is_regular_file(path) || !read_file_nofollow(path.string(), text)) continue;
    const auto j = nlohmann::json::parse(text, nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.contains("eos_token_id")) continue;
    const auto& e = j["eos_token_id"];
    std::set<std::int64_t> ids;
    if (e.is_number_integer()) ids.insert(e.get<std::int64_t>());
    if (e.is_array())
      for (const auto& v : e)
        if (v.is_number_integer()) ids.insert(v.get<std::int64_t>());
    return ids;
  }
  return {};
}

// The next token: greedy (temperature 0), else sampled from the smallest set of most likely tokens
// whose probability reaches top_p.
std::int64_t pick(const at::Tensor& logits, double temperature, double top_p, at::Generator& gen) {
  if (temperature == 0) return logits.argmax().item<std::int64_t>();
  const auto [sorted, order] = at::softmax(logits / temperature, -1).sort(-1, /*descending=*/true);
  const at::Tensor before = sorted.cumsum(-1) - sorted;
  const at::Tensor kept = sorted.masked_fill(before >= top_p, 0);
  return order[at::multinomial(kept, 1, false, gen).item<std::int64_t>()].item<std::int64_t>();
}

// The 4-bit experts the loader left in host memory (LoadOptions::experts_on_host) into homes, streamed
// into device slots as training streams them (runtime/setup.cpp, start_offload), with the forward's
// order of MoE blocks as the schedule, so the next block is copied while one computes; the first
// blocks that fit in `budget` device bytes stay resident (expert_offload_vram_budget).
std::shared_ptr<offload::ExpertOffloader> start_offload(model::MoeModel& m, const at::Device& device, std::int64_t budget) {
  auto* resident = dynamic_cast<model::ResidentWeights*>(&m.weight_provider());
  EO_CHECK(resident, "generate: the model's experts are not held by a ResidentWeights store");
  bool any = false;
  for (const auto& layer : resident->bank()) any |= !layer.empty();
  if (!any) throw UsageError("generate: --expert-offload, but " + m.config().model_type + " has no MoE expert blocks");
  offload::OffloadOptions oo;
  oo.device = device;
  oo.pin_memory = device.is_cuda();
  oo.vram_budget_bytes = budget;  // blocks that fit stay on the device, the rest stream
  auto off = std::make_shared<offload::ExpertOffloader>(std::move(resident->bank()), oo);
  off->set_schedule(off->moe_layers());
  m.set_weight_provider(off);
  return off;
}

}  // namespace

int run_generate(const Args& args) {
  ArgReader reader(args);
  std::string model_dir = reader.value("--model");
  const std::string adapter_dir = reader.value("--adapter"), prompt = reader.value("--prompt"), chat = reader.value("--chat");
  const std::string prompt_ids = reader.value("--prompt-ids");
  const double temperature = number("--temperature", reader.value("--temperature", "0"), 0, 100);
  const double top_p = number("--top-p", reader.value("--top-p", "1"), 1e-6, 1);
  const auto max_new = static_cast<std::int64_t>(number("--max-new-tokens", reader.value("--max-new-tokens", "128"), 1, 1 << 20));
  const auto seed = static_cast<std::uint64_t>(number("--seed", reader.value("--seed", "0"), 0, 1e15));
  const std::string dtype = reader.value("--dtype", "fp32");
  const bool raw = reader.flag("--raw"), json = reader.flag("--json");
  const bool force_4bit = reader.flag("--load-in-4bit"), force_dense = reader.flag("--no-load-in-4bit");
  const bool offload_on = reader.flag("--expert-offload"), offload_off = reader.flag("--no-expert-offload");
  const bool recompute = reader.flag("--no-kv-cache"), synthetic = reader.flag("--synthetic-weights");
  const std::string budget_text = reader.value("--expert-offload-vram-budget", "0");
  reader.finish("generate");
  if (model_dir.empty()) throw UsageError("generate: --model DIR is required (see eo-ddp generate --help)");
  if (int(!prompt.empty()) + int(!chat.empty()) + int(!prompt_ids.empty()) != 1)
    throw UsageError("generate: give one of --prompt TEXT, --chat FILE and --prompt-ids IDS");
  if (dtype != "fp32" && dtype != "bf16") throw UsageError("generate: --dtype must be fp32 or bf16, got '" + dtype + "'");
  if (force_4bit && force_dense) throw UsageError("generate: --load-in-4bit and --no-load-in-4bit contradict each other");
  if (offload_on && offload_off) throw UsageError("generate: --expert-offload and --no-expert-offload contradict each other");
  const std::optional<std::uint64_t> budget = parse_bytes(budget_text);
  if (!budget)
    throw UsageError("generate: --expert-offload-vram-budget must be a size such as 8GiB or 0, got '" + budget_text + "'");
  if (synthetic && prompt_ids.empty())
    throw UsageError("generate: --synthetic-weights has no tokenizer to go with it; give the prompt as --prompt-ids");
  if (const hub::Resolution r = hub::resolve(hub::Repo::Model, model_dir, "", synthetic ? hub::Need::Config : hub::Need::Everything,
                                             true, "generate: --model");
      !r.problem.empty())
    throw UsageError("generate: --model " + r.problem);
  else model_dir = r.path;
  if (!adapter_dir.empty() && !fs::is_directory(adapter_dir))
    throw UsageError("generate: --adapter " + adapter_dir + " is not a folder");
  const model::ModelConfig config = model::load_config(model_dir);  // usage errors before loading weights

  // The prompt's ids and the ids that end a turn: the model's tokenizer's, or as given.
  std::vector<std::int64_t> ids;
  std::set<std::int64_t> stop;
  if (!prompt_ids.empty()) {
    ids = parse_ids(prompt_ids, config.vocab);
    stop = eos_ids(model_dir);
  } else {
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
    ids = enc.at("ids").get<std::vector<std::int64_t>>();
    const auto stop_list = enc.at("stop").get<std::vector<std::int64_t>>();
    stop.insert(stop_list.begin(), stop_list.end());
  }

  // The base: as the flags say, else as the adapter trained (its eo_ddp_base.json), else as stored;
  // the experts offloaded likewise.
  model::LoadOptions lo;
  lo.dtype = dtype == "bf16" ? at::kBFloat16 : at::kFloat;
  const auto recorded = force_4bit || force_dense ? std::nullopt : read_adapter_base(adapter_dir, "generate");
  if (recorded) {
    lo.load_in_4bit = recorded->load_in_4bit;
    lo.blocksize = recorded->blocksize;
    lo.double_quant = recorded->double_quant;
    lo.expert_quant = model::expert_quant_named(recorded->expert_quant);
  }
  if (force_4bit) lo.load_in_4bit = true;
  const bool offload = offload_on || (!offload_off && recorded && recorded->expert_offload);
  if (offload && !lo.load_in_4bit)
    throw UsageError("generate: --expert-offload streams the 4-bit experts; add --load-in-4bit (or generate without offload)");
  lo.device = at::hasCUDA() ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
  lo.experts_on_host = offload;
  if (synthetic) lo.random_seed = seed;  // benchmarks on real shapes: config.json only, nothing read
  auto m = model::MoeModel::load(model_dir, config, lo);
  std::shared_ptr<offload::ExpertOffloader> offloader;
  if (offload) offloader = start_offload(*m, lo.device, static_cast<std::int64_t>(*budget));
  if (!adapter_dir.empty()) m->load_adapter(adapter_dir);
  log::info(std::string("generate: ") + (synthetic ? "synthetic (seeded random) " : "") + (lo.load_in_4bit ? "NF4 base" : "base as stored") +
            (recorded ? " as the adapter was trained (" + recorded->file + ")" : "") +
            (offload ? ", experts streamed from host homes into a device slot" : "") +
            (recompute ? ", no kv cache (every token runs the whole sequence)"
                       : ", kv cache (the prompt once, then one token per forward)"));

  c10::NoGradGuard no_grad;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  // Text through the tokenizer; a checkpoint without one (synthetic weights) streams the ids.
  const bool has_tokenizer = fs::exists(fs::path(model_dir) / "tokenizer.json") || fs::exists(fs::path(model_dir) / "tokenizer_config.json");
  std::unique_ptr<Streamer> streamer;
  if (!json && has_tokenizer) streamer = std::make_unique<Streamer>(model_dir);
  model::KvCache cache(m->num_layers());
  const std::size_t prompt_len = ids.size();
  offload::OffloadStats streamed;  // summed over the forwards
  using clock = std::chrono::steady_clock;
  double prefill_s = 0;
  const auto start = clock::now();
  for (std::int64_t t = 0; t < max_new; ++t) {
    at::Tensor logits;
    if (recompute) {
      model::Batch b;
      b.input_ids = at::tensor(ids, at::kLong).view({1, static_cast<std::int64_t>(ids.size())}).to(lo.device);
      logits = m->forward(b).logits[0][-1].to(at::kCPU, at::kFloat);
    } else {  // the tokens the cache does not hold yet: the prompt, then the last one
      const std::vector<std::int64_t> fresh(ids.begin() + cache.length(), ids.end());
      logits = model::forward_cached(*m, at::tensor(fresh, at::kLong).view({1, static_cast<std::int64_t>(fresh.size())}), cache);
    }
    const std::int64_t next = pick(logits, temperature, top_p, gen);
    if (offloader) {  // each forward closes its own counters, so their CUDA events are freed as it goes
      offloader->end_step();
      const offload::OffloadStats st = offloader->take_step_stats();
      streamed.copies += st.copies;
      streamed.copied_bytes += st.copied_bytes;
      streamed.copy_seconds += st.copy_seconds;
      streamed.stall_seconds += st.stall_seconds;
      streamed.stage_calls += st.stage_calls;
      streamed.slot_hits += st.slot_hits;
      streamed.resident_hits += st.resident_hits;
      streamed.resident_blocks = st.resident_blocks;
      streamed.memcpy_link = st.memcpy_link;
    }
    if (t == 0) prefill_s = std::chrono::duration<double>(clock::now() - start).count();
    ids.push_back(next);
    if (streamer) streamer->token(next);
    else if (!json) {
      std::printf("%lld ", static_cast<long long>(next));
      std::fflush(stdout);
    }
    if (stop.count(next)) break;
  }
  const double total_s = std::chrono::duration<double>(clock::now() - start).count();
  streamer.reset();
  if (!json && !has_tokenizer) std::printf("\n");
  const auto generated = static_cast<std::int64_t>(ids.size() - prompt_len);
  const double prefill_rate = static_cast<double>(prompt_len) / std::max(prefill_s, 1e-9);
  const double decode_rate = generated > 1 ? static_cast<double>(generated - 1) / std::max(total_s - prefill_s, 1e-9) : 0;
  if (json) {
    nlohmann::json out = {{"prompt_ids", std::vector<std::int64_t>(ids.begin(), ids.begin() + prompt_len)},
                          {"ids", std::vector<std::int64_t>(ids.begin() + prompt_len, ids.end())},
                          {"prefill_tokens_per_s", prefill_rate},
                          {"decode_tokens_per_s", decode_rate}};
    if (offloader) out["experts_streamed"] = streamed.to_metrics();
    std::printf("%s\n", out.dump().c_str());
  }
  char line[256];
  std::snprintf(line, sizeof line, "generate: %zu prompt tokens at %.1f tok/s (prefill), %lld new tokens at %.2f tok/s (decode, %s)",
                prompt_len, prefill_rate, static_cast<long long>(generated), decode_rate,
                temperature == 0 ? "greedy" : "sampled");
  log::info(line);
  if (offloader) {
    std::snprintf(line, sizeof line,
                  "generate: experts streamed: %lld block copies, %.2f GB from host homes, %.2f s copying, %.2f s waited for",
                  static_cast<long long>(streamed.copies), static_cast<double>(streamed.copied_bytes) / 1e9,
                  streamed.copy_seconds, streamed.stall_seconds);
    log::info(line);
  }
  return kExitOk;
}

}  // namespace eo::launch
