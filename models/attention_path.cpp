#include "models/attention_path.h"

#include <ATen/ATen.h>

#include <map>
#include <set>
#include <string>
#include <vector>

#ifdef EO_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace eo::model {

AttentionPath attention_path(const ModelConfig& c, int layer, std::int64_t seq, bool packed, bool flash) {
  // Flash attention takes heads up to 256 wide and no mask; the memory-efficient kernel takes a
  // mask, and wider heads (Gemma 4's 512-wide full layers) with their kv heads repeated.
  if (c.head_dim_at(layer) > 256) return AttentionPath::Masked;
  // A mask rides along with sinks (attend_with_sinks) and chunked layers longer than a chunk
  // (BlockContext::chunk_mask).
  const bool chunked = c.is_chunked_layer(layer) && seq > c.llama4->chunk;
  if (c.attention_sinks || chunked) return AttentionPath::Masked;
  // Sliding windows without sinks (Gemma 4): flash's local window where flash runs, else the mask.
  if (c.is_sliding_layer(layer) && !flash) return AttentionPath::Masked;
  if (!packed) return AttentionPath::Fused;
  // Packed rows: flash's variable-length form where it runs and the heads suit it (one width for
  // keys and values, which latent attention does not have); else the packing mask.
  const std::int64_t qk = c.mla ? c.mla->qk_dim() : c.head_dim_at(layer), v = c.mla ? c.mla->v_dim : qk;
  const bool flash_heads = qk == v && qk % 8 == 0 && qk <= 256;
  return flash && flash_heads ? AttentionPath::Varlen : AttentionPath::Masked;
}

bool needs_flash_forms(const ModelConfig& c, int layer, AttentionPath path) {
  return path == AttentionPath::Varlen || (path == AttentionPath::Fused && c.is_sliding_layer(layer));
}

const char* attention_path_name(AttentionPath p) {
  switch (p) {
    case AttentionPath::Fused: return "fused";
    case AttentionPath::Varlen: return "varlen";
    case AttentionPath::Masked: return "masked";
  }
  return "?";
}

std::string packed_attention_summary(const ModelConfig& c, std::int64_t seq, bool flash) {
  std::map<AttentionPath, int> layers;
  for (int l = 0; l < int(c.layers); ++l)
    if (!c.is_linear_attention_layer(l)) ++layers[attention_path(c, l, seq, /*packed=*/true, flash)];
  std::string out;
  for (const auto& [path, n] : layers) {
    const char* how = path == AttentionPath::Varlen ? "flash attention's variable-length form (each document causal on its own)"
                      : path == AttentionPath::Masked
                          ? (flash ? "the packing mask on the memory-efficient kernel (sinks, chunks, latent "
                                     "attention's widths or heads wider than 256)"
                                   : "the packing mask on the memory-efficient kernel (flash's variable-length form needs "
                                     "a GPU of sm_80 or newer and bf16 or fp16)")
                          : attention_path_name(path);
    out += (out.empty() ? "" : "; ") + std::to_string(n) + " attention layer" + (n == 1 ? "" : "s") + " through " + how;
  }
  return out;
}

bool flash_attention_runs(const c10::Device& device, c10::ScalarType dtype) {
  if (!device.is_cuda() || (dtype != at::kBFloat16 && dtype != at::kHalf)) return false;
#ifdef EO_WITH_CUDA
  int major = 0;
  const int index = device.has_index() ? device.index() : 0;
  return cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, index) == cudaSuccess && major >= 8;
#else
  return false;
#endif
}

at::Tensor packed_document_starts(const at::Tensor& segment_ids) {
  const at::Tensor seg = segment_ids.to(at::kCPU, at::kLong).contiguous();
  const std::int64_t B = seg.size(0), T = seg.size(1);
  const std::int64_t* s = seg.data_ptr<std::int64_t>();
  std::vector<std::int32_t> starts;
  for (std::int64_t b = 0; b < B; ++b) {
    std::set<std::int64_t> seen;
    for (std::int64_t t = 0; t < T; ++t) {
      const std::int64_t id = s[b * T + t];
      if (t > 0 && id == s[b * T + t - 1]) continue;
      if (!seen.insert(id).second) return {};  // a document in two pieces
      starts.push_back(static_cast<std::int32_t>(b * T + t));
    }
  }
  std::size_t size = 8;
  while (size < starts.size() + 1) size *= 2;
  starts.resize(size, static_cast<std::int32_t>(B * T));  // the end, then empty documents
  return at::tensor(starts, at::TensorOptions().dtype(at::kInt));
}

}  // namespace eo::model
