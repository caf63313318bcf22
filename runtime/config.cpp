// Loading a config: the YAML document, --set overrides, duplicate keys, each key read through the
// schema (runtime/config_schema.h), then the rules between keys (runtime/config_checks.h).
#include "runtime/config.h"

#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/yaml.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "common/error.h"
#include "common/files.h"
#include "common/text.h"
#include "models/hf_config.h"
#include "runtime/config_axolotl.h"
#include "runtime/config_checks.h"
#include "runtime/config_paths.h"
#include "runtime/config_schema.h"
#include "runtime/dataset_keys.h"
#include "runtime/hub.h"
#include "runtime/key_aliases.h"
#include "runtime/model_overrides.h"
#include "runtime/yaml_values.h"

namespace eo {
namespace {

namespace fs = std::filesystem;
using namespace config_detail;  // the reader's parts: runtime/config_schema.h and the headers beside it

// Flatten the document into dotted keys. Maps nest (gradient_checkpointing_kwargs.use_reentrant);
// a key whose schema type is a list or a map that the schema reads whole (datasets) stops the
// descent.
// Aliases make this walk exponential ("billion laughs": 24 lines of `b: &b {p: *a, q: *a}` give
// 2^24 keys), so the number of keys is capped far above any real config (axolotl's have < 100).
constexpr std::size_t kMaxConfigKeys = 1000;
// An alias may also point into itself (`b: &b {p: *b}`): a cycle, so the depth is capped too.
constexpr std::size_t kMaxConfigDepth = 16;

void flatten(const YAML::Node& node, const std::string& prefix, std::vector<std::pair<std::string, YAML::Node>>& out,
             const std::set<std::string>& leaf_keys, const std::string& source, std::size_t depth = 0) {
  if (depth > kMaxConfigDepth)
    throw UsageError("config " + source + ": '" + prefix.substr(0, 200) + "' nests maps more than " +
                     std::to_string(kMaxConfigDepth) + " levels deep (a YAML alias inside itself?); it is not a training config");
  for (const auto& kv : node) {
    if (out.size() >= kMaxConfigKeys)
      throw UsageError("config " + source + " has more than " + std::to_string(kMaxConfigKeys) +
                       " keys (counting nested maps; YAML aliases repeat what they point to); it is not a training config");
    const std::string k = key_text(kv.first);
    const std::string full = prefix.empty() ? k : prefix + "." + k;
    const AxolotlKey* a = axolotl_key(full);
    if (kv.second.IsMap() && !leaf_keys.count(full) && !(a && a->cls != AxolotlKey::Implemented))
      flatten(kv.second, full, out, leaf_keys, source, depth + 1);
    else
      out.emplace_back(full, kv.second);
  }
}

void place_override(YAML::Node& root, const std::string& key, const std::vector<std::string>& parts,
                    const YAML::Node& value, Issues& issues);

// Apply `key=value`: value parsed as YAML (so 1e-4, true, [a, b] work), placed at the dotted path.
void apply_override(YAML::Node& root, const std::string& assignment, Issues& issues) {
  const auto eq = assignment.find('=');
  if (eq == std::string::npos || eq == 0) {
    issues.push_back({"--set " + assignment, "expected key=value, e.g. --set learning_rate=1e-4"});
    return;
  }
  const std::string key = assignment.substr(0, eq);
  // YAML reads "" as null, which would silently restore the default: an empty value is a mistake.
  if (eq + 1 == assignment.size()) {
    issues.push_back({key, "--set " + assignment + " has an empty value; give one (e.g. --set " + key +
                               "=VALUE), write null explicitly to restore the default, or drop the --set"});
    return;
  }
  YAML::Node value;
  try {
    value = YAML::Load(assignment.substr(eq + 1));
  } catch (const YAML::Exception& e) {
    issues.push_back({key, "--set value is not valid YAML: " + std::string(e.what())});
    return;
  }
  if (!value.IsDefined()) value = YAML::Node(YAML::NodeType::Null);
  std::vector<std::string> parts;
  std::stringstream ss(key);
  for (std::string p; std::getline(ss, p, '.');) parts.push_back(p);
  // A scalar on the way (datasets.0.path=x with datasets: [x]) makes yaml-cpp throw BadSubscript.
  try {
    place_override(root, key, parts, value, issues);
  } catch (const YAML::Exception& e) {
    issues.push_back({key, "--set cannot place a value there: a part of '" + key + "' is a plain value in the config, "
                           "not a map or list (" + e.msg + ")"});
  }
}

void place_override(YAML::Node& root, const std::string& key, const std::vector<std::string>& parts,
                    const YAML::Node& value, Issues& issues) {
  // Walk with explicit node copies (yaml-cpp nodes are handles into the document).
  std::vector<YAML::Node> path{root};
  for (std::size_t i = 0; i + 1 < parts.size(); ++i) {
    YAML::Node cur = path.back();
    YAML::Node next;
    if (cur.IsSequence()) {
      std::size_t idx = 0;
      try {
        idx = std::stoul(parts[i]);
      } catch (...) {
        issues.push_back({key, "'" + parts[i] + "' is not an index into the list"});
        return;
      }
      if (idx >= cur.size()) {
        issues.push_back({key, "index " + parts[i] + " is past the end of the list"});
        return;
      }
      next = cur[idx];
    } else {
      if (!cur[parts[i]].IsDefined() || !cur[parts[i]].IsMap()) {
        if (cur[parts[i]].IsDefined() && cur[parts[i]].IsSequence()) {
          next = cur[parts[i]];
          path.push_back(next);
          continue;
        }
        cur[parts[i]] = YAML::Node(YAML::NodeType::Map);
      }
      next = cur[parts[i]];
    }
    path.push_back(next);
  }
  YAML::Node parent = path.back();
  if (parent.IsSequence()) {
    try {
      parent[std::stoul(parts.back())] = value;
    } catch (...) {
      issues.push_back({key, "'" + parts.back() + "' is not an index into the list"});
    }
  } else {
    parent[parts.back()] = value;
  }
}

// axolotl's older names of its keys, read as the current key.
const std::map<std::string, std::string>& older_key_names() {
  static const std::map<std::string, std::string> m = {{"model_revision", "revision_of_model"},
                                                       {"model_config", "overrides_of_model_config"}};
  return m;
}

// A message that echoes a huge value is cut in its middle (its start names the value, its end the fix).
std::string shorten(const std::string& m) {
  if (m.size() <= 1200) return m;
  return m.substr(0, 500) + " [... " + std::to_string(m.size() - 900) + " bytes cut ...] " + m.substr(m.size() - 400);
}

std::string format_issues(const std::string& source, const Issues& issues) {
  std::ostringstream os;
  os << "config " << source << " has " << issues.size() << (issues.size() == 1 ? " problem:" : " problems:");
  for (const auto& i : issues) os << "\n  - " << shorten(i.key) << ": " << shorten(i.message);
  return os.str();
}

// yaml-cpp keeps one of two equal keys of a mapping silently: each repeat is a config error.
// Aliases can make the document a cycle or exponentially wide (see kMaxConfigDepth / kMaxConfigKeys),
// so the walk stops at the same depth and after a bounded number of nodes; flatten() then names
// the problem.
struct DuplicateWalk {
  Issues& issues;
  std::size_t nodes_left = 10 * kMaxConfigKeys;

