// Each family's own config.json reading, named in its row of the architecture table
// (models/arch.cpp): the MoE block's fields (experts, router, shared experts, dense layers) of the
// families that share the decoder's attention reading (models/hf_config.cpp), and the whole
// config of the families read apart (Gemma 4, Llama 4).
#pragma once

#include <string>

#include "models/config_fields.h"
#include "models/hf_config.h"

namespace eo::model {

void read_qwen3_moe(const ConfigFields& f, ModelConfig& c);
void read_olmoe(const ConfigFields& f, ModelConfig& c);
void read_mixtral(const ConfigFields& f, ModelConfig& c);
void read_qwen2_moe(const ConfigFields& f, ModelConfig& c);
void read_glm4_moe(const ConfigFields& f, ModelConfig& c);
void read_deepseek_v2(const ConfigFields& f, ModelConfig& c);
void read_deepseek_v3(const ConfigFields& f, ModelConfig& c);
void read_glm4_moe_lite(const ConfigFields& f, ModelConfig& c);
void read_mistral4(const ConfigFields& f, ModelConfig& c);
void read_gpt_oss(const ConfigFields& f, ModelConfig& c);
void read_qwen3_next(const ConfigFields& f, ModelConfig& c);
void read_qwen3_5_moe(const ConfigFields& f, ModelConfig& c);
void read_minimax_m2(const ConfigFields& f, ModelConfig& c);
void read_ernie4_5_moe(const ConfigFields& f, ModelConfig& c);
void read_hunyuan_v1_moe(const ConfigFields& f, ModelConfig& c);

// `wrapper`: the multimodal model around it, if any (for the errors' wording). In hf_config.cpp,
// beside the RoPE reading they share.
ModelConfig parse_gemma4(const nlohmann::json& j, const std::string& source, const MultimodalWrapper* wrapper);
ModelConfig parse_llama4(const nlohmann::json& j, const std::string& source, const MultimodalWrapper* wrapper);

}  // namespace eo::model
