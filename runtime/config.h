// The training configuration: an axolotl-style YAML file, validated all at once.
//
// Keys follow axolotl's names wherever axolotl has the concept, so a user's axolotl QLoRA
// config needs few edits. Every key is declared once in the schema (config_keys.cpp): its type,
// default, range and documentation; docs/configuration.md's reference table is printed from it
// (`eo-ddp --help-config --markdown`; grouped for a terminal: runtime/config_help.h). Validation
// collects every problem before raising, and runs before any weight is read.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "models/quant_format.h"

namespace YAML {
class Node;
}
namespace eo::model {
struct ModelConfig;
}

namespace eo {

// One entry of `datasets:` / `test_datasets:`. Pre-tokenized types are read as they are;
// the axolotl formats are tokenised once by tools/prepare_data.py into dataset_prepared_path
// (runtime/data/prepare.h) and then read as tokenized JSONL from `prepared`.
struct DatasetSpec {
  std::string path;
  std::string type;  // tokenized | tokens | chat_template | alpaca | completion | input_output
  std::string dtype;  // for "tokens": uint16 | uint32
  std::optional<std::int64_t> eos_token_id;  // for "tokens": document boundary token
  // chat_template (empty = axolotl's default)
  std::string field_messages, message_field_role, message_field_content, message_field_training;
  std::optional<std::vector<std::string>> roles_to_train;  // default [assistant]
  std::string train_on_eos;                                // all | turn | last | none (default turn)
  std::string chat_template, chat_template_jinja;          // override the top-level keys
  std::vector<std::pair<std::string, std::vector<std::string>>> roles;  // role -> source names
  bool drop_system_message = false;
  std::string field;  // completion: the text field (default text)
  std::string split;  // Hugging Face split of the file: train
  std::string train_on_eot;  // all | turn | last | none (default: train_on_eos)
  // axolotl maps the data's field_thinking (default reasoning_content) into each message as
  // template_thinking_key (default reasoning_content), unless the message fields are mapped.
  std::string field_thinking, template_thinking_key;
  bool fields_mapped = false;  // message_property_mappings / message_field_role / _content given

  // A dataset named as on the Hugging Face Hub (runtime/hub.h): its name and revision; the data
  // files read (its snapshot's, or a local dataset folder's; empty = path itself); data_files
  // picks them within the repository.
  std::string hub_name, revision;
  std::vector<std::string> data_files, files;
  // axolotl's shards / shards_idx: the rows of shard shards_idx of `shards`, after a seeded shuffle.
  std::int64_t shards = 0, shards_idx = 0;

  std::string prepared;  // set before training: the tokenized JSONL made from `path`
  bool formatted() const { return type != "tokenized" && type != "tokens"; }
};

struct TrainConfig {
  // Model and adapter.
  std::string base_model;      // the model folder (a Hub name's cache snapshot once resolved)
  std::string base_model_hub;  // the Hub name base_model was given as (runtime/hub.h), else empty
  std::string base_model_revision;  // revision_of_model: a branch, tag or commit of base_model_hub
  bool synthetic_weights = false;  // random base weights from config.json (benchmarks)
  bool load_in_4bit = false;
  std::string adapter;  // "qlora" | "lora"
  int lora_r = 8;
  double lora_alpha = 16;
  double lora_dropout = 0.0;
  std::vector<std::string> lora_target_modules = {"q_proj", "k_proj", "v_proj", "o_proj"};
  bool lora_target_regex = false;  // lora_target_modules holds one regular expression (resolved by the loader)
  bool lora_target_linear = false;
  // peft's target_parameters: the fused expert parameters (canonical: mlp.experts.gate_up_proj,
  // mlp.experts.down_proj); empty = experts adapted per expert through lora_target_modules.
  std::vector<std::string> lora_target_parameters;
  // peft's layers_to_transform (axolotl's peft_layers_to_transform): the decoder layers adapted,
  // sorted; empty = every layer.
  std::vector<int> peft_layers_to_transform;
  bool peft_use_rslora = false;
  // axolotl's nvfp4_merge_aware (models/merge_aware.h): LoRA on an NVFP4 base trains through the
  // NVFP4 re-quantised effective weight, from optimizer step nvfp4_merge_aware_start_step on (a
  // whole number: that many completed steps; a fraction in (0, 1): of the run's steps; unset: 0).
  bool nvfp4_merge_aware = false;
  std::optional<double> nvfp4_merge_aware_start_step;
  int bnb_4bit_blocksize = 64;
  bool bnb_4bit_use_double_quant = false;
  std::string expert_quant = "auto";  // "auto" | "nf4" | "mxfp4": experts_in_mxfp4()
  bool output_router_logits = false;
  std::optional<double> router_aux_loss_coef;
  // axolotl's overrides_of_model_config: config.json's top-level keys replaced, each value as JSON
  // text (runtime/model_overrides.h).
  std::vector<std::pair<std::string, std::string>> model_config_overrides;