  void visit(const YAML::Node& node, const std::string& where, std::size_t depth) {
    if (depth > kMaxConfigDepth || nodes_left == 0) return;
    --nodes_left;
    if (node.IsMap()) {
      std::set<std::string> seen;
      for (const auto& kv : node) {
        const std::string k = kv.first.IsScalar() ? kv.first.Scalar() : "?";
        const std::string path = where.empty() ? k : where + "." + k;
        if (kv.first.IsScalar() && !seen.insert(k).second)
          issues.push_back({path, "appears more than once; keep one (YAML would silently use one of them)"});
        visit(kv.second, path, depth + 1);
      }
    } else if (node.IsSequence()) {
      for (std::size_t i = 0; i < node.size(); ++i) visit(node[i], where + "." + std::to_string(i), depth + 1);
    }
  }
};

void find_duplicate_keys(const YAML::Node& root, Issues& issues) { DuplicateWalk{issues}.visit(root, "", 0); }

// Counts the nodes of one document that are not null (a document separator alone gives none).
struct ContentCounter : YAML::EventHandler {
  std::size_t nodes = 0;
  void OnDocumentStart(const YAML::Mark&) override {}
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark&, YAML::anchor_t) override {}
  void OnAlias(const YAML::Mark&, YAML::anchor_t) override { ++nodes; }
  void OnScalar(const YAML::Mark&, const std::string&, YAML::anchor_t, const std::string&) override { ++nodes; }
  void OnSequenceStart(const YAML::Mark&, const std::string&, YAML::anchor_t, YAML::EmitterStyle::value) override {
    ++nodes;
  }
  void OnSequenceEnd() override {}
  void OnMapStart(const YAML::Mark&, const std::string&, YAML::anchor_t, YAML::EmitterStyle::value) override {
    ++nodes;
  }
  void OnMapEnd() override {}
};

// The config's one YAML document. YAML::LoadAll is not used: yaml-cpp before 0.8.1 loops forever
// in it on some malformed input (`,` alone; jbeder/yaml-cpp PR 1319), so only the first two
// documents are ever parsed, and a second one with content is an error.
YAML::Node load_one_document(const std::string& text, const std::string& source) {
  const YAML::Node root = YAML::Load(text);
  std::istringstream in(text);
  YAML::Parser parser(in);
  ContentCounter first, second;
  if (parser.HandleNextDocument(first) && parser.HandleNextDocument(second) && second.nodes > 0)
    throw UsageError("config " + source + " holds more than one YAML document (separated by ---); "
                     "eo-ddp reads one config: keep one document");
  return root;
}

}  // namespace

