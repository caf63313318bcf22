// The rules between config keys (runtime/config_checks.h).
#include "runtime/config_checks.h"

#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <regex>

#include "common/text.h"
#include "models/arch.h"
#include "models/hf_config.h"
#include "models/module_names.h"
#include "runtime/config_chat_templates.h"
#include "runtime/config_paths.h"
#include "runtime/hub.h"
#include "runtime/model_overrides.h"
#include "runtime/yaml_values.h"

namespace eo::config_detail {

namespace fs = std::filesystem;


void check_merge_aware(const TrainConfig& c, const std::set<std::string>& present, const std::map<std::string, YAML::Node>& noted,
                       Issues& issues) {
  if (!c.nvfp4_merge_aware) {
    if (c.nvfp4_merge_aware_start_step)
      issues.push_back({"nvfp4_merge_aware_start_step", "requires nvfp4_merge_aware: true"});
    return;
  }
  auto noted_true = [&](const char* k) {
    const auto it = noted.find(k);
    return it != noted.end() && as_bool(it->second) == true;
  };
  const auto backend = noted.find("expert_backend");
  const bool sonic = noted_true("use_sonicmoe") ||
                     (backend != noted.end() && backend->second.IsScalar() && backend->second.Scalar() == "sonicmoe");
  if (!sonic)
    issues.push_back({"nvfp4_merge_aware", "requires the sonicmoe expert backend in axolotl (use_sonicmoe: true, or "
                                           "expert_backend: sonicmoe); eo-ddp runs its own expert kernels either way, but "
                                           "refuses what axolotl refuses, so that the config trains the same in both"});
  if (present.count("adapter") && c.adapter != "lora")
    issues.push_back({"nvfp4_merge_aware", "requires a LoRA adapter (adapter: lora, without load_in_4bit); it snaps the "
                                           "LoRA delta to the NVFP4 grid of the frozen base, got adapter: " + c.adapter});
  std::vector<std::string> fused;
  for (const char* k : {"lora_mlp_kernel", "lora_qkv_kernel", "lora_o_kernel"})
    if (noted_true(k)) fused.push_back(k);
  if (!fused.empty())
    issues.push_back({fused.front(), "nvfp4_merge_aware is incompatible with " + join(fused, ", ") + " in axolotl (its fused "
                                     "LoRA kernels bypass the snapped forward, so the NVFP4 linears would train "
                                     "un-snapped); remove the lora_*_kernel keys"});
  if (c.cuda_graphs == "true")
    issues.push_back({"cuda_graphs", "cannot be combined with nvfp4_merge_aware: the snapped weights are formed anew in "
                                     "every forward and the switch at nvfp4_merge_aware_start_step changes the blocks' work; "
                                     "set cuda_graphs: auto or false"});
}

void check_rules(const TrainConfig& c, const std::set<std::string>& present, Issues& issues) {
  if (c.fp16.value_or(false) && c.bf16 == "true")
    issues.push_back({"fp16", "fp16: true and bf16: true contradict each other (one compute dtype per run): set "
                              "bf16: false (or auto) for fp16, or drop fp16 for bf16"});
  if (!present.count("base_model"))
    issues.push_back({"base_model", "required: the Hugging Face checkpoint folder to fine-tune"});
  if (!present.count("adapter"))
    issues.push_back({"adapter", "required: eo-ddp trains adapters only; set adapter: qlora (NF4 base) or adapter: lora"});
  if (!present.count("datasets"))
    issues.push_back({"datasets", "required: e.g. datasets: [{path: train.jsonl, type: chat_template}]"});
  if (!c.lora_target_parameters.empty() && c.lora_dropout > 0)
    issues.push_back({"lora_dropout", "must be 0 with lora_target_parameters: peft's ParamWrapper refuses dropout (it "
                                      "cannot be applied to the input of a fused parameter), got " + value_node(c.lora_dropout).Scalar()});
  if (c.adapter == "qlora" && !c.load_in_4bit)
    issues.push_back({"load_in_4bit", "adapter: qlora needs load_in_4bit: true (or use adapter: lora)"});
  if (c.adapter == "lora" && c.load_in_4bit)
    issues.push_back({"load_in_4bit", "load_in_4bit: true needs adapter: qlora"});
  if ((c.bnb_4bit_blocksize & (c.bnb_4bit_blocksize - 1)) != 0)
    issues.push_back({"bnb_4bit_blocksize", "must be a power of two (32 ... 4096), got " + std::to_string(c.bnb_4bit_blocksize)});
  if (c.expert_quant != "auto" && !c.load_in_4bit)
    issues.push_back({"expert_quant", c.expert_quant + " needs load_in_4bit: true (without it the experts are loaded "
                                      "unquantised); remove expert_quant or set load_in_4bit: true"});
  if (c.use_reentrant.value_or(false) && c.gradient_checkpointing)
    issues.push_back({"gradient_checkpointing_kwargs.use_reentrant",
                      "eo-ddp implements non-reentrant checkpointing only; set it to false"});
  if (c.activation_offloading && !c.gradient_checkpointing)
    issues.push_back({"activation_offloading", "activation_offloading: true parks the inputs that gradient checkpointing "
                                               "keeps; set gradient_checkpointing: true (or drop activation_offloading)"});
  // Evaluation and saving schedules: one way of saying each.
  const bool has_eval = c.val_set_size.has_value() || !c.test_datasets.empty();
  if (c.val_set_size && !c.test_datasets.empty())
    issues.push_back({"val_set_size", "set either val_set_size (held out from datasets) or test_datasets, not both"});
  if (c.eval_steps && c.evals_per_epoch)
    issues.push_back({"evals_per_epoch", "set either eval_steps or evals_per_epoch, not both"});
  if (c.saves_per_epoch && c.save_steps.value_or(0) > 0)
    issues.push_back({"saves_per_epoch", "set either save_steps or saves_per_epoch, not both"});
  if (c.chat_template == "jinja" && c.chat_template_jinja.empty())
    issues.push_back({"chat_template_jinja", "chat_template: jinja needs the template text in chat_template_jinja"});
  for (const auto* list : {&c.datasets, &c.test_datasets})
    for (std::size_t i = 0; i < list->size(); ++i) {
      const auto& d = (*list)[i];
      if (d.chat_template == "jinja" && d.chat_template_jinja.empty() && c.chat_template_jinja.empty())
        issues.push_back({std::string(list == &c.datasets ? "datasets." : "test_datasets.") + std::to_string(i) +
                              ".chat_template_jinja",
                          "chat_template: jinja needs the template text in chat_template_jinja"});
    }
  if (c.warmup_ratio && c.warmup_steps > 0)
    issues.push_back({"warmup_ratio", "set either warmup_steps or warmup_ratio, not both"});
  if (c.expert_offload_homes == "disk") {
    if (!c.expert_offload)
      issues.push_back({"expert_offload_homes", "disk keeps the offloaded experts on a drive: it needs expert_offload: true"});
    if (c.expert_offload_disk_path.empty())
      issues.push_back({"expert_offload_disk_path", "is required with expert_offload_homes: disk: a directory on a local "
                                                    "drive (ideally NVMe) for the homes file, e.g. /local/nvme/eo-homes"});
  }
  // Expert groups: a group is a range of the homes in host RAM, and every read of a block's bank
  // goes group by group (nvfp4_merge_aware reads the whole bank at once).
  if (c.expert_group_size != "auto" && c.expert_group_size != "whole") {
    if (!c.expert_offload)
      issues.push_back({"expert_group_size", "streams offloaded blocks in groups: it needs expert_offload: true (or leave it auto)"});
    if (c.expert_offload_homes == "disk")
      issues.push_back({"expert_group_size", "needs the homes in host RAM: the disk homes read whole blocks (use "
                                             "expert_offload_homes: per_rank or per_numa_node, or expert_group_size: whole)"});
    if (c.nvfp4_merge_aware)
      issues.push_back({"expert_group_size", "nvfp4_merge_aware snaps a whole block's experts at once: set expert_group_size: whole"});
  }
  if (c.expert_offload) {
    const std::string why = " (expert_offload streams NF4 experts, re-staged by the non-reentrant recompute in backward)";
    if (!c.load_in_4bit) issues.push_back({"load_in_4bit", "expert_offload: true requires load_in_4bit: true" + why});
    if (c.adapter != "qlora" && present.count("adapter"))
      issues.push_back({"adapter", "expert_offload: true requires adapter: qlora" + why});
    if (!c.gradient_checkpointing)
      issues.push_back({"gradient_checkpointing", "expert_offload: true requires gradient_checkpointing: true: backward "
                                                  "recomputes each block, which is when its experts are staged again"});
    if (!c.use_reentrant.has_value())
      issues.push_back({"gradient_checkpointing_kwargs.use_reentrant",
                        "expert_offload: true requires it to be set explicitly to false: the non-reentrant recompute, inside "
                        "the normal backward pass, is what re-stages each block's experts. Add "
                        "'gradient_checkpointing_kwargs: {use_reentrant: false}'"});
  }
}

void check_files(const TrainConfig& c, const std::set<std::string>& present, Issues& issues) {
  if (present.count("base_model") && !c.base_model.empty()) {
    const fs::path p(c.base_model);
    if (!fs::is_directory(p) && hub::is_repo_id(c.base_model)) {
      // A Hub name: runtime/hub.h reported why it is not here, or resolves it once the others are fixed.
    } else if (!fs::is_directory(p))
      issues.push_back({"base_model", shown_path(c, c.base_model) + " is not a folder (a Hugging Face checkpoint folder, or a "
                                                           "model named as on the Hub: org/name)"});
    else if (!fs::exists(p / "config.json"))
      issues.push_back({"base_model", "'" + c.base_model + "' has no config.json"});
  }
  bool formatted = false;
  for (const auto* list : {&c.datasets, &c.test_datasets})
    for (std::size_t i = 0; i < list->size(); ++i) {
      const auto& d = (*list)[i];
      formatted |= d.formatted();
      if (!d.files.empty() || hub::is_repo_id(d.path)) continue;  // a Hub dataset or folder: runtime/hub.h checked it
      std::error_code ec;
      const auto kind = fs::status(d.path, ec).type();
      if (!d.path.empty() && kind != fs::file_type::regular && kind != fs::file_type::not_found)
        issues.push_back({std::string(list == &c.datasets ? "datasets." : "test_datasets.") + std::to_string(i) + ".path",
                          "'" + d.path + "' is " + (kind == fs::file_type::directory ? "a folder" : "not a regular file (a FIFO, socket or device)") +
                              "; give the data file itself"});
      else if (!d.path.empty() && !fs::is_regular_file(d.path))
        issues.push_back({std::string(list == &c.datasets ? "datasets." : "test_datasets.") + std::to_string(i) + ".path",
                          "file " + shown_path(c, d.path) + " not found" +
                              (d.formatted() ? std::string(" (a JSON lines, JSON or parquet file, or a dataset named as "
                                                           "on the Hub: org/name)")
                                             : std::string())});
    }
  // The axolotl formats are tokenised with the model's tokenizer: it must be there.
  if (formatted) {
    const std::string tok = c.tokenizer_config.empty() ? c.base_model : c.tokenizer_config;
    const std::string key = c.tokenizer_config.empty() ? "base_model" : "tokenizer_config";
    if (!tok.empty() && fs::is_directory(tok) && !fs::exists(fs::path(tok) / "tokenizer.json") &&
        !fs::exists(fs::path(tok) / "tokenizer_config.json"))
      issues.push_back({key, "'" + tok + "' has no tokenizer (tokenizer.json / tokenizer_config.json), which the chat_template, "
                             "alpaca, completion and input_output datasets are tokenised with; download the model's tokenizer "
                             "files into it or set tokenizer_config to a tokenizer folder"});
    else if (!c.tokenizer_config.empty() && !fs::is_directory(tok))
      issues.push_back({"tokenizer_config", shown_path(c, tok) + " is not a folder"});
  }
  // The disk homes' directory: one that exists, or that can be created (its nearest existing
  // ancestor is a writable directory). It is created when the homes are written.
  if (c.expert_offload_homes == "disk" && !c.expert_offload_disk_path.empty()) {
    const fs::path p = fs::absolute(c.expert_offload_disk_path);
    std::error_code ec;
    if (fs::exists(p, ec) && !fs::is_directory(p, ec)) {
      issues.push_back({"expert_offload_disk_path", "'" + c.expert_offload_disk_path + "' exists and is not a directory"});
    } else if (!fs::exists(p, ec)) {
      fs::path up = p.parent_path();
      while (!up.empty() && !fs::exists(up, ec) && up != up.parent_path()) up = up.parent_path();
      if (!fs::is_directory(up, ec) || ::access(up.c_str(), W_OK) != 0)
        issues.push_back({"expert_offload_disk_path", "'" + c.expert_offload_disk_path + "' does not exist and cannot be "
                                                      "created: '" + up.string() + "' is not a writable directory"});
    }
  }
  if (!c.resume_from_checkpoint.empty() && c.resume_from_checkpoint != "auto" &&
      !fs::is_directory(c.resume_from_checkpoint))
    issues.push_back({"resume_from_checkpoint", shown_path(c, c.resume_from_checkpoint) + " is not a folder (use a checkpoint folder or auto)"});
  // The run's adapter would become part of the base model's identity (and its weights folder).
  if (std::error_code ec1, ec2; !c.output_dir.empty() && fs::exists(c.base_model, ec1) && fs::exists(c.output_dir, ec2) &&
                                fs::equivalent(c.output_dir, c.base_model, ec1))
    issues.push_back({"output_dir", "'" + c.output_dir + "' is the base_model folder; the run's adapter and checkpoints "
                                    "would be written among the model's weights: choose another output_dir"});
}

namespace {

// The families whose fused experts lora_target_parameters reaches, for messages ("a, b and c").
std::string fused_expert_lora_families() {
  std::vector<std::string> names;
  for (const auto& f : model::families())
    if (f.fused_expert_lora) names.push_back(f.model_type);
  std::string out;
  for (std::size_t i = 0; i < names.size(); ++i)
    out += (i == 0 ? "" : i + 1 == names.size() ? " and " : ", ") + names[i];
  return out;
}

// peft's lora_target_modules forms against the architecture's module names: a regular expression
// (one string) must match a whole name, a list entry equal the name or a dotted suffix of it.
// eo-ddp adapts a linear by its short name in every layer and expert, so the selection must take
// all the modules of a short name or none; it resolves to those short names.
void resolve_target_forms(TrainConfig& c, const model::ModelConfig& mc, const std::vector<std::string>& linears, Issues& issues) {
  bool forms = c.lora_target_regex;
  for (const auto& t : c.lora_target_modules) forms |= t.find('.') != std::string::npos;
  if (!forms) return;
  std::regex re;
  if (c.lora_target_regex) re = std::regex(c.lora_target_modules.at(0));
  auto selected = [&](const std::string& name) {
    if (c.lora_target_regex) return std::regex_match(name, re);
    for (const auto& t : c.lora_target_modules)
      if (name == t || ends_with(name, "." + t)) return true;
    return false;
  };
  const std::string what = c.lora_target_regex ? "'" + c.lora_target_modules[0] + "'" : "[" + join(c.lora_target_modules, ", ") + "]";
  std::map<std::string, std::pair<std::vector<std::string>, std::vector<std::string>>> by_short;  // selected, not
  std::vector<std::string> refused;
  for (const auto& [name, ok] : model::hf_linear_modules(mc)) {
    const std::string short_name = name.substr(name.rfind('.') + 1);
    const bool sel = selected(name);
    if (sel && !ok) refused.push_back(name);
    if (ok) (sel ? by_short[short_name].first : by_short[short_name].second).push_back(name);
  }
  if (!refused.empty())
    issues.push_back({"lora_target_modules", what + " selects " + refused[0] + (refused.size() > 1 ? " and others" : "") +
                                                 ", which eo-ddp does not adapt (its linears are " + join(linears, ", ") + ")"});
  std::vector<std::string> resolved;
  for (const auto& s : linears) {
    const auto it = by_short.find(s);
    if (it == by_short.end() || it->second.first.empty()) continue;
    if (!it->second.second.empty()) {
      issues.push_back({"lora_target_modules", what + " selects " + std::to_string(it->second.first.size()) + " of the " +
                                                   std::to_string(it->second.first.size() + it->second.second.size()) + " " +
                                                   s + " modules (" + it->second.first[0] + " but not " +
                                                   it->second.second[0] + "); eo-ddp adapts a module name in every layer "
                                                   "and expert or in none (some layers: peft_layers_to_transform)"});
      continue;
    }
    resolved.push_back(s);
  }
  if (resolved.empty() && refused.empty())
    issues.push_back({"lora_target_modules", what + " matches no linear of " + mc.model_type + " (" + c.base_model +
                                                 "/config.json); its module names are like model.layers.0.self_attn." +
                                                 linears[0] + " and its linears are " + join(linears, ", ")});
  c.lora_target_modules = resolved;
  c.lora_target_regex = false;
}

// lora_model_dir's adapter must be the adapter this config trains: the same r, alpha, rsLoRA and
// targets (peft's adapter_config.json, read here without the model code).
void check_lora_model_dir(const TrainConfig& c, Issues& issues) {
  if (c.lora_model_dir.empty()) return;
  const fs::path dir(c.lora_model_dir);
  const fs::path json_path = dir / "adapter_config.json";
  if (!fs::is_regular_file(json_path) || !fs::is_regular_file(dir / "adapter_model.safetensors"))
    return issues.push_back({"lora_model_dir", shown_path(c, c.lora_model_dir) + " is not a peft adapter folder (adapter_config.json and "
                                               "adapter_model.safetensors)"});
  nlohmann::json j;
  try {
    std::ifstream in(json_path);
    j = nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    return issues.push_back({"lora_model_dir", json_path.string() + ": not valid JSON (" + e.what() + ")"});
  }
  if (!j.is_object()) return issues.push_back({"lora_model_dir", json_path.string() + ": expected a JSON object"});
  const std::string from = " (" + json_path.string() + ")";
  auto number = [&](const char* k) { return j.contains(k) && j[k].is_number() ? j[k].get<double>() : NAN; };
  if (number("r") != c.lora_r)
    issues.push_back({"lora_r", std::to_string(c.lora_r) + ", but lora_model_dir's adapter has r " + j.value("r", nlohmann::json()).dump() + from});
  if (number("lora_alpha") != c.lora_alpha)
    issues.push_back({"lora_alpha", value_node(c.lora_alpha).Scalar() + ", but lora_model_dir's adapter has lora_alpha " +
                                        j.value("lora_alpha", nlohmann::json()).dump() + from});
  if (j.value("use_rslora", false) != c.peft_use_rslora)
    issues.push_back({"peft_use_rslora", std::string(c.peft_use_rslora ? "true" : "false") + ", but lora_model_dir's adapter has use_rslora " +
                                             (j.value("use_rslora", false) ? "true" : "false") + from});
  std::set<std::string> theirs, ours(c.lora_target_modules.begin(), c.lora_target_modules.end());
  const auto t = j.value("target_modules", nlohmann::json());
  if (t.is_array())
    for (const auto& x : t)
      if (x.is_string()) theirs.insert(x.get<std::string>());
  if (t.is_string()) theirs.insert("(regular expression) " + t.get<std::string>());
  if (theirs != ours)
    issues.push_back({"lora_target_modules", "[" + join(c.lora_target_modules, ", ") + "], but lora_model_dir's adapter targets [" +
                                                 join(std::vector<std::string>(theirs.begin(), theirs.end()), ", ") + "]" + from});
  std::set<std::string> their_params, our_params(c.lora_target_parameters.begin(), c.lora_target_parameters.end());
  const auto tp = j.value("target_parameters", nlohmann::json());
  if (tp.is_array())
    for (const auto& x : tp)
      if (x.is_string()) {
        const std::string n = x.get<std::string>();
        their_params.insert(ends_with("mlp.experts.gate_up_proj", n) ? "mlp.experts.gate_up_proj"
                            : ends_with("mlp.experts.down_proj", n)  ? "mlp.experts.down_proj"
                                                                     : n);
      }
  if (their_params != our_params)
    issues.push_back({"lora_target_parameters", "[" + join(c.lora_target_parameters, ", ") + "], but lora_model_dir's adapter has [" +
                                                    join(std::vector<std::string>(their_params.begin(), their_params.end()), ", ") + "]" + from});
  std::set<int> their_layers, our_layers(c.peft_layers_to_transform.begin(), c.peft_layers_to_transform.end());
  const auto lt = j.value("layers_to_transform", nlohmann::json());
  if (lt.is_number_integer()) their_layers.insert(lt.get<int>());
  if (lt.is_array())
    for (const auto& x : lt)
      if (x.is_number_integer()) their_layers.insert(x.get<int>());
  auto layers_text = [](const std::set<int>& l) {
    std::string t;
    for (int i : l) t += (t.empty() ? "" : ", ") + std::to_string(i);
    return l.empty() ? std::string("every layer") : "[" + t + "]";
  };
  if (their_layers != our_layers)
    issues.push_back({"peft_layers_to_transform", layers_text(our_layers) + ", but lora_model_dir's adapter adapts " +
                                                      layers_text(their_layers) + from});
}

}  // namespace

void check_targets(TrainConfig& c, const std::set<std::string>& present, Issues& issues, model::ModelConfig* parsed) {
  if (!present.count("base_model") || c.base_model.empty()) return;
  model::ModelConfig mc;
  try {
    mc = load_model_config(c, &c.warnings);
    if (parsed) *parsed = mc;
  } catch (const ModelOverrideError& e) {
    issues.push_back({"overrides_of_model_config", e.what()});
    return;
  } catch (const std::exception& e) {
    // An unsupported or malformed config.json is listed with the key problems, so one --check
    // names them all; a missing folder or config.json is check_files' to report.
    if (fs::is_regular_file(fs::path(c.base_model) / "config.json")) issues.push_back({"base_model", e.what()});
    return;
  }
  note_named_template(c.chat_template, "chat_template", mc, c.warnings);
  for (auto* list : {&c.datasets, &c.test_datasets})
    for (std::size_t i = 0; i < list->size(); ++i)
      note_named_template((*list)[i].chat_template,
                          std::string(list == &c.datasets ? "datasets." : "test_datasets.") + std::to_string(i) + ".chat_template",
                          mc, c.warnings);
  for (int l : c.peft_layers_to_transform)
    if (l >= mc.layers) {
      issues.push_back({"peft_layers_to_transform", std::to_string(l) + " is no layer of " + mc.model_type + " (" + c.base_model +
                                                        "/config.json has layers 0 to " + std::to_string(mc.layers - 1) + ")"});
      break;
    }
  if (c.expert_quant == "mxfp4" && !mc.mxfp4_experts)
    issues.push_back({"expert_quant", "mxfp4 keeps experts in the MXFP4 a checkpoint stores them in, but " + c.base_model +
                                      "/config.json (" + mc.model_type + ") has no quantization_config with quant_method "
                                      "mxfp4; use expert_quant: nf4 or auto"});
  if (c.nvfp4_merge_aware && !mc.nvfp4)
    issues.push_back({"nvfp4_merge_aware", "snaps the LoRA delta onto an NVFP4 base's grid, but " + c.base_model +
                                           "/config.json (" + mc.model_type + ") is no NVFP4 checkpoint (quantization_config "
                                           "quant_method modelopt, quant_algo NVFP4); use an NVFP4 base_model or remove "
                                           "nvfp4_merge_aware"});
  else if (c.nvfp4_merge_aware && !c.lora_target_parameters.empty() && c.load_in_4bit && c.expert_quant == "nf4")
    issues.push_back({"expert_quant", "nf4 re-quantises the NVFP4 experts, so nvfp4_merge_aware has no NVFP4 grid to snap "
                                      "them to; use expert_quant: auto"});
  if (c.output_router_logits && !mc.has_aux_loss)
    issues.push_back({"output_router_logits", mc.model_type + " has no router auxiliary loss in transformers (it balances "
                                              "its experts with e_score_correction_bias, or not at all); set it to false"});
  if (!c.lora_target_parameters.empty()) {
    if (mc.moe_layer_count() == 0)
      issues.push_back({"lora_target_parameters", mc.model_type + " (" + c.base_model + "/config.json) has no MoE block, "
                                                  "so no fused expert parameter to adapt"});
    else if (!mc.fused_expert_lora_ok())
      issues.push_back({"lora_target_parameters", "implemented for " + fused_expert_lora_families() +
                                                  "; not for " + mc.model_type + ": use lora_target_modules"});
  }
  if (!c.lora_target_parameters.empty() && mc.experts_lora_ok()) {
    // peft 0.21 on transformers 5 rewrites expert names in target_modules (gate_proj, up_proj,
    // down_proj, w1, w2, w3) into target_parameters, gate_up_proj at rank 2r, when it loads an
    // adapter: beside lora_target_parameters the adapter would not load as trained. Only for the
    // families whose experts were per-expert linears before transformers 5 fused them: gpt-oss,
    // Gemma 4 and Llama 4 were always fused (transformers maps them to no MoE conversion), and
    // their gate/up/down_proj are a shared expert or dense MLP, which peft keeps.
    static const char* kWhy = "peft 0.21 on transformers 5 maps these names onto the fused expert parameters "
                              "(gate_up_proj at rank 2r) when it loads the adapter, so together with "
                              "lora_target_parameters it would not load as trained";
    if (present.count("lora_target_linear") && c.lora_target_linear) {
      issues.push_back({"lora_target_linear", std::string("cannot be combined with lora_target_parameters: it adapts "
                                                          "gate_proj/up_proj/down_proj (w1/w2/w3), and ") + kWhy +
                                                  "; list the attention modules in lora_target_modules instead"});
    } else {
      std::vector<std::string> experts;
      for (const auto& t : c.lora_target_modules)
        for (const auto& n : model::expert_linear_names())
          if (t == n) experts.push_back(t);
      if (!experts.empty())
        issues.push_back({"lora_target_modules", "names " + join(experts, ", ") + " beside lora_target_parameters; " +
                                                     kWhy + "; keep the attention modules only"});
    }
  }
  const std::vector<std::string> linears = mc.linear_modules();
  if (c.lora_target_linear) {
    c.lora_target_modules = linears;
    return check_lora_model_dir(c, issues);
  }
  // Unset, the targets are the architecture's attention linears (DeepSeek's latent attention has
  // no k_proj or v_proj), as peft's per-model defaults are attention projections.
  if (!present.count("lora_target_modules")) {
    c.lora_target_modules = mc.attention_linears();
    return check_lora_model_dir(c, issues);
  }
  resolve_target_forms(c, mc, linears, issues);
  // As peft: a name that matches no module is no error while another name matches one (axolotl's
  // examples list q/k/v/o_proj also for latent attention, which has no k_proj); the list as a whole
  // matching nothing is. Either way the log names what is dropped.
  const std::vector<std::string>& known = model::all_linear_modules();  // other names: reported by the key's own check
  std::vector<std::string> kept, unmatched;
  for (const auto& t : c.lora_target_modules) {
    const bool is_linear = std::find(linears.begin(), linears.end(), t) != linears.end();
    if (!is_linear && std::find(known.begin(), known.end(), t) != known.end()) unmatched.push_back(t);
    else kept.push_back(t);
  }
  const bool any_match = std::any_of(kept.begin(), kept.end(), [&](const std::string& t) {
    return std::find(linears.begin(), linears.end(), t) != linears.end();
  });
  if (!unmatched.empty() && any_match) {
    std::vector<std::string> quoted;
    for (const auto& t : unmatched) quoted.push_back("'" + t + "'");
    c.warnings.push_back("lora_target_modules: " + join(quoted, ", ") + (unmatched.size() > 1 ? " match" : " matches") +
                         " no linear of " + mc.model_type + " (its linears are " + join(linears, ", ") +
                         "); as peft does, only the names that match are adapted: " + join(kept, ", "));
    c.lora_target_modules = kept;
  } else {
    for (const auto& t : unmatched)
      issues.push_back({"lora_target_modules", "'" + t + "' matches no linear of " + mc.model_type + " (" + c.base_model +
                                                   "/config.json); its linears are " + join(linears, ", ") +
                                                   " (or set lora_target_linear: true)"});
  }
  check_lora_model_dir(c, issues);
}

}  // namespace eo::config_detail
