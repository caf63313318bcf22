// The schema table: every config key eo-ddp reads, with its type, default, documentation line,
// reader and writer (runtime/config_schema.h). `eo-ddp --help-config`, docs/configuration.md and the
// resolved-config printout are generated from it.
#include <algorithm>
#include <cmath>
#include <regex>

#include "common/text.h"
#include "models/hf_config.h"
#include "runtime/config_chat_templates.h"
#include "runtime/config_datasets.h"
#include "runtime/config_schema.h"
#include "runtime/model_overrides.h"
#include "runtime/yaml_values.h"

namespace eo::config_detail {

const std::vector<KeySpec>& schema() {
  static const std::vector<KeySpec> keys = [] {
    std::vector<KeySpec> k;
    // --- model and adapter
    k.push_back(text("base_model", &TrainConfig::base_model,
                     "Hugging Face checkpoint folder (config.json + *.safetensors), or a model named as on the Hub "
                     "(org/name): read from the Hugging Face cache (HF_HUB_CACHE, else HF_HOME/hub), downloaded into it "
                     "when missing unless HF_HUB_OFFLINE=1. A local folder wins over a Hub name. Required."));
    k.push_back(text("revision_of_model", &TrainConfig::base_model_revision,
                     "The branch, tag or commit of a base_model named as on the Hub (default main)."));
    k.push_back(boolean("synthetic_weights", &TrainConfig::synthetic_weights,
                        "Initialise the frozen base model with seeded random weights (NF4 drawn directly on the device; MXFP4 "
                        "experts when they are held so, see expert_quant) from "
                        "base_model/config.json alone: for benchmarks and memory planning on real shapes without a download."));
    k.push_back(boolean("load_in_4bit", &TrainConfig::load_in_4bit,
                        "Quantise the decoder blocks' linear weights to NF4 (bitsandbytes layout). Required for adapter: qlora."));
    k.push_back(choice("adapter", &TrainConfig::adapter, {"qlora", "lora"},
                       "qlora: LoRA on an NF4 base (needs load_in_4bit: true); lora: LoRA on a bf16/fp32 base. Required."));
    k.push_back(integer("lora_r", &TrainConfig::lora_r, 1, 4096, "LoRA rank."));
    k.push_back(real("lora_alpha", &TrainConfig::lora_alpha, 0, true, INFINITY, "LoRA scaling numerator: scale = alpha / r (alpha / sqrt(r) with rsLoRA)."));
    k.push_back(real("lora_dropout", &TrainConfig::lora_dropout, 0, false, 0.99, "Dropout on the LoRA input."));
    k.push_back({"lora_target_modules", "list of strings", "[q_proj, k_proj, v_proj, o_proj]",
                 "Module names to adapt: attention q_proj/k_proj/v_proj/o_proj (DeepSeek latent attention: q_proj or "
                 "q_a_proj/q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj); experts gate_proj/up_proj/down_proj "
                 "(Mixtral: w1/w3/w2); dense MLP and shared experts use the same names. As in peft, a list may name "
                 "dotted suffixes (self_attn.q_proj) and one string is a regular expression matched against whole "
                 "module names (model.layers.N.self_attn.q_proj, model.layers.N.mlp.experts.E.gate_proj); either must "
                 "select a name in every layer and expert or in none (some layers: peft_layers_to_transform). Unset: the architecture's attention linears.",
                 [](const YAML::Node& n, TrainConfig& c, Issues& issues) {
                   // peft's forms: one string is a regular expression matched against whole module
                   // names; a list names modules or dotted suffixes of their names (check_targets).
                   if (n.IsScalar()) {
                     try {
                       std::regex re(n.Scalar());
                     } catch (const std::regex_error& e) {
                       return issues.push_back({"lora_target_modules", "'" + n.Scalar() + "' is not a regular expression "
                                                                       "eo-ddp reads (ECMAScript syntax): " + e.what()});
                     }
                     c.lora_target_modules = {n.Scalar()};
                     c.lora_target_regex = true;
                     return;
                   }
                   const auto parsed = string_list("lora_target_modules", n, "module names", issues);
                   if (!parsed) return;
                   const std::vector<std::string>& v = *parsed;
                   const std::vector<std::string>& known = model::all_linear_modules();
                   for (const auto& m : v) {
                     bool ok = m.find('.') != std::string::npos;  // a suffix: resolved against the architecture
                     for (const auto& kn : known) ok |= kn == m;
                     if (!ok) {
                       std::string msg = "unknown module '" + m + "'; eo-ddp can adapt " + join(known, ", ");
                       if (auto s = closest_match(m, known)) msg += " (did you mean '" + *s + "'?)";
                       issues.push_back({"lora_target_modules", msg});
                     }
                   }
                   c.lora_target_modules = v;
                 },
                 writer(&TrainConfig::lora_target_modules)});
    k.push_back(boolean("lora_target_linear", &TrainConfig::lora_target_linear,
                        "Adapt every linear layer of the decoder blocks, as base_model's architecture names them (attention q/k/v/o_proj; experts w1/w2/w3 in Mixtral, gate/up/down_proj elsewhere; dense MLPs); overrides lora_target_modules."));
    k.push_back({"lora_target_parameters", "list of strings", "[]",
                 "peft's target_parameters: LoRA on the fused expert parameters as peft's ParamWrapper defines it "
                 "(mlp.experts.gate_up_proj: gate and up share one A per expert; mlp.experts.down_proj; their dotted "
                 "suffixes experts.gate_up_proj, gate_up_proj, ... are the same parameters, as peft matches them; "
                 "Gemma 4's are experts.gate_up_proj / experts.down_proj and Llama 4's feed_forward.experts.gate_up_proj / "
                 "feed_forward.experts.down_proj, as the adapter says). The adapter loads in peft on transformers 5, whose "
                 "experts are fused. Beside it lora_target_modules names attention modules only (no expert names, no "
                 "lora_target_linear: peft would load those as the fused parameters at rank 2r; on Gemma 4 and Llama 4 they "
                 "are the dense MLP and shared expert, which peft keeps); needs lora_dropout: 0.",
                 [](const YAML::Node& n, TrainConfig& c, Issues& issues) {
                   const auto parsed = string_list("lora_target_parameters", n, "parameter names", issues);
                   if (!parsed) return;
                   const std::vector<std::string>& v = *parsed;
                   // Canonical names (peft's and axolotl's); the bare names are the same parameters.
                   // (Kept here rather than in models/lora.cpp: the config parser is fuzzed alone.)
                   static const std::vector<std::string> accepted = {"mlp.experts.gate_up_proj", "mlp.experts.down_proj",
                                                                     "gate_up_proj", "down_proj"};
                   // Llama 4's module path for the same two parameters (peft's own example spells them so).
                   static const std::vector<std::string> llama4 = {"feed_forward.experts.gate_up_proj",
                                                                   "feed_forward.experts.down_proj"};
                   std::vector<std::string> canonical;
                   // peft matches a parameter name by its dotted suffix: experts.gate_up_proj too.
                   auto suffix_of = [](const std::string& full, const std::string& m) {
                     return full == m || (full.size() > m.size() && ends_with(full, m) && full[full.size() - m.size() - 1] == '.');
                   };
                   auto canonical_of = [&](const std::string& m) -> std::string {
                     if (suffix_of(accepted[0], m) || suffix_of(llama4[0], m)) return accepted[0];
                     if (suffix_of(accepted[1], m) || suffix_of(llama4[1], m)) return accepted[1];
                     return "";
                   };
                   // axolotl's gpt-oss examples name the experts of single layers, under its checkpointing
                   // wrapper ("22._checkpoint_wrapped_module.mlp.experts.gate_up_proj"): peft adapts those
                   // layers only, which eo-ddp does with peft_layers_to_transform.
                   std::vector<std::string> one_layer, layers;
                   auto layer_of = [&](const std::string& m) -> std::string {
                     const auto dot = m.find('.');
                     if (dot == 0 || dot == std::string::npos || m.find_first_not_of("0123456789") != dot) return "";
                     std::string rest = m.substr(dot + 1);
                     static const std::string wrapper = "_checkpoint_wrapped_module.";
                     if (rest.rfind(wrapper, 0) == 0) rest = rest.substr(wrapper.size());
                     return canonical_of(rest).empty() ? "" : m.substr(0, dot);
                   };
                   for (const auto& m : v) {
                     const std::string cm = canonical_of(m);
                     if (const std::string layer = cm.empty() ? layer_of(m) : ""; !layer.empty()) {
                       one_layer.push_back(m);
                       if (std::find(layers.begin(), layers.end(), layer) == layers.end()) layers.push_back(layer);
                     } else if (cm.empty()) {
                       std::string msg = "unknown parameter '" + m + "'; eo-ddp can adapt the fused expert parameters " +
                                         join(accepted, ", ");
                       if (auto s = closest_match(m, accepted)) msg += " (did you mean '" + *s + "'?)";
                       issues.push_back({"lora_target_parameters", msg});
                     } else if (std::find(canonical.begin(), canonical.end(), cm) == canonical.end()) {
                       canonical.push_back(cm);
                     }
                   }
                   if (!one_layer.empty())
                     issues.push_back({"lora_target_parameters",
                                       join(one_layer, ", ") + " name the parameters of single layers; eo-ddp adapts a "
                                       "parameter in every adapted layer: name it without the layer (gate_up_proj, down_proj) "
                                       "and, to adapt those layers only, set peft_layers_to_transform: [" + join(layers, ", ") +
                                           "] (which limits lora_target_modules to them too)"});
                   // One order (gate_up_proj, down_proj) whatever the user's: resume compares it.
                   std::sort(canonical.begin(), canonical.end(), [&](const std::string& a, const std::string& b) {
                     return (a == accepted[0]) > (b == accepted[0]);
                   });
                   c.lora_target_parameters = canonical;
                 },
                 writer(&TrainConfig::lora_target_parameters)});
    k.push_back({"peft_layers_to_transform", "list of integers", "[]",
                 "peft's layers_to_transform: only the decoder layers with these indices (model.layers.N) are adapted, "
                 "their lora_target_modules and lora_target_parameters alike; the adapter's adapter_config.json says "
                 "so, as peft writes it. Unset: every layer.",
                 [](const YAML::Node& n, TrainConfig& c, Issues& issues) {
                   std::vector<int> v;
                   auto one = [&](const YAML::Node& x) {
                     const auto i = x.IsScalar() ? as_int(x) : std::nullopt;
                     if (!i || *i < 0 || *i > (1 << 20)) return false;
                     v.push_back(static_cast<int>(*i));
                     return true;
                   };
                   bool ok = true;
                   if (n.IsSequence())
                     for (const auto& x : n) ok &= one(x);
                   else ok = one(n);
                   if (!ok)
                     return issues.push_back({"peft_layers_to_transform", "expected a layer index >= 0 or a list of them"});
                   std::sort(v.begin(), v.end());
                   v.erase(std::unique(v.begin(), v.end()), v.end());
                   c.peft_layers_to_transform = v;
                 },
                 [](const TrainConfig& c) {
                   YAML::Node n(YAML::NodeType::Sequence);
                   for (int i : c.peft_layers_to_transform) n.push_back(i);
                   return n;
                 }});
    k.push_back({"peft_layers_pattern", "list of strings", "[layers]",
                 "peft's layers_pattern, the name of the module list peft_layers_to_transform indexes: the decoder "
                 "layers are model.layers in every architecture eo-ddp trains, so only layers is accepted.",
                 [](const YAML::Node& n, TrainConfig&, Issues& issues) {
                   const bool ok = (n.IsScalar() && n.Scalar() == "layers") ||
                                   (n.IsSequence() && n.size() == 1 && n[0].IsScalar() && n[0].Scalar() == "layers");
                   if (!ok)
                     issues.push_back({"peft_layers_pattern", yaml_text(n) + " names no module list of eo-ddp's models; their "
                                                              "decoder layers are model.layers (peft_layers_pattern: [layers])"});
                 },
                 [](const TrainConfig&) { return YAML::Node(); }});
    k.push_back(boolean("peft_use_rslora", &TrainConfig::peft_use_rslora, "rsLoRA scaling alpha / sqrt(r)."));
    k.push_back(boolean("nvfp4_merge_aware", &TrainConfig::nvfp4_merge_aware,
                        "axolotl's merge-aware NVFP4 LoRA (with use_sonicmoe and adapter: lora on an NVFP4 base): every "
                        "LoRA-carrying NVFP4 weight (experts and linears) trains through Q(dequant(W) + scaling * B A), Q "
                        "torchao's NVFP4 quantiser (fresh E4M3 block scales on the weight's global scale), with "
                        "straight-through gradients, so that merging the adapter into an NVFP4 checkpoint keeps what "
                        "was trained. The adapter's adapter_config.json records it (nvfp4_merge_aware)."));
    k.push_back({"nvfp4_merge_aware_start_step", "int or float", "0",
                 "nvfp4_merge_aware from this optimizer step on (plain LoRA before): a whole number of completed "
                 "steps, or a fraction in (0, 1) of the run's steps (int(fraction * steps), as axolotl).",
                 [](const YAML::Node& n, TrainConfig& c, Issues& issues) {
                   // axolotl's check_nvfp4_merge_aware: an int >= 0 or a float in (0, 1); true/false
                   // and floats such as 2.0 are refused.
                   const auto i = n.IsScalar() && n.Scalar().find_first_of(".eE") == std::string::npos ? as_int(n) : std::nullopt;
                   const auto d = as_double(n);
                   if (i ? *i < 0 : !(d && *d > 0 && *d < 1))
                     return issues.push_back({"nvfp4_merge_aware_start_step", "must be an int >= 0 (absolute step) or a float in "
                                                                              "(0, 1) (fraction of max steps), got '" + yaml_text(n) + "'"});
                   c.nvfp4_merge_aware_start_step = i ? static_cast<double>(*i) : *d;
                 },
                 writer(&TrainConfig::nvfp4_merge_aware_start_step)});
    k.push_back(integer("bnb_4bit_blocksize", &TrainConfig::bnb_4bit_blocksize, 32, 4096,
                        "NF4 quantisation block size (a power of two, as bitsandbytes)."));
    k.push_back(boolean("bnb_4bit_use_double_quant", &TrainConfig::bnb_4bit_use_double_quant,
                        "Quantise the NF4 absmax statistics again (8-bit, blocks of 256), as bitsandbytes' compress_statistics."));
    k.push_back(choice("expert_quant", &TrainConfig::expert_quant, {"auto", "nf4", "mxfp4"},
                       "With load_in_4bit, the format the routed experts are held in (homes and device): auto keeps a "
                       "checkpoint's MXFP4 experts (gpt-oss as the Hub ships it: 4.25 bits per weight, lossless with "
                       "respect to the checkpoint, dequantised to bf16 on the fly) and quantises any other to NF4; nf4 "
                       "always NF4 (MXFP4 experts are dequantised first, as transformers' Mxfp4Config(dequantize=True)); "
                       "mxfp4 requires an MXFP4 checkpoint."));
    k.push_back(boolean("output_router_logits", &TrainConfig::output_router_logits,
                        "Add the router load-balancing auxiliary loss (coefficient from config.json or router_aux_loss_coef)."));
    k.push_back({"overrides_of_model_config", "map", "(none)",
                 "Values that replace base_model/config.json's top-level keys (rope_scaling, rope_theta, "
                 "max_position_embeddings, ...), as axolotl sets them; ones that change the weights' shapes are refused. "
                 "Older configs: model_config.",
                 [](const YAML::Node& n, TrainConfig& c, Issues& issues) {
                   read_model_config_overrides(n, "overrides_of_model_config", c, issues);
                 },
                 [](const TrainConfig& c) {
                   YAML::Node m;
                   for (const auto& [k, v] : c.model_config_overrides) m[k] = YAML::Load(v);  // JSON is YAML
                   return m;
                 }});
    k.push_back({"router_aux_loss_coef", "float", "(from config.json)", "Overrides the checkpoint's router auxiliary loss coefficient.",
                 [](const YAML::Node& n, TrainConfig& c, Issues& issues) {
                   auto v = as_double(n);
                   if (!v || *v < 0) return issues.push_back({"router_aux_loss_coef", "expected a number >= 0, got '" + yaml_text(n) + "'"});
                   c.router_aux_loss_coef = *v;
                 },
                 writer(&TrainConfig::router_aux_loss_coef)});
    // --- data
    k.push_back({"datasets", "list of datasets", "(required)",
                 "Training data, as axolotl writes it: a list of `- path: F.jsonl` entries with `type:` chat_template "
                 "(messages rendered with the chat template), alpaca, completion or input_output -- tokenised once "
                 "with the model's tokenizer through transformers into dataset_prepared_path -- or the pre-tokenized "
                 "tokenized (JSONL with input_ids, optional labels) and tokens (a flat binary token file), read with "
                 "no Python. Each entry's keys: the datasets[] table (eo-ddp --help-config datasets[].KEY).",
                 [](const YAML::Node& n, TrainConfig& c, Issues& issues) { read_datasets(n, "datasets", c.datasets, c.warnings, issues); },
                 [](const TrainConfig& c) { return write_datasets(c.datasets); }});
    k.push_back({"test_datasets", "list of datasets", "(none)",
                 "Evaluation data, entries as in datasets (exclusive with val_set_size).",
                 [](const YAML::Node& n, TrainConfig& c, Issues& issues) {
                   read_datasets(n, "test_datasets", c.test_datasets, c.warnings, issues);
                 },
                 [](const TrainConfig& c) { return c.test_datasets.empty() ? YAML::Node() : write_datasets(c.test_datasets); }});
    k.push_back(text("dataset_prepared_path", &TrainConfig::dataset_prepared_path,
                     "Cache of the tokenised axolotl-format datasets: one folder per dataset, named by a hash of the "
                     "data file, the tokenizer files and every key that shapes its tokens; a missing or stale one is "
                     "built by rank 0 at start (or by eo-ddp preprocess --config F). Relative to the working folder."));
    k.push_back(integer("dataset_prepare_timeout", &TrainConfig::dataset_prepare_timeout, 10, 1 << 24,
                        "Seconds the other ranks wait for rank 0 to tokenise the datasets before the run is ended."));
    k.push_back(boolean("train_on_inputs", &TrainConfig::train_on_inputs,
                        "Train on the prompt too (system/user turns, alpaca's prompt, input_output's unlabelled "
                        "segments). false: those tokens get label -100, as in axolotl. Pre-tokenized data keeps its labels."));
    k.push_back({"chat_template", "string", "tokenizer_default",
                 "Template for type: chat_template: tokenizer_default (the tokenizer's own), "
                 "tokenizer_default_fallback_chatml (the tokenizer's, else ChatML), jinja (chat_template_jinja), or "
                 "one of axolotl's named templates (every one axolotl 0.19.0 ships, and inst of older releases), "
                 "copied unchanged and rendered as axolotl does on any model: chatml, llama3, mistral_v2v3, qwen3, ...",
                 [](const YAML::Node& n, TrainConfig& c, Issues& issues) {
                   const std::string v = n.IsScalar() ? n.Scalar() : yaml_text(n);
                   if (auto why = template_problem(v)) issues.push_back({"chat_template", *why});
                   else c.chat_template = v;
                 },
                 writer(&TrainConfig::chat_template)});
    k.push_back(text("chat_template_jinja", &TrainConfig::chat_template_jinja, "The template text for chat_template: jinja."));
    k.push_back(text("tokenizer_config", &TrainConfig::tokenizer_config,
                     "Tokenizer folder for the axolotl formats (default: base_model)."));
    k.push_back(text("tokenizer_type", &TrainConfig::tokenizer_type, "transformers tokenizer class (default AutoTokenizer)."));
    k.push_back(boolean("trust_remote_code", &TrainConfig::trust_remote_code,
                        "Let transformers run the tokenizer's own code (the model itself runs no Python)."));
    k.push_back({"special_tokens", "map of token names", "(none)",
                 "pad_token / eos_token / bos_token / unk_token set on the tokenizer before tokenising; each must "
                 "already be in its vocabulary (eo-ddp does not add tokens: the embeddings are frozen).",
                 [](const YAML::Node& n, TrainConfig& c, Issues& issues) {
                   if (!n.IsMap()) return issues.push_back({"special_tokens", "expected a map such as {pad_token: \"<|endoftext|>\"}"});
                   static const std::vector<std::string> names = {"pad_token", "eos_token", "bos_token", "unk_token"};
                   c.special_tokens.clear();
                   for (const auto& kv : n) {
                     const std::string k2 = key_text(kv.first);
                     if (std::find(names.begin(), names.end(), k2) == names.end()) {
                       issues.push_back({"special_tokens." + k2, "unknown; eo-ddp sets " + join(names, ", ")});
                       continue;
                     }
                     if (!kv.second.IsScalar() || kv.second.Scalar().empty())
                       issues.push_back({"special_tokens." + k2, "expected a token string"});
                     else c.special_tokens.emplace_back(k2, kv.second.Scalar());
                   }
                 },
                 [](const TrainConfig& c) {
                   if (c.special_tokens.empty()) return YAML::Node();
                   YAML::Node m(YAML::NodeType::Map);
                   for (const auto& [k2, v] : c.special_tokens) m[k2] = v;
                   return m;
                 }});
    k.push_back({"eot_tokens", "list of strings", "[eos_token]",
                 "Tokens that end a turn in the chat template (e.g. gpt-oss <|end|>), labelled after a turn as "
                 "datasets[].train_on_eot says (default: its train_on_eos), as axolotl; each must be one token of the "
                 "tokenizer, and one the template never writes is dropped with a warning.",
                 [](const YAML::Node& n, TrainConfig& c, Issues& issues) {
                   if (const auto v = string_list("eot_tokens", n, "token strings", issues)) c.eot_tokens = *v;
                 },
                 [](const TrainConfig& c) { return c.eot_tokens.empty() ? YAML::Node() : YAML::Node(c.eot_tokens); }});
    k.push_back(integer("sequence_len", &TrainConfig::sequence_len, 2, 1 << 20, "Tokens per sequence. A longer pre-tokenized document is truncated (cut into pieces with sample_packing); as "
                        "axolotl, a longer chat_template / alpaca / input_output row is dropped (counted in the log) and a "
                        "completion text is cut into pieces."));
    k.push_back(boolean("sample_packing", &TrainConfig::sample_packing,
                        "Pack several documents into one sequence; attention never crosses a document boundary (on a "
                        "GPU of sm_80 or newer through flash attention's variable-length form, at the unpacked step's "
                        "speed; else with a document mask)."));
    k.push_back(integer("micro_batch_size", &TrainConfig::micro_batch_size, 1, 1 << 16, "Sequences per rank per micro-step."));
    k.push_back(integer("gradient_accumulation_steps", &TrainConfig::gradient_accumulation_steps, 1, 1 << 16,
                        "Micro-steps per optimizer step."));
    k.push_back(real("num_epochs", &TrainConfig::num_epochs, 0, true, 1e6, "Passes over the data (used when max_steps is not set)."));
    k.push_back({"max_steps", "int", "(from num_epochs)", "Optimizer steps to run; overrides num_epochs.",
                 [](const YAML::Node& n, TrainConfig& c, Issues& issues) {
                   auto v = as_int(n);
                   if (!v || *v < 1) return issues.push_back({"max_steps", "expected an integer >= 1, got '" + yaml_text(n) + "'"});
                   c.max_steps = *v;
                 },
                 writer(&TrainConfig::max_steps)});
    // --- optimisation
    k.push_back(real("learning_rate", &TrainConfig::learning_rate, 0, true, 10, "Peak learning rate."));
    k.push_back(choice("lr_scheduler", &TrainConfig::lr_scheduler, {"constant", "constant_with_warmup", "linear", "cosine"},
                       "transformers' schedule: constant has no warm-up; constant_with_warmup, linear and cosine "
                       "warm up linearly from 0 over the warm-up steps."));
    k.push_back(integer("warmup_steps", &TrainConfig::warmup_steps, 0, 1 << 30, "Linear warmup steps."));
    k.push_back({"warmup_ratio", "float", "(none)", "Warmup as a fraction of the total steps; exclusive with warmup_steps.",
                 [](const YAML::Node& n, TrainConfig& c, Issues& issues) {
                   auto v = as_double(n);
                   if (!v || *v < 0 || *v >= 1) return issues.push_back({"warmup_ratio", "expected a number in [0, 1), got '" + yaml_text(n) + "'"});
                   c.warmup_ratio = *v;
                 },
                 writer(&TrainConfig::warmup_ratio)});
    k.push_back(real("weight_decay", &TrainConfig::weight_decay, 0, false, 10, "AdamW decoupled weight decay (not applied to biases and norms, as HF)."));
    k.push_back(real("max_grad_norm", &TrainConfig::max_grad_norm, 0, false, 1e9, "Clip the global gradient norm; 0 disables."));
    k.push_back(integer("max_nonfinite_steps", &TrainConfig::max_nonfinite_steps, 1, 1 << 30,
                        "A step whose loss or gradients are NaN/Inf (on any rank) is skipped: no optimizer update, counted as "
                        "skipped_nonfinite in metrics.jsonl. This many consecutive skipped steps (fp16 overflows included) stop the "
                        "run with an error naming the cause; a run none of whose steps updated the adapter fails."));
    k.push_back({"optimizer", "string", "adamw_torch",
                 "AdamW (libtorch's) with fp32 state; adamw_torch_fused, adamw_hf and optimi_adamw are the same "
                 "optimizer. The 8-bit, 4-bit and paged AdamW names (adamw_bnb_8bit, adamw_8bit, paged_adamw_8bit, "
                 "paged_adamw_32bit, adamw_torch_8bit, adamw_torch_4bit, ao_adamw_8bit, ao_adamw_4bit) run it too, "
                 "with a note: the LoRA state is small (r 16 attention LoRA on Qwen3-30B-A3B: 13.4 M parameters, "
                 "107 MB of fp32 moments), so quantising it would save under 0.1 GB and change the update.",
                 [](const YAML::Node& n, TrainConfig& c, Issues& issues) {
                   static const std::vector<std::string> same = {"adamw_torch", "adamw_torch_fused", "adamw_hf", "optimi_adamw"};
                   static const std::vector<std::string> lowbit = {"adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit",
                                                                   "paged_adamw_32bit", "paged_adamw", "adamw_torch_8bit",
                                                                   "adamw_torch_4bit", "ao_adamw_8bit", "ao_adamw_4bit"};
                   const std::string v = n.IsScalar() ? n.Scalar() : yaml_text(n);
                   auto in = [&](const std::vector<std::string>& l) { return std::find(l.begin(), l.end(), v) != l.end(); };
                   if (in(same)) { c.optimizer = v; return; }
                   if (in(lowbit)) {
                     c.optimizer = v;
                     c.warnings.push_back("optimizer " + v + " runs as AdamW with fp32 state: the LoRA optimizer state is "
                                          "small (about 100 MB for r 16 attention LoRA on Qwen3-30B-A3B), so eo-ddp keeps it exact");
                     return;
                   }
                   std::vector<std::string> all = same;
                   all.insert(all.end(), lowbit.begin(), lowbit.end());
                   std::string msg = "unknown value '" + v + "'; eo-ddp's optimizer is AdamW: " + join(all, ", ");
                   if (auto m = closest_match(v, all)) msg += " (did you mean '" + *m + "'?)";
                   issues.push_back({"optimizer", msg});
                 },
                 writer(&TrainConfig::optimizer)});
    k.push_back(real("adam_beta1", &TrainConfig::adam_beta1, 0, false, 0.9999999, "AdamW beta1."));
    k.push_back(real("adam_beta2", &TrainConfig::adam_beta2, 0, false, 0.9999999, "AdamW beta2."));
    k.push_back(real("adam_epsilon", &TrainConfig::adam_epsilon, 0, true, 1, "AdamW epsilon."));
    k.push_back({"seed", "int", "42", "Seed for LoRA init, dropout and data shuffling.",
                 [](const YAML::Node& n, TrainConfig& c, Issues& issues) {
                   auto v = as_int(n);
                   if (!v || *v < 0) return issues.push_back({"seed", "expected an integer >= 0, got '" + yaml_text(n) + "'"});
                   c.seed = *v;
                 },
                 writer(&TrainConfig::seed)});
    // --- precision and memory
    k.push_back({"bf16", "true, false or auto", "auto", "bf16 compute (LoRA master weights and optimizer state stay fp32); auto = bf16 on a GPU with bf16 (compute capability 8.0 or newer), fp16 on one without (unless fp16: false), fp32 on the CPU.",
                 [](const YAML::Node& n, TrainConfig& c, Issues& issues) {
                   if (n.IsScalar() && n.Scalar() == "auto") { c.bf16 = "auto"; return; }
                   if (auto v = as_bool(n)) { c.bf16 = *v ? "true" : "false"; return; }
                   issues.push_back({"bf16", "expected true, false or auto, got '" + yaml_text(n) + "'"});
                 },
                 writer(&TrainConfig::bf16)});
    k.push_back(boolean("fp16", &TrainConfig::fp16,
                        "fp16 compute with dynamic loss scaling (torch's GradScaler: 2^16 at first, halved and the step "
                        "skipped on an overflow, doubled after loss_scale_growth_interval clean steps), for GPUs "
                        "without bf16 (T4, V100); LoRA master weights, optimizer state, router, norm statistics, "
                        "attention softmax, loss and gradient sums stay fp32. Needs bf16: false or auto. Unset: "
                        "bf16: auto picks fp16 on a GPU without bf16; false there means fp32."));
    k.push_back(integer("loss_scale_growth_interval", &TrainConfig::loss_scale_growth_interval, 1, 1 << 30,
                        "fp16 only: consecutive steps without an overflow after which the loss scale doubles "
                        "(GradScaler's growth_interval)."));
    k.push_back({"gradient_checkpointing", "bool or offload", "false",
                 "Recompute each decoder block in backward instead of keeping its activations. axolotl's offload "
                 "(and offload_disk, kept in host RAM) is gradient_checkpointing with activation_offloading.",
                 [](const YAML::Node& n, TrainConfig& c, Issues& issues) {
                   if (auto v = as_bool(n)) { c.gradient_checkpointing = *v; return; }
                   if (n.IsScalar() && (n.Scalar() == "offload" || n.Scalar() == "offload_disk")) {
                     c.gradient_checkpointing = c.activation_offloading = true;
                     if (n.Scalar() == "offload_disk")
                       c.warnings.push_back("gradient_checkpointing: offload_disk keeps the checkpointed block inputs in "
                                            "pinned host RAM, not on a disk (activation_offloading)");
                     return;
                   }
                   issues.push_back({"gradient_checkpointing", "expected true, false, offload or offload_disk, got '" + yaml_text(n) + "'"});
                 },
                 writer(&TrainConfig::gradient_checkpointing)});
    k.push_back({"gradient_checkpointing_kwargs.use_reentrant", "bool", "(unset)",
                 "Must be false: eo-ddp implements non-reentrant checkpointing only (and expert_offload requires it explicitly).",
                 [](const YAML::Node& n, TrainConfig& c, Issues& issues) {
                   if (auto v = as_bool(n)) c.use_reentrant = *v;
                   else issues.push_back({"gradient_checkpointing_kwargs.use_reentrant", "expected true or false, got '" + yaml_text(n) + "'"});
                 },
                 writer(&TrainConfig::use_reentrant)});
    k.push_back(boolean("expert_offload", &TrainConfig::expert_offload,
                        "Keep the frozen NF4 experts in pinned host RAM and stream one MoE block at a time to the device."));
    k.push_back(boolean("expert_offload_pin_memory", &TrainConfig::expert_offload_pin_memory,
                        "Pinned, NUMA-local homes (false: pageable host memory, much slower copies)."));
    k.push_back(boolean("expert_lora_offload", &TrainConfig::expert_lora_offload,
                        "With expert_offload and LoRA on the experts (lora_target_parameters, or expert linears in "
                        "lora_target_modules): their fp32 masters, gradients and AdamW moments live in host RAM beside "
                        "the homes and cross to the device with their block (two fixed device slots, so CUDA graphs "
                        "replay as with the state on the device); each block's AdamW update runs on the device when the "
                        "block is next staged. false keeps that state on the device."));
    k.push_back(choice("expert_offload_homes", &TrainConfig::expert_offload_homes, {"per_rank", "per_numa_node", "disk"},
                       "Where the offloaded experts live between uses: per_rank = every rank its own copy in host RAM "
                       "(host RAM = ranks per node x expert bytes); per_numa_node = one copy per NUMA node, filled by one "
                       "rank and mapped read-only by the node's other ranks (host RAM = NUMA nodes x expert bytes); disk "
                       "= one file per host in expert_offload_disk_path, written once from the checkpoint and reused by "
                       "later runs, read with O_DIRECT ahead of use into a ring of a few blocks per rank (host RAM = ranks "
                       "per node x ring; every step reads the streamed blocks from the drive)."));
    k.push_back(text("expert_offload_disk_path", &TrainConfig::expert_offload_disk_path,
                     "With expert_offload_homes: disk, the directory (on a local drive, ideally NVMe; created if missing) "
                     "of the homes file eo-ddp-expert-homes.bin. A file written for another model or quantisation "
                     "setting, or with a damaged header, is rebuilt; a block whose bytes changed on the drive stops "
                     "the run at its next read (exit 1), saying to delete the file, which the next run rebuilds; one "
                     "directory per model avoids rebuilding."));
    k.push_back(boolean("expert_offload_prefetch", &TrainConfig::expert_offload_prefetch,
                        "Stage the next blocks on a copy stream while the current one computes (1 + expert_offload_prefetch_depth slots)."));
    k.push_back(integer("expert_offload_prefetch_depth", &TrainConfig::expert_offload_prefetch_depth, 1, 8,
                        "Blocks staged ahead of the one computing (device slots = 1 + depth). Each extra block also "
                        "stays across the forward/backward turns (2 copies fewer per step) and lets copies run further "
                        "ahead, at the cost of one block of device memory."));
    k.push_back(real("expert_offload_copy_pace_gbps", &TrainConfig::expert_offload_copy_pace_gbps, 0, false, 1e4,
                     "For measurements: each expert copy into a device slot takes at least its bytes at this rate "
                     "(GB/s) on the device's clock, so a fast machine runs a slower card's host link (PCIe 4.0 x16: "
                     "about 24; eo-bench --card sets it). 0 (default): the link's own pace."));
    k.push_back(choice("expert_gemm", &TrainConfig::expert_gemm, {"auto", "torch", "portable"},
                       "The kernel of the experts' grouped GEMMs on a GPU. torch: PyTorch's at::_grouped_mm, "
                       "device-scheduled only on compute capability 9.x / 10.x (H100, H200, B200); on other cards it "
                       "reads the routing counts on the host and runs one GEMM per expert, and CUDA graphs cannot "
                       "capture it. portable: eo-ddp's CUTLASS grouped GEMM (sm_80 and newer: A100, RTX 30xx / 40xx "
                       "/ 50xx, A-series), sizes read on the device. auto = torch where it is device-scheduled, "
                       "portable elsewhere."));
    k.push_back(choice("cuda_graphs", &TrainConfig::cuda_graphs, {"auto", "true", "false"},
                       "On CUDA with gradient_checkpointing, replay each block's forward, its recompute + backward and "
                       "the loss as CUDA graphs (captured on their second use), so the step no longer waits on one host "
                       "thread launching kernels. Graphs keep a second working set of device memory (their own pool): "
                       "auto = on when the memory plan has room for it, offloaded or not (an offloaded step waits on "
                       "late launches too: each copy waits for its slot's last reader); false keeps the memory. Off "
                       "with lora_dropout > 0 (per-use dropout seeds are host state)."));
    k.push_back({"activation_offloading", "bool", "false",
                 "Keep the checkpointed block inputs (every block x micro-batch of a step) in pinned host RAM "
                 "until backward, copied on a copy stream ahead of use (needs gradient_checkpointing). axolotl's "
                 "legacy, hidden_states and disk are taken as true (disk: host RAM).",
                 [](const YAML::Node& n, TrainConfig& c, Issues& issues) {
                   if (auto v = as_bool(n)) { c.activation_offloading = *v; return; }
                   if (n.IsScalar() && (n.Scalar() == "legacy" || n.Scalar() == "hidden_states" || n.Scalar() == "disk")) {
                     c.activation_offloading = true;
                     if (n.Scalar() == "disk")
                       c.warnings.push_back("activation_offloading: disk keeps the checkpointed block inputs in pinned host RAM, not on a disk");
                     return;
                   }
                   issues.push_back({"activation_offloading", "expected true, false, legacy, hidden_states or disk, got '" + yaml_text(n) + "'"});
                 },
                 writer(&TrainConfig::activation_offloading)});
    k.push_back(choice("step_order", &TrainConfig::step_order, {"layer_major", "micro_batch_major"},
                       "Order of one optimizer step's block uses with gradient checkpointing: layer_major runs every "
                       "micro-batch through a block before the next (each block's experts are staged once in forward "
                       "and once in backward per step, whatever gradient_accumulation_steps is); micro_batch_major is "
                       "the classic order (forward and backward per micro-batch). Both give the same result."));
    k.push_back({"device_memory_limit", "bytes or 0", "0",
                 "Cap on the device memory eo-ddp may allocate (e.g. 8GiB makes a large GPU behave like a small card); "
                 "0 = the whole device. The start-up memory plan is checked against it.",
                 [](const YAML::Node& n, TrainConfig& c, Issues& issues) {
                   const std::string v = n.IsScalar() ? n.Scalar() : yaml_text(n);
                   if (auto b = parse_bytes(v)) { c.device_memory_limit = static_cast<std::int64_t>(*b); return; }
                   issues.push_back({"device_memory_limit", "expected a size such as 8GiB or 24GB, or 0; got '" + v + "'"});
                 },
                 [](const TrainConfig& c) { return YAML::Node(std::to_string(c.device_memory_limit)); }});
    k.push_back({"expert_offload_vram_budget", "bytes, auto or 0", "0",
                 "Device memory for blocks kept permanently resident (e.g. 8GiB); auto = what is free after the model and activations; 0 = stream all.",
                 [](const YAML::Node& n, TrainConfig& c, Issues& issues) {
                   const std::string v = n.IsScalar() ? n.Scalar() : yaml_text(n);
                   if (v == "auto" || parse_bytes(v)) { c.expert_offload_vram_budget = v; return; }
                   issues.push_back({"expert_offload_vram_budget", "expected a size such as 8GiB or 500MB, 0, or auto; got '" + v + "'"});
                 },
                 writer(&TrainConfig::expert_offload_vram_budget)});
    k.push_back({"expert_dequant_chunk", "bytes, auto or whole", "auto",
                 "Largest slice of a MoE block's experts dequantised at once for the grouped GEMMs (GPU); slices save memory and cost time (docs/benchmarks.md); auto = whole, or 64MiB when only that makes the plan fit the device.",
                 [](const YAML::Node& n, TrainConfig& c, Issues& issues) {
                   const std::string v = n.IsScalar() ? n.Scalar() : yaml_text(n);
                   if (v == "auto" || v == "whole") { c.expert_dequant_chunk = v; return; }
                   if (auto b = parse_bytes(v); b && *b >= (1 << 20)) { c.expert_dequant_chunk = v; return; }
                   issues.push_back({"expert_dequant_chunk", "expected auto, whole, or a size of at least 1MiB such as 64MiB; got '" + v + "'"});
                 },
                 writer(&TrainConfig::expert_dequant_chunk)});
    k.push_back({"expert_group_size", "experts, auto or whole", "auto",
                 "With expert_offload: stream each MoE block's experts in groups of this many (double-buffered: the next group copies while one computes), so the device slots and the dequantised bank hold a group, not a block; each block's expert GEMMs then read the routing counts on the host (no CUDA graphs). auto = whole blocks, or the largest group (the block's experts halved until it does) that makes the memory plan fit the device; whole = never.",
                 [](const YAML::Node& n, TrainConfig& c, Issues& issues) {
                   const std::string v = n.IsScalar() ? n.Scalar() : yaml_text(n);
                   if (v == "auto" || v == "whole") { c.expert_group_size = v; return; }
                   try {
                     std::size_t used = 0;
                     const long long g = std::stoll(v, &used);
                     if (used == v.size() && g >= 1 && g <= (1 << 20)) { c.expert_group_size = v; return; }
                   } catch (...) {
                   }
                   issues.push_back({"expert_group_size", "expected auto, whole, or a number of experts of at least 1 such as 16; got '" + v + "'"});
                 },
                 writer(&TrainConfig::expert_group_size)});
    k.push_back(choice("expert_bank_reuse", &TrainConfig::expert_bank_reuse, {"auto", "all", "down", "none"},
                       "Dequantised expert banks (GPU, whole banks) a checkpointed block's recompute keeps for its "
                       "backward instead of dequantising them again: all = gate, up and down (two more banks at the "
                       "peak), down = the down projection's only (no more peak memory), none. auto = all, or down when "
                       "only that makes the memory plan fit."));
    // --- distributed
    k.push_back(integer("ddp_bucket_cap_mb", &TrainConfig::ddp_bucket_cap_mb, 1, 1 << 16, "Gradient bucket size for the all-reduce (MB)."));
    k.push_back(integer("ddp_timeout", &TrainConfig::ddp_timeout, 10, 1 << 24,
                        "Seconds a collective may take before every rank is aborted with a message naming the stuck rank."));
    // --- outputs
    k.push_back(text("output_dir", &TrainConfig::output_dir, "Where adapters, checkpoints and metrics.jsonl go."));
    k.push_back(steps_or_fraction("save_steps", &TrainConfig::save_steps, true,
                                  "Save an adapter + training state every N steps (>= 1), or every fraction of the run "
                                  "(< 1); 0 = only at the end."));
    k.push_back(integer("save_total_limit", &TrainConfig::save_total_limit, 1, 1 << 20,
                        "Training-state checkpoints of this run to keep (another run's are never deleted)."));
    k.push_back(boolean("overwrite_output_dir", &TrainConfig::overwrite_output_dir,
                        "Start a fresh run in an output_dir that holds another run's checkpoints (they are moved to "
                        "output_dir/other-runs/, never written into, pruned or resumed); without it such a run is refused."));
    k.push_back(integer("logging_steps", &TrainConfig::logging_steps, 1, 1 << 30, "Log and write metrics every N steps."));
    k.push_back(boolean("use_tensorboard", &TrainConfig::use_tensorboard,
                        "Write TensorBoard event files under output_dir/runs/: every metrics.jsonl field as a scalar."));
    k.push_back(text("wandb_project", &TrainConfig::wandb_project,
                     "Log every metrics.jsonl field to this Weights & Biases project (a side process running the wandb "
                     "SDK follows metrics.jsonl; a failing or hanging tracker never stops or slows training)."));
    k.push_back(text("wandb_entity", &TrainConfig::wandb_entity, "The W&B team or user of wandb_project."));
    k.push_back(text("wandb_name", &TrainConfig::wandb_name, "The W&B run's display name."));
    k.push_back(choice("wandb_mode", &TrainConfig::wandb_mode, {"online", "offline", "disabled"},
                       "W&B's mode: offline writes the run under output_dir/wandb/ for `wandb sync`."));
    k.push_back(text("wandb_run_id", &TrainConfig::wandb_run_id, "The W&B run id (resumes that run when it exists)."));
    k.push_back(integer("saves_per_epoch", &TrainConfig::saves_per_epoch, 1, 1 << 20,
                        "Save a checkpoint this many times per epoch, evenly (exclusive with save_steps)."));
    // --- evaluation
    k.push_back({"val_set_size", "float", "(none)",
                 "Hold out this fraction (< 1) or this many documents (>= 1) of the training data for evaluation: "
                 "a seeded shuffle of the documents, the last ones held out (exclusive with test_datasets).",
                 [](const YAML::Node& n, TrainConfig& c, Issues& issues) {
                   auto v = as_double(n);
                   if (!v || *v < 0 || (*v >= 1 && *v != std::floor(*v)))
                     return issues.push_back({"val_set_size", "expected a fraction in [0, 1) or a whole number of documents, got '" +
                                                                  yaml_text(n) + "'"});
                   if (*v > 0) c.val_set_size = *v;
                 },
                 writer(&TrainConfig::val_set_size)});
    k.push_back(steps_or_fraction("eval_steps", &TrainConfig::eval_steps, false,
                                  "Evaluate every N optimizer steps (>= 1), or every fraction of the run (< 1), and at the end."));
    k.push_back(integer("evals_per_epoch", &TrainConfig::evals_per_epoch, 1, 1 << 20,
                        "Evaluate this many times per epoch, evenly (exclusive with eval_steps). With eval data and "
                        "neither key, eo-ddp evaluates once at the end."));
    k.push_back(boolean("eval_sample_packing", &TrainConfig::eval_sample_packing, "Pack the evaluation sequences (default: sample_packing)."));
    k.push_back(integer("eval_batch_size", &TrainConfig::eval_batch_size, 1, 1 << 16,
                        "Sequences per rank per evaluation forward (default: micro_batch_size)."));
    k.push_back(text("lora_model_dir", &TrainConfig::lora_model_dir,
                     "A peft adapter folder (adapter_config.json + adapter_model.safetensors) to continue training "
                     "from, as axolotl: its weights replace the fresh LoRA init (a fresh optimizer state). Its r, "
                     "lora_alpha, rsLoRA and targets must equal the config's; resume_from_checkpoint, when it resumes, "
                     "takes precedence."));
    k.push_back(text("resume_from_checkpoint", &TrainConfig::resume_from_checkpoint,
                     "A checkpoint folder to continue from, or auto for the newest complete one of this run's lineage in output_dir."));
    return k;
  }();
  return keys;
}

}  // namespace eo::config_detail