TrainConfig load_config_text(const std::string& yaml_text_in, const std::string& source,
                             const std::vector<std::string>& overrides, const ConfigLoadOptions& options) {
  Issues issues;
  YAML::Node root;
  try {
    root = load_one_document(yaml_text_in, source);
  } catch (const YAML::Exception& e) {
    throw UsageError("config " + source + " is not valid YAML: " + e.what());
  }
  find_duplicate_keys(root, issues);
  if (!root.IsDefined() || root.IsNull()) root = YAML::Node(YAML::NodeType::Map);
  if (!root.IsMap()) throw UsageError("config " + source + " must be a YAML mapping of key: value");
  for (const auto& o : overrides) apply_override(root, o, issues);

  std::set<std::string> leaf_keys;
  std::vector<std::string> known;
  for (const auto& s : schema()) {
    leaf_keys.insert(s.key);
    known.push_back(s.key);
  }
  for (const auto& [older, key] : older_key_names())
    if (leaf_keys.count(key)) leaf_keys.insert(older);
  std::vector<std::pair<std::string, YAML::Node>> entries;
  flatten(root, "", entries, leaf_keys, source);

  TrainConfig cfg;
  cfg.source = source;
  std::set<std::string> present;
  std::map<std::string, YAML::Node> noted;  // the Noted / Rejected keys set, as written
  std::vector<std::string> candidates;  // for "did you mean": the schema's keys and axolotl's
  int suggested = 0;
  for (const auto& [key_in, node] : entries) {
    std::string key = key_in;
    if (const auto older = older_key_names().find(key); older != older_key_names().end()) key = older->second;
    if (read_axolotl_special(key, node, cfg, issues)) continue;
    const AxolotlKey* axo = axolotl_key(key);
    if (axo && axo->cls != AxolotlKey::Implemented) {
      apply_axolotl_key(*axo, key, node, cfg.warnings, issues);
      noted[key] = node;  // a few rules read them (check_merge_aware)
      continue;
    }
    const KeySpec* spec = nullptr;
    for (const auto& s : schema())
      if (s.key == key) spec = &s;
    if (!spec && axo && is_off(node, false)) continue;  // model_config: or gradient_checkpointing_kwargs: left empty
    if (!spec) {
      std::string msg = "unknown key";
      // A config with hundreds of unknown keys (YAML aliases repeat maps) is no typo: past the
      // first few, the suggestion search, the costly part, is skipped.
      constexpr int kSuggestedKeys = 32;
      if (candidates.empty()) {
        candidates = known;
        for (const auto& a : axolotl_table())
          if (std::string(a.key).rfind("datasets[].", 0) != 0) candidates.push_back(a.key);
      }
      std::optional<std::string> m;
      const std::optional<KeyAlias> alias = key_alias(key);
      if (!alias && suggested++ < kSuggestedKeys) m = closest_match(key, candidates);
      if (alias) msg += "; " + spelled_here(*alias);
      else if (m) msg += "; did you mean '" + *m + "'?";
      else msg += "; `eo-ddp --help-config` lists every key";
      issues.push_back({key, msg});
      continue;
    }
    if (is_null(node)) continue;  // "key:" with no value keeps the default, as in axolotl
    present.insert(key);
    spec->read(node, cfg, issues);
  }
  resolve_config_paths(cfg, options.config_dir, present, overrides);
  check_rules(cfg, present, issues);
  check_merge_aware(cfg, present, noted, issues);
  // As axolotl: evaluation settings without evaluation data (val_set_size 0) mean no evaluation.
  if (!cfg.val_set_size && cfg.test_datasets.empty())
    for (const char* k : {"eval_steps", "evals_per_epoch", "eval_sample_packing", "eval_batch_size"})
      if (present.count(k))
        cfg.warnings.push_back(std::string("config key '") + k + "' has no effect: there is no evaluation data "
                               "(val_set_size is 0 and there are no test_datasets), so no evaluation runs, as in axolotl");
  // Names as on the Hub become their cache folders before anything reads them (downloaded only
  // when the config has no other problem).
  if (options.check_files || options.check_architecture) {
    std::vector<std::pair<std::string, std::string>> hub_problems;
    hub::resolve_config(cfg, options.check_files ? hub::Need::Everything : hub::Need::Config, issues.empty(), hub_problems);
    for (auto& [k, m] : hub_problems) issues.push_back({k, m});
  }
  if (options.check_files) check_files(cfg, present, issues);
  // Needs base_model's config.json only: training and `eo-ddp plan` (check_architecture) check it.
  model::ModelConfig parsed;  // config.json, when the checks read it
  if (options.check_files || options.check_architecture) check_targets(cfg, present, issues, &parsed);
  if (!issues.empty()) throw UsageError(format_issues(source, issues));
  if (options.model_out)
    *options.model_out = !parsed.model_type.empty() ? std::move(parsed) : load_model_config(cfg);
  // A depth other than the default with staging that never prefetches is most likely a mistake.
  if (cfg.expert_offload_prefetch_depth != 1 && !(cfg.expert_offload && cfg.expert_offload_prefetch))
    cfg.warnings.push_back("expert_offload_prefetch_depth is ignored: it needs expert_offload: true and "
                           "expert_offload_prefetch: true (synchronous staging uses one slot)");
  if (!cfg.expert_offload_disk_path.empty() && cfg.expert_offload_homes != "disk")
    cfg.warnings.push_back("expert_offload_disk_path is ignored: expert_offload_homes is " + cfg.expert_offload_homes +
                           ", not disk");
  if (cfg.expert_offload && !cfg.expert_offload_pin_memory)
    cfg.warnings.push_back("expert_offload_pin_memory: false gives pageable homes; host-to-device copies are far slower "
                           "(about 18x on the H200 machine)");
  return cfg;
}

