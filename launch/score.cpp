// `eo-ddp score`: mean next-token loss of a checkpoint (plus an optional peft adapter) over a
// tokenized JSONL file, one sequence per line — the number transformers' model(..., labels=)
// would give averaged over every counted token of the file (not over lines).
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>

#include "common/error.h"
#include "common/files.h"
#include "common/log.h"
#include "launch/commands.h"
#include "models/moe_model.h"
#include "runtime/adapter_files.h"
#include "runtime/data/jsonl.h"
#include "runtime/hub.h"
#include "runtime/train_state.h"

#include <nlohmann/json.hpp>

namespace eo::launch {

namespace {

// Rows longer than this are scored in windows: one forward over a 100M-token row needs far more
// memory than any machine has, and no model is defined over such a context.
constexpr std::int64_t kDefaultScoreWindow = 8192;

}  // namespace

int run_score(const Args& args) {
  ArgReader reader(args);
  std::string model_dir = reader.value("--model");
  const std::string adapter_dir = reader.value("--adapter");
  const std::string data_path = reader.value("--data");
  const std::string dtype = reader.value("--dtype", "fp32");
  const bool force_4bit = reader.flag("--load-in-4bit"), force_dense = reader.flag("--no-load-in-4bit");
  const bool json = reader.flag("--json");
  const std::string window_text = reader.value("--window", std::to_string(kDefaultScoreWindow));
  reader.finish("score");
  std::int64_t window = 0;
  try {
    std::size_t used = 0;
    window = std::stoll(window_text, &used);
    if (used != window_text.size()) window = 0;
  } catch (const std::exception&) {
    window = 0;
  }
  if (window < 2 || window > (std::int64_t{1} << 24))
    throw UsageError("score: --window must be a whole number of tokens from 2 to 16777216, got '" + window_text + "'");
  if (model_dir.empty()) throw UsageError("score: --model DIR is required (see eo-ddp --help)");
  if (data_path.empty()) throw UsageError("score: --data FILE is required (see eo-ddp --help)");
  if (dtype != "fp32" && dtype != "bf16") throw UsageError("score: --dtype must be fp32 or bf16, got '" + dtype + "'");
  // A model named as on the Hub: its Hugging Face cache folder (downloaded when missing).
  if (const hub::Resolution r = hub::resolve(hub::Repo::Model, model_dir, "", hub::Need::Everything, true, "score: --model");
      !r.problem.empty())
    throw UsageError("score: --model " + r.problem);
  else model_dir = r.path;
  if (!std::filesystem::is_directory(model_dir)) throw UsageError("score: --model " + model_dir + " is not a folder");
  if (!adapter_dir.empty() && !std::filesystem::is_directory(adapter_dir))
    throw UsageError("score: --adapter " + adapter_dir + " is not a folder");

  if (force_4bit && force_dense) throw UsageError("score: --load-in-4bit and --no-load-in-4bit contradict each other");

  model::LoadOptions lo;
  lo.dtype = dtype == "bf16" ? at::kBFloat16 : at::kFloat;
  // The base: as given, else as the adapter was trained (its eo_ddp_base.json), else as stored.
  std::string base = "weights as stored";
  lo.load_in_4bit = force_4bit;
  if (const auto recorded = force_4bit || force_dense ? std::nullopt : read_adapter_base(adapter_dir, "score")) {
    lo.load_in_4bit = recorded->load_in_4bit;
    lo.blocksize = recorded->blocksize;
    lo.double_quant = recorded->double_quant;
    lo.expert_quant = model::expert_quant_named(recorded->expert_quant);
    base = lo.load_in_4bit ? "NF4, as the adapter was trained (" + recorded->file + "; experts: expert_quant " +
                                 recorded->expert_quant + ")"
                           : "weights as stored, as the adapter was trained (" + recorded->file + ")";
  } else if (force_4bit) {
    base = "NF4 (--load-in-4bit)";
  }
  log::info("score: base model " + model_dir + ": " + base);
  lo.device = at::hasCUDA() ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
  const model::ModelConfig cfg = model::load_config(model_dir);  // usage errors before loading weights
  const auto lines = data::read_tokenized_jsonl(data_path, cfg.vocab);
  auto m = model::MoeModel::load(model_dir, lo);
  if (!adapter_dir.empty()) m->load_adapter(adapter_dir);

  c10::NoGradGuard no_grad;
  double loss_sum = 0;
  std::int64_t tokens = 0;
  // A row of n tokens is scored in windows [s, s + window) with s = 0, window - 1, 2(window - 1), ...:
  // consecutive windows share one token, so every shifted label is predicted exactly once (the
  // first token of a window is only context). Rows up to the window are one forward, as before.
  std::int64_t windowed_rows = 0;
  for (const auto& l : lines) {
    const auto n = static_cast<std::int64_t>(l.input_ids.size());
    if (n > window) ++windowed_rows;
    for (std::int64_t s = 0; s == 0 || s + 1 < n; s += window - 1) {
      const std::int64_t len = std::min(window, n - s);
      auto ids = [&](const std::vector<std::int64_t>& v) {
        return at::tensor(std::vector<std::int64_t>(v.begin() + s, v.begin() + s + len), at::kLong).view({1, len}).to(lo.device);
      };
      model::Batch b;
      b.input_ids = ids(l.input_ids);
      b.labels = ids(l.labels);
      bool padded = false;
      for (std::int64_t i = s; i < s + len; ++i) padded |= l.attention_mask[static_cast<std::size_t>(i)] == 0;
      if (padded) b.attention_mask = ids(l.attention_mask);
      const auto out = m->forward(b);
      loss_sum += out.loss_sum.item<double>();
      tokens += out.tokens;
      if (len == n) break;
    }
  }
  if (windowed_rows > 0)
    log::info("score: " + std::to_string(windowed_rows) + " row(s) longer than --window " + std::to_string(window) +
              " tokens were scored in windows that share one token; each window's tokens see only that window");
  if (tokens == 0) throw UsageError(data_path + ": no counted tokens (every shifted label is -100)");
  const double loss = loss_sum / static_cast<double>(tokens);
  if (!std::isfinite(loss)) throw Error("score: the loss is not finite (" + std::to_string(loss) + ")");
  if (json)
    std::printf("{\"loss\": %.9g, \"tokens\": %lld}\n", loss, static_cast<long long>(tokens));
  else
    std::printf("loss %.6f over %lld tokens (perplexity %.3f) — %s%s\n", loss, static_cast<long long>(tokens),
                std::exp(loss), model_dir.c_str(), adapter_dir.empty() ? "" : (" + " + adapter_dir).c_str());
  return kExitOk;
}

}  // namespace eo::launch