  // Data.
  std::vector<DatasetSpec> datasets;
  int sequence_len = 2048;
  bool sample_packing = false;
  int micro_batch_size = 1;
  int gradient_accumulation_steps = 1;
  double num_epochs = 1;
  std::optional<std::int64_t> max_steps;
  // Tokenisation of the axolotl formats (tools/prepare_data.py, through transformers).
  std::string dataset_prepared_path = "last_run_prepared";
  int dataset_prepare_timeout = 3600;  // seconds the other ranks wait for rank 0's preprocessing
  bool train_on_inputs = false;
  std::string chat_template = "tokenizer_default";
  std::string chat_template_jinja;
  std::string tokenizer_config;  // tokenizer folder; empty = base_model
  std::string tokenizer_type;    // a transformers class; empty = AutoTokenizer
  bool trust_remote_code = false;
  std::vector<std::pair<std::string, std::string>> special_tokens;
  std::vector<std::string> eot_tokens;  // turn-ending tokens for chat_template (default: eos)

  // Evaluation.
  std::optional<double> val_set_size;  // < 1: fraction of the training documents; >= 1: a count
  std::vector<DatasetSpec> test_datasets;
  std::optional<double> eval_steps;    // >= 1: every N steps; < 1: a fraction of the total steps
  std::optional<int> evals_per_epoch;
  std::optional<bool> eval_sample_packing;  // default: sample_packing
  std::optional<int> eval_batch_size;       // default: micro_batch_size

  // Optimisation.
  double learning_rate = 2e-4;
  std::string lr_scheduler = "cosine";
  int warmup_steps = 0;
  std::optional<double> warmup_ratio;
  double weight_decay = 0.0;
  double max_grad_norm = 1.0;
  int max_nonfinite_steps = 5;  // consecutive NaN/Inf steps (skipped) before the run stops
  std::string optimizer = "adamw_torch";
  double adam_beta1 = 0.9;
  double adam_beta2 = 0.999;
  double adam_epsilon = 1e-8;
  std::int64_t seed = 42;

  // Precision and memory.
  std::string bf16 = "auto";  // "true" | "false" | "auto" (resolve_compute)
  std::optional<bool> fp16;   // axolotl's key; unset lets bf16: auto pick fp16 on a GPU without bf16
  int loss_scale_growth_interval = 2000;  // fp16: clean steps before the loss scale doubles
  bool gradient_checkpointing = false;
  std::optional<bool> use_reentrant;  // gradient_checkpointing_kwargs.use_reentrant
  bool expert_offload = false;
  bool expert_offload_pin_memory = true;
  bool expert_lora_offload = true;  // with expert_offload: the experts' LoRA state in host RAM
  std::string expert_offload_homes = "per_rank";  // "per_rank" | "per_numa_node" | "disk"
  std::string expert_offload_disk_path;           // with disk: the directory of the homes file
  bool expert_offload_prefetch = true;
  double expert_offload_copy_pace_gbps = 0;  // > 0: expert copies paced to this rate (a slower card's link, simulated)
  int expert_offload_prefetch_depth = 1;  // blocks staged ahead (slots = 1 + depth); with prefetch only
  std::string expert_offload_vram_budget = "0";  // bytes, "auto" or 0
  std::string expert_dequant_chunk = "auto";  // auto | whole | bytes: RunSpec::bank_bytes
  std::string expert_group_size = "auto";     // auto | whole | experts per group: RunSpec::group_size
  std::string expert_bank_reuse = "auto";     // auto | all | down | none (models/linear4bit.h BankReuse)
  std::int64_t device_memory_limit = 0;  // bytes the caching allocator may use; 0 = all
  bool activation_offloading = false;  // checkpointed block inputs in pinned host RAM
  std::string expert_gemm = "auto";  // auto | torch | portable: the experts' grouped GEMM kernel (models/grouped_mm.h)
  std::string cuda_graphs = "auto";  // auto | true | false: step uses replayed as CUDA graphs (runtime/block_graphs.h)
  std::string step_order = "layer_major";  // "layer_major" | "micro_batch_major" (with checkpointing)

  // Distributed.
  int ddp_bucket_cap_mb = 25;
  int ddp_timeout = 600;  // seconds a collective may take before the run is aborted

  // Outputs.
  std::string output_dir = "./model-out";
  std::optional<double> save_steps;  // >= 1: every N steps; < 1: a fraction of the total steps; unset or 0: only at the end
  std::optional<int> saves_per_epoch;
  int save_total_limit = 3;
  int logging_steps = 1;
  std::string resume_from_checkpoint;  // path or "auto"; empty = start fresh
  std::string lora_model_dir;          // a peft adapter to start from (axolotl's); empty = fresh LoRA
  bool overwrite_output_dir = false;   // a fresh run may start beside another run's checkpoints