TrainConfig load_config_file(const std::string& path, const std::vector<std::string>& overrides,
                             const ConfigLoadOptions& options) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) throw UsageError("--config " + path + " is a folder; give the YAML config file in it");
  std::string text;
  if (!read_input_file(path, text, "--config", kMaxTextFileBytes)) throw UsageError("cannot read config file '" + path + "'");
  ConfigLoadOptions with_dir = options;
  with_dir.config_dir = fs::absolute(path).parent_path().string();
  return load_config_text(text, path, overrides, with_dir);
}

std::vector<std::string> config_known_keys() {
  std::vector<std::string> k;
  for (const auto& s : schema()) k.push_back(s.key);
  return k;
}

std::vector<ConfigKeyDoc> config_key_docs() {
  std::vector<ConfigKeyDoc> out;
  for (const auto& s : schema()) out.push_back({s.key, s.type, s.default_text, s.doc});
  return out;
}

std::string config_reference_markdown() {
  std::ostringstream os;
  const char* head = "| key | type | default | meaning |\n|---|---|---|---|\n";
  auto row = [&](const ConfigKeyDoc& d) {
    os << "| `" << d.key << "` | " << d.type << " | " << d.default_text << " | " << d.doc << " |\n";
  };
  os << head;
  for (const auto& d : config_key_docs()) row(d);
  os << "\nThe keys of each `datasets` / `test_datasets` entry:\n\n" << head;
  for (const auto& d : dataset_key_docs()) row(d);
  os << "\nEvery other key of axolotl's schema is accepted with a note in the log or refused with a reason: "
        "docs/axolotl-keys.md (`eo-ddp --help-axolotl-keys`). Any other key is an error.\n";
  return os.str();
}

