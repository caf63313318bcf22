// `eo-ddp merge`: a peft adapter merged into its base, written as a checkpoint folder that
// transformers, vLLM and SGLang load as they load the base (models/merge.h does the tensors).
#include <filesystem>

#include "common/error.h"
#include "common/files.h"
#include "common/log.h"
#include "common/text.h"
#include "launch/commands.h"
#include "models/merge.h"
#include "runtime/adapter_files.h"
#include "runtime/hub.h"

#include <nlohmann/json.hpp>

namespace eo::launch {

namespace fs = std::filesystem;

namespace {

// The dtype the base says it is stored in (config.json's dtype / torch_dtype, a wrapper's
// text_config), bf16 when it names none.
at::ScalarType stored_dtype(const std::string& model_dir) {
  std::string text;
  if (!read_file_nofollow((fs::path(model_dir) / "config.json").string(), text)) return at::kBFloat16;
  try {
    const auto j = nlohmann::json::parse(text);
    for (const auto* c : {&j, j.contains("text_config") ? &j["text_config"] : &j})
      for (const char* key : {"dtype", "torch_dtype"})
        if (c->contains(key) && (*c)[key].is_string()) {
          const std::string d = (*c)[key].get<std::string>();
          if (d == "float32") return at::kFloat;
          if (d == "float16") return at::kHalf;
          if (d == "bfloat16") return at::kBFloat16;
        }
  } catch (const std::exception&) {
  }
  return at::kBFloat16;
}

// Files a checkpoint folder carries beside its weights and config (the tokenizer's are
// copy_tokenizer_files'): generation defaults, a multimodal model's processors.
void copy_side_files(const std::string& from, const std::string& to) {
  for (const char* name : {"generation_config.json", "preprocessor_config.json", "processor_config.json",
                           "video_preprocessor_config.json"}) {
    const fs::path p = fs::path(from) / name;
    if (!fs::is_regular_file(p)) continue;
    std::string bytes;
    EO_CHECK(read_file_nofollow(p.string(), bytes), "cannot read ", p.string());
    write_file_atomic((fs::path(to) / name).string(), bytes);
  }
}

// This process's peak resident memory (VmHWM: its own address space since exec, the mapped
// shards' pages included), 0 where /proc is not there.
std::uint64_t peak_host_memory() {
  std::string status;
  if (!read_file_nofollow("/proc/self/status", status)) return 0;
  const auto at = status.find("VmHWM:");
  return at == std::string::npos ? 0 : std::stoull(status.substr(at + 6)) * 1024;
}

}  // namespace

int run_merge(const Args& args) {
  ArgReader reader(args);
  std::string model_dir = reader.value("--model");
  const std::string adapter_dir = reader.value("--adapter"), output_dir = reader.value("--output");
  const std::string base = reader.value("--base", "original"), dtype = reader.value("--dtype");
  const std::string shard_text = reader.value("--max-shard-size", "5GB");
  reader.finish("merge");
  if (model_dir.empty()) throw UsageError("merge: --model DIR (the base checkpoint) is required (see eo-ddp merge --help)");
  if (adapter_dir.empty()) throw UsageError("merge: --adapter DIR (a peft adapter folder) is required");
  if (output_dir.empty()) throw UsageError("merge: --output DIR (the merged checkpoint's new folder) is required");
  if (base != "original" && base != "as-trained")
    throw UsageError("merge: --base must be original or as-trained, got '" + base + "'");
  if (!dtype.empty() && dtype != "bf16" && dtype != "fp16" && dtype != "fp32")
    throw UsageError("merge: --dtype must be bf16, fp16 or fp32, got '" + dtype + "'");
  const auto shard_bytes = parse_bytes(shard_text);
  if (!shard_bytes || *shard_bytes == 0)
    throw UsageError("merge: --max-shard-size must be a size such as 5GB or 500MiB, got '" + shard_text + "'");
  if (const hub::Resolution r = hub::resolve(hub::Repo::Model, model_dir, "", hub::Need::Everything, true, "merge: --model");
      !r.problem.empty())
    throw UsageError("merge: --model " + r.problem);
  else model_dir = r.path;
  if (!fs::is_directory(model_dir)) throw UsageError("merge: --model " + model_dir + " is not a folder");
  if (!fs::is_directory(adapter_dir)) throw UsageError("merge: --adapter " + adapter_dir + " is not a folder");
  if (fs::exists(output_dir) && !(fs::is_directory(output_dir) && fs::is_empty(output_dir)))
    throw UsageError("merge: --output " + output_dir + " exists and is not an empty folder; name a new one");

  model::MergeOptions o;
  o.base_dir = model_dir;
  o.adapter_dir = adapter_dir;
  o.output_dir = output_dir;
  o.max_shard_bytes = *shard_bytes;
  o.dtype = dtype == "fp32" ? at::kFloat : dtype == "fp16" ? at::kHalf : dtype == "bf16" ? at::kBFloat16 : stored_dtype(model_dir);
  std::string written = "the original weights of " + model_dir + " (as peft's merge_and_unload merges)";
  if (base == "as-trained") {
    const fs::path recorded = fs::path(adapter_dir) / kAdapterBaseFile;
    std::string text;
    if (!read_file_nofollow(recorded.string(), text))
      throw UsageError("merge: --base as-trained needs " + recorded.string() + " (eo-ddp writes it beside the adapter: "
                       "the base it was trained on); without it use --base original");
    try {
      const auto j = nlohmann::json::parse(text);
      o.as_trained = j.value("load_in_4bit", false);
      o.blocksize = j.value("bnb_4bit_blocksize", 64);
      o.expert_quant = j.value("expert_quant", std::string("auto"));
      o.double_quant = j.value("bnb_4bit_use_double_quant", false);
    } catch (const std::exception& e) {
      throw UsageError("merge: " + recorded.string() + " is not readable JSON (" + e.what() + ")");
    }
    written = o.as_trained
                  ? "the base as trained: every decoder-block linear of " + model_dir + " quantised to NF4 (blocksize " +
                        std::to_string(o.blocksize) + (o.double_quant ? ", double quantisation" : "") +
                        ") and dequantised, the model training and `eo-ddp score --adapter` ran"
                  : "the original weights of " + model_dir + ", which is the base as trained (" + recorded.string() +
                        ": load_in_4bit was off)";
  }
  log::info("merge: " + adapter_dir + " into " + written);
  const auto sum = model::merge_adapter(o);
  copy_side_files(model_dir, output_dir);
  copy_tokenizer_files(model_dir, output_dir);
  log::info("merge: wrote " + output_dir + ": " + std::to_string(sum.tensors) + " tensors (" + human_bytes(sum.bytes) + ", " +
            std::string(at::toString(o.dtype)) + ") in " + std::to_string(sum.shards) + " shard(s); " +
            std::to_string(sum.deltas) + " LoRA matrices merged into " + std::to_string(sum.merged) + " tensors" +
            (o.as_trained ? ", " + std::to_string(sum.requantised) + " matrices as their NF4 round trip" : "") +
            (sum.mxfp4 ? ", " + std::to_string(sum.mxfp4) + " MXFP4 expert tensors dequantised" : "") +
            "; base: " + (o.as_trained ? "as trained (NF4)" : "original weights") + "; peak host memory " +
            std::to_string(peak_host_memory()) + " bytes");
  return kExitOk;
}

}  // namespace eo::launch