  // Trackers (runtime/trackers.h): TensorBoard events under output_dir/runs/, and W&B through a
  // side process that follows metrics.jsonl when wandb_project is set.
  bool use_tensorboard = false;
  std::string wandb_project, wandb_entity, wandb_name, wandb_run_id;
  std::string wandb_mode = "online";  // online | offline | disabled

  // Where the file came from, and what the loader wants the user to know (ignored keys, ...).
  std::string source;
  std::vector<std::string> warnings;
  // A relative input path found nowhere, as written -> the folder it was resolved against (for
  // messages; runtime/config_paths.h).
  std::map<std::string, std::string> path_bases;
};

struct ConfigIssue {
  std::string key;
  std::string message;
};


struct ConfigLoadOptions {
  // Check that files named by the config exist (base_model/config.json, datasets).
  bool check_files = true;
  // Resolve the targets and templates against base_model/config.json even when files are not
  // checked (eo-ddp plan: config.json is all it reads).
  bool check_architecture = false;
  // Where base_model's config.json is handed back, parsed once for the whole run (by the checks
  // above, or else here; one that cannot be read is then an error).
  model::ModelConfig* model_out = nullptr;
  // The config file's folder, against which its relative paths are resolved (runtime/config_paths.h);
  // empty: paths as written. load_config_file sets it.
  std::string config_dir;
};

// Reads YAML text (a file's contents) plus `--set key=value` overrides, validates and
// returns the config. Throws ConfigError (a UsageError) listing every problem.
TrainConfig load_config_file(const std::string& path, const std::vector<std::string>& overrides,
                             const ConfigLoadOptions& options = {});
TrainConfig load_config_text(const std::string& yaml_text, const std::string& source,
                             const std::vector<std::string>& overrides, const ConfigLoadOptions& options = {});

// The resolved config as YAML (every key, defaults filled in).
std::string config_to_yaml(const TrainConfig& cfg);

// Markdown table of every key: name, type, default, meaning. Printed by --help-config --markdown.
std::string config_reference_markdown();
// Every key of the schema, in its order, with its documentation (runtime/config_help.h prints them).
struct ConfigKeyDoc {
  std::string key, type, default_text, doc;
};
std::vector<ConfigKeyDoc> config_key_docs();
// Every key the schema accepts (dotted names).
std::vector<std::string> config_known_keys();
// axolotl's config keys and what eo-ddp does with each: class "implemented", "noted" (accepted,
// text logged) or "rejected" (text is the reason). One table: runtime/axolotl_keys.inc.
struct AxolotlKeyInfo {
  std::string key, cls, text;
};
std::vector<AxolotlKeyInfo> axolotl_keys();
// docs/axolotl-keys.md: that table. Printed by --help-axolotl-keys.
std::string axolotl_keys_markdown();

// The compute dtype of the frozen weights and activations (LoRA masters and AdamW state are fp32
// whatever it is). The one rule for bf16 / fp16, as axolotl's normalize_config:
//   fp16: true            -> fp16 (bf16 must be false or auto: both true is a config error)
//   bf16: true            -> bf16 (on a CUDA card without bf16 the start-up check refuses it)
//   bf16: false           -> fp32
//   bf16: auto            -> bf16 on a CUDA card with bf16 (compute capability >= 8.0); fp16 on one
//                            without, unless fp16: false is set (then fp32); fp32 on the CPU.
// `cuda_has_bf16` is ignored on the CPU. `why` says how it was decided, for the log.
enum class Compute { Fp32, Bf16, Fp16 };
struct ComputeChoice {
  Compute dtype = Compute::Fp32;
  std::string why;
};
ComputeChoice resolve_compute(const TrainConfig& cfg, bool on_cuda, bool cuda_has_bf16);
const char* compute_name(Compute c);  // "fp32", "bf16", "fp16"
// fp16's dynamic loss scaling, as torch.amp.GradScaler's defaults.
constexpr double kLossScaleInit = 65536.0;  // 2^16
constexpr double kLossScaleGrowth = 2.0;
constexpr double kLossScaleBackoff = 0.5;
// expert_dequant_chunk: auto's slice when only slices fit (RunSpec::bank_bytes says the rest).
constexpr std::int64_t kAutoBankSliceBytes = std::int64_t(64) << 20;
// Whether the routed experts are held in MXFP4 (else NF4, or unquantised without load_in_4bit):
// load_in_4bit with expert_quant mxfp4, or auto on a checkpoint whose config.json says its
// experts are MXFP4 (the loader's ExpertQuant::Auto; the plan and the home sizes use this).
bool experts_in_mxfp4(const TrainConfig& cfg, const model::ModelConfig& mc);
// The format the routed experts are held in, as the loader decides it: MXFP4 as above; NVFP4 on a
// modelopt NVFP4 checkpoint, with or without load_in_4bit (unless expert_quant: nf4); else NF4
// (nullopt without load_in_4bit: the experts are unquantised in the compute dtype).
std::optional<QuantFormat> expert_format(const TrainConfig& cfg, const model::ModelConfig& mc);

}  // namespace eo
