// axolotl's keys (runtime/config_axolotl.h).
#include "runtime/config_axolotl.h"

#include <map>
#include <sstream>

#include "runtime/yaml_values.h"

namespace eo {
namespace config_detail {
namespace {

// A parallel size: 1 means off.
bool is_size_key(const std::string& key) {
  return ends_with(key, "parallel_size") || ends_with(key, "_degree") || key == "dp_shard_size" || key == "dp_replicate_size";
}

}  // namespace

const std::vector<AxolotlKey>& axolotl_table() {
  static const std::vector<AxolotlKey> t = {
#include "runtime/axolotl_keys.inc"
  };
  return t;
}

const AxolotlKey* axolotl_key(const std::string& key) {
  static const std::map<std::string, const AxolotlKey*> index = [] {
    std::map<std::string, const AxolotlKey*> m;
    for (const auto& k : axolotl_table()) m[k.key] = &k;
    return m;
  }();
  const auto it = index.find(key);
  return it == index.end() ? nullptr : it->second;
}

bool is_off(const YAML::Node& n, bool size) {
  if (is_null(n) || as_bool(n) == false) return true;
  if ((n.IsSequence() || n.IsMap()) && n.size() == 0) return true;
  if (n.IsScalar() && n.Scalar().empty()) return true;
  if (const auto v = as_double(n)) return *v == 0 || (size && *v == 1);
  return false;
}

void apply_axolotl_key(const AxolotlKey& a, const std::string& where, const YAML::Node& node, std::vector<std::string>& warnings,
                       Issues& issues) {
  const bool size = is_size_key(a.key);
  if (size && !is_null(node) && (!as_int(node) || *as_int(node) < 1))
    return issues.push_back({where, "expected an integer >= 1"});
  if (is_off(node, size)) return;
  if (a.cls == AxolotlKey::Rejected)
    issues.push_back({where, std::string("not supported") + (size ? " (" + node.Scalar() + ")" : "") + ": " + a.text});
  else warnings.push_back("config key '" + where + "' is ignored by eo-ddp: " + a.text);
}

bool read_axolotl_special(const std::string& key, const YAML::Node& n, TrainConfig& c, Issues& issues) {
  auto one_of = [&](std::initializer_list<const char*> allowed, const std::string& what) {
    if (is_null(n)) return std::string();
    const std::string v = n.IsScalar() ? n.Scalar() : yaml_text(n);
    for (const char* a : allowed)
      if (v == a) return v;
    issues.push_back({key, "'" + v + "': " + what});
    return std::string();
  };
  if (key == "plugins") {
    const auto list = string_list("plugins", n, "plugin class names", issues);
    if (!list) return true;
    // axolotl's bundled plugins, by their module under axolotl.integrations.
    static const std::map<std::string, std::pair<bool, std::string>> kinds = {
        {"liger", {true, "eo-ddp's own fused kernels and chunked loss do what Liger's kernels do"}},
        {"cut_cross_entropy", {true, "eo-ddp computes the loss in chunks without materialising the full logits"}},
        {"kernels", {true, "eo-ddp's own NF4/MXFP4 grouped expert GEMMs replace the hub kernels"}},
        {"swanlab", {true, "metrics go to output_dir/metrics.jsonl and the log"}},
        {"lm_eval", {true, "eo-ddp runs no benchmark; eo-ddp score computes an adapter's loss on a data file"}},
        {"expert_parallel", {false, "expert parallelism places different experts on different ranks, but every eo-ddp "
                                    "rank streams all experts itself"}},
        {"spectrum", {false, "it trains selected base weights; eo-ddp trains LoRA adapters only"}},
        {"kd", {false, "eo-ddp trains supervised LoRA/QLoRA only (no distillation)"}},
        {"diffusion", {false, "eo-ddp trains causal language models (no diffusion objective)"}},
        {"grokfast", {false, "gradient filtering is not implemented"}},
        {"densemixer", {false, "a dense router gradient is not implemented"}},
        {"mora", {false, "eo-ddp trains plain LoRA"}},
        {"llm_compressor", {false, "quantisation-aware training and compression are not implemented"}},
        {"hatchery", {false, "remote training backends are not eo-ddp"}},
        {"nemo_gym", {false, "eo-ddp trains supervised LoRA/QLoRA only (no RL environments)"}},
    };
    for (const auto& p : *list) {
      const std::string prefix = "axolotl.integrations.";
      const std::string module = p.rfind(prefix, 0) == 0 ? p.substr(prefix.size(), p.find('.', prefix.size()) - prefix.size()) : "";
      const auto it = kinds.find(module);
      if (it == kinds.end())
        issues.push_back({"plugins", "unknown plugin '" + p + "'; eo-ddp runs no Python plugins (axolotl's bundled ones "
                                     "are noted or refused by name, e.g. axolotl.integrations.liger.LigerPlugin)"});
      else if (!it->second.first) issues.push_back({"plugins", "'" + p + "' not supported: " + it->second.second});
      else c.warnings.push_back("config plugin '" + p + "' is ignored by eo-ddp: " + it->second.second);
    }
    return true;
  }
  if (key == "excess_length_strategy") {
    one_of({"drop"}, "eo-ddp drops a row longer than sequence_len, as axolotl's default drop (a completion text is cut "
                     "into pieces); truncate and raise are not implemented");
    return true;
  }
  if (key == "eval_strategy" || key == "evaluation_strategy") {
    if (one_of({"no", "steps", "epoch"}, "expected no, steps or epoch") == "no")
      c.warnings.push_back("config key '" + key + "': no is ignored by eo-ddp: it evaluates whenever there is evaluation "
                           "data (remove val_set_size / test_datasets to skip it)");
    return true;
  }
  if (key == "save_strategy") {
    if (one_of({"no", "steps", "epoch", "best"}, "expected no, steps, epoch or best") != "")
      c.warnings.push_back("config key 'save_strategy' is ignored by eo-ddp: checkpoints follow save_steps / "
                           "saves_per_epoch, and the adapter is always written at the end");
    return true;
  }
  return false;
}

}  // namespace config_detail

using config_detail::AxolotlKey;
using config_detail::axolotl_table;

std::vector<AxolotlKeyInfo> axolotl_keys() {
  std::vector<AxolotlKeyInfo> out;
  for (const auto& a : axolotl_table())
    out.push_back({a.key, a.cls == AxolotlKey::Implemented ? "implemented" : a.cls == AxolotlKey::Noted ? "noted" : "rejected",
                   a.text});
  return out;
}

std::string axolotl_keys_markdown() {
  std::ostringstream os;
  os << "# axolotl's config keys in eo-ddp\n\n"
        "Every key of axolotl 0.19.0's config schema (with its bundled plugins' keys, and a `datasets` entry's keys "
        "as `datasets[].KEY`), and the older axolotl / transformers' Trainer keys configs still carry, as eo-ddp takes it: **implemented** (read; see docs/configuration.md), "
        "**noted** (accepted; when set, the log says what eo-ddp does instead) or **rejected** (an error naming the "
        "reason unless the value is off: null, false, empty, 0, or 1 for a parallel size). A key in neither this "
        "table nor the config reference is an error with a \"did you mean\". Printed by `eo-ddp --help-axolotl-keys` "
        "from `runtime/axolotl_keys.inc`.\n\n| key | class | what eo-ddp does |\n|---|---|---|\n";
  for (const auto& a : axolotl_keys())
    os << "| `" << a.key << "` | " << a.cls << " | " << (a.text.empty() ? "read as axolotl does" : a.text) << " |\n";
  return os.str();
}

}  // namespace eo
