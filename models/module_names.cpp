#include "models/module_names.h"

#include <algorithm>

namespace eo::model {

std::vector<HfModule> hf_linear_modules(const ModelConfig& mc) {
  std::vector<HfModule> out;
  const std::vector<std::string> linears = mc.linear_modules();
  auto adaptable = [&](const std::string& s) { return std::find(linears.begin(), linears.end(), s) != linears.end(); };
  auto mlp = [&](const std::string& at) {
    for (const char* m : {"gate_proj", "up_proj", "down_proj"}) out.push_back({at + "." + m, adaptable(m)});
  };
  for (int i = 0; i < mc.layers; ++i) {
    const std::string p = mc.decoder_prefix() + "layers." + std::to_string(i) + ".";
    for (const auto& a : mc.attention_shapes(i)) out.push_back({p + a.module + "." + a.name, true});
    const bool moe = mc.is_moe_layer(i);
    if (!moe || mc.dense_beside_experts()) mlp(p + mc.mlp_prefix());
    if (!moe) continue;
    out.push_back({p + mc.router_path(), false});
    if (mc.experts_lora_ok())
      for (std::int64_t e = 0; e < mc.experts; ++e)
        for (const auto& m : mc.expert_linears())
          out.push_back({p + mc.experts_path() + "." + std::to_string(e) + "." + m, adaptable(m)});
    const std::string block = p + mc.moe_prefix() + ".";
    if (mc.shared_expert_width > 0) mlp(block + mc.shared_expert_name());
    if (mc.shared_expert_gated) out.push_back({block + "shared_expert_gate", adaptable("shared_expert_gate")});
  }
  out.push_back({"lm_head", false});
  return out;
}

}  // namespace eo::model
