// Merging a peft adapter into its base checkpoint (`eo-ddp merge`): every LoRA delta added to the
// tensor it adapts, written as a checkpoint folder in the base's own layout (the names and
// shapes transformers saves for that family, the multimodal wrappers' prefixes, the vision parts
// copied through).
//
// Streams: one input shard is mapped at a time and the output is written shard by shard, so host
// memory stays near one input plus one output shard whatever the model's size.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace eo::model {

struct MergeOptions {
  std::string base_dir;     // a float Hugging Face checkpoint folder
  std::string adapter_dir;  // a peft adapter folder (adapter_config.json, adapter_model.safetensors)
  std::string output_dir;   // created; must not exist or be empty
  // true: into the base the adapter was trained on (QLoRA: each decoder-block linear quantised to
  // NF4 as the loader does, with `blocksize` / `double_quant`, and dequantised), which is exactly
  // the model training and `eo-ddp score` ran; false: into the original weights, as peft's
  // merge_and_unload does.
  bool as_trained = false;
  int blocksize = 64;
  bool double_quant = false;
  // The run's expert_quant: MXFP4 experts (gpt-oss as the Hub ships it) stay MXFP4 in training
  // unless "nf4", so as trained they are their MXFP4 values, else the NF4 round trip of those.
  std::string expert_quant = "auto";
  at::ScalarType dtype = at::kBFloat16;     // of every floating tensor written
  std::uint64_t max_shard_bytes = 5000000000;  // transformers' default max_shard_size, "5GB"
};

struct MergeSummary {
  std::size_t tensors = 0;    // written
  std::size_t merged = 0;     // tensors a delta was added to
  std::size_t deltas = 0;     // LoRA matrices placed (an expert's gate, a q_proj, ...)
  std::size_t requantised = 0;  // matrices replaced by their NF4 round trip (as_trained)
  std::size_t mxfp4 = 0;        // MXFP4 expert tensors written dequantised
  std::size_t shards = 0;     // written
  std::uint64_t bytes = 0;    // of tensor data written
};

// Writes the merged tensors (model.safetensors, or model-0000i-of-0000N.safetensors shards with
// model.safetensors.index.json) and config.json (its dtype set, no quantization_config) into
// options.output_dir. gpt-oss's MXFP4 experts (`<name>_blocks` / `_scales`) are written dequantised
// under `<name>`, as transformers' Mxfp4Config(dequantize=True) holds them, and bitsandbytes NF4
// modules as bitsandbytes dequantises them (as trained too: their stored bytes are what trained).
// Throws UsageError for another quantised base (NVFP4, bitsandbytes FP4) and naming any adapter
// tensor it cannot place;
// nothing of the adapter is dropped silently.
MergeSummary merge_adapter(const MergeOptions& options);

}  // namespace eo::model