std::string config_to_yaml(const TrainConfig& c) {
  // Built from the schema so the printout always shows every key the loader knows.
  YAML::Node root(YAML::NodeType::Map);
  for (const auto& spec : schema()) {
    YAML::Node value = spec.write(c);
    if (!value.IsDefined()) continue;
    const auto dot = spec.key.find('.');
    if (dot == std::string::npos) root[spec.key] = value;
    else root[spec.key.substr(0, dot)][spec.key.substr(dot + 1)] = value;
  }
  YAML::Emitter out;
  out << root;
  return out.c_str();
}

ComputeChoice resolve_compute(const TrainConfig& cfg, bool on_cuda, bool cuda_has_bf16) {
  if (cfg.fp16.value_or(false)) return {Compute::Fp16, "fp16: true"};
  if (cfg.bf16 == "true") return {Compute::Bf16, "bf16: true"};
  if (cfg.bf16 == "false") return {Compute::Fp32, "bf16: false"};
  if (!on_cuda) return {Compute::Fp32, "bf16: auto on the CPU"};
  if (cuda_has_bf16) return {Compute::Bf16, "bf16: auto on a GPU with bf16"};
  if (cfg.fp16.has_value())
    return {Compute::Fp32, "bf16: auto on a GPU without bf16 (compute capability below 8.0), and fp16: false"};
  return {Compute::Fp16, "bf16: auto on a GPU without bf16 (compute capability below 8.0): fp16 with loss scaling"};
}

const char* compute_name(Compute c) { return c == Compute::Fp16 ? "fp16" : c == Compute::Bf16 ? "bf16" : "fp32"; }

bool experts_in_mxfp4(const TrainConfig& cfg, const model::ModelConfig& mc) {
  return cfg.load_in_4bit && (cfg.expert_quant == "mxfp4" || (cfg.expert_quant == "auto" && mc.mxfp4_experts));
}

std::optional<QuantFormat> expert_format(const TrainConfig& cfg, const model::ModelConfig& mc) {
  if (experts_in_mxfp4(cfg, mc)) return QuantFormat::Mxfp4;
  if (mc.nvfp4 && !(cfg.load_in_4bit && cfg.expert_quant == "nf4")) return QuantFormat::Nvfp4;
  if (cfg.load_in_4bit) return QuantFormat::Nf4;
  return std::nullopt;
}

}  // namespace eo
