#include "runtime/plan_fixes.h"

#include <algorithm>
#include <functional>
#include <optional>
#include <set>
#include <sstream>

#include "common/text.h"
#include "runtime/config_help.h"
#include "runtime/plan.h"

namespace eo {
namespace {

using Sets = std::vector<std::pair<std::string, std::string>>;

// Every change is made to a copy of the config and re-planned from it through the same
// resolve_run_spec and fit_plan the run itself takes.
struct Replanner {
  const RunSpec& base;
  double available;
  double host_ram;

  PlanFix plan(const TrainConfig& cfg, Sets sets, std::string what) const {
    const RunSpec spec = resolve_run_spec(cfg, base.model, base.compute, base.on_gpu, base.ranks_per_node);
    const FittedPlan f = fit_plan(spec, available);
    PlanFix out{std::move(sets), std::move(what), f.plan.device_peak, f.plan.margin, 0, false};
    if (spec.offload) out.host_pinned_per_node = host_ram_per_node(f.plan);
    out.fits = out.peak + out.margin <= available && (host_ram <= 0 || out.host_pinned_per_node <= host_ram);
    return out;
  }
};

// One change: the config with it made, the --set pairs that make it, and what it costs.
struct Change {
  TrainConfig cfg;
  Sets sets;
  std::string what;
};
using ChangeFn = std::function<std::optional<Change>(const TrainConfig&, const Replanner&)>;

// The keys expert_offload and activation_offloading need beside them (config_checks.cpp's check_rules).
void add_checkpointing(Change& c) {
  if (!c.cfg.gradient_checkpointing) {
    c.cfg.gradient_checkpointing = true;
    c.sets.push_back({"gradient_checkpointing", "true"});
  }
  if (c.cfg.use_reentrant != false) {  // unset or true: offload needs it false, written out
    c.cfg.use_reentrant = false;
    c.sets.push_back({"gradient_checkpointing_kwargs.use_reentrant", "false"});
  }
}

// Pinned homes that host RAM cannot hold go to a drive; the folder is the user's to choose.
void homes_on_disk_if_short(Change& c, const Replanner& r) {
  if (r.host_ram <= 0 || !c.cfg.expert_offload || c.cfg.expert_offload_homes == "disk") return;
  if (r.plan(c.cfg, {}, "").host_pinned_per_node <= r.host_ram) return;
  c.cfg.expert_offload_homes = "disk";
  c.sets.push_back({"expert_offload_homes", "disk"});
  if (c.cfg.expert_offload_disk_path.empty()) {
    c.cfg.expert_offload_disk_path = "/local/nvme/eo-homes";
    c.sets.push_back({"expert_offload_disk_path", "/local/nvme/eo-homes"});
  }
  c.what += "; the homes on a local drive (a folder of your choice on NVMe), host RAM holds a read ring";
}

std::optional<Change> homes_on_disk(const TrainConfig& cfg, const Replanner& r) {
  Change c{cfg, {}, "expert homes"};
  homes_on_disk_if_short(c, r);
  if (c.sets.empty()) return std::nullopt;
  c.what = c.what.substr(c.what.find("; ") + 2);
  return c;
}

std::optional<Change> expert_offload(const TrainConfig& cfg, const Replanner& r) {
  if (cfg.expert_offload || !cfg.load_in_4bit || cfg.adapter != "qlora" || r.base.moe_layers.empty()) return std::nullopt;
  Change c{cfg, {{"expert_offload", "true"}}, "experts streamed from pinned host RAM: each step waits on host-to-device copies"};
  c.cfg.expert_offload = true;
  add_checkpointing(c);
  homes_on_disk_if_short(c, r);
  return c;
}

std::optional<Change> checkpointing(const TrainConfig& cfg, const Replanner&) {
  if (cfg.gradient_checkpointing) return std::nullopt;
  Change c{cfg, {}, "each block recomputed in backward (about a third more compute)"};
  add_checkpointing(c);
  return c;
}

std::optional<Change> activation_offloading(const TrainConfig& cfg, const Replanner&) {
  if (cfg.activation_offloading) return std::nullopt;
  Change c{cfg, {{"activation_offloading", "true"}}, "checkpointed block inputs parked in pinned host RAM"};
  c.cfg.activation_offloading = true;
  add_checkpointing(c);
  return c;
}

std::optional<Change> micro_batch_major(const TrainConfig& cfg, const Replanner&) {
  if (cfg.step_order == "micro_batch_major" || cfg.gradient_accumulation_steps <= 1 || !cfg.gradient_checkpointing)
    return std::nullopt;
  Change c{cfg, {{"step_order", "micro_batch_major"}},
           "one micro-batch at a time through every layer (with expert_offload: the experts copied once per micro-batch)"};
  c.cfg.step_order = "micro_batch_major";
  return c;
}

// A number the user can lower: micro_batch_size, sequence_len, lora_r, through `values` (descending,
// all below the current value).
struct Lowering {
  const char* key;
  const char* what;
  int TrainConfig::*field;
  std::function<std::vector<int>(int)> values;

  Change made(const TrainConfig& cfg, int v) const {
    Change c{cfg, {{key, std::to_string(v)}}, what};
    c.cfg.*field = v;
    return c;
  }
  // Alone: the largest value that fits, else the smallest. The peak grows with each of these
  // values, so a binary search finds it.
  std::optional<Change> largest_fitting(const TrainConfig& cfg, const Replanner& r) const {
    const std::vector<int> v = values(cfg.*field);
    if (v.empty()) return std::nullopt;
    std::size_t lo = 0, hi = v.size();
    while (lo < hi) {
      const std::size_t mid = (lo + hi) / 2;
      if (r.plan(made(cfg, v[mid]).cfg, {}, "").fits) hi = mid;
      else lo = mid + 1;
    }
    return made(cfg, v[std::min(lo, v.size() - 1)]);
  }
  // Among others: one notch down, to half the value or the next below it.
  std::optional<Change> halved(const TrainConfig& cfg) const {
    const std::vector<int> v = values(cfg.*field);
    if (v.empty()) return std::nullopt;
    for (int x : v)
      if (x <= cfg.*field / 2) return made(cfg, x);
    return made(cfg, v.back());
  }
};

std::vector<int> multiples_below(int from, int step) {
  std::vector<int> v;
  for (int x = (from - 1) / step * step; x >= step; x -= step) v.push_back(x);
  return v;
}

const std::vector<Lowering>& lowerings() {
  static const std::vector<Lowering> l = {
      {"micro_batch_size", "fewer sequences per micro-step: a smaller batch per optimizer step", &TrainConfig::micro_batch_size,
       [](int from) { return multiples_below(from, 1); }},
      {"sequence_len", "shorter sequences: longer documents are cut", &TrainConfig::sequence_len,
       [](int from) { return multiples_below(from, 128); }},
      {"lora_r", "a smaller LoRA rank: fewer trainable parameters", &TrainConfig::lora_r,
       [](int from) {
         std::vector<int> v;
         for (int x = from / 2; x >= 1; x /= 2) v.push_back(x);
         return v;
       }},
  };
  return l;
}

std::optional<Change> attention_only(const TrainConfig& cfg, const Replanner& r) {
  std::vector<std::string> names;
  for (int i = 0; i < r.base.model.layers; ++i)
    for (const auto& l : r.base.model.attention_shapes(i))
      if (std::find(names.begin(), names.end(), l.name) == names.end()) names.push_back(l.name);
  const bool narrower = cfg.lora_target_linear || !cfg.lora_target_parameters.empty() ||
                        std::any_of(cfg.lora_target_modules.begin(), cfg.lora_target_modules.end(), [&](const std::string& m) {
                          return std::find(names.begin(), names.end(), m) == names.end();
                        });
  if (names.empty() || !narrower) return std::nullopt;
  Change c{cfg, {}, "LoRA on the attention linears only: the MLP and the experts are not adapted"};
  if (cfg.lora_target_linear) c.sets.push_back({"lora_target_linear", "false"});
  c.sets.push_back({"lora_target_modules", "[" + join(names, ",") + "]"});
  if (!cfg.lora_target_parameters.empty()) c.sets.push_back({"lora_target_parameters", "[]"});
  c.cfg.lora_target_linear = c.cfg.lora_target_regex = false;
  c.cfg.lora_target_modules = names;
  c.cfg.lora_target_parameters.clear();
  return c;
}

// Cheapest first (the header says why this order). The first ones change how the run is done,
// the others (with a notch) what is trained.
struct Step {
  ChangeFn alone;
  ChangeFn notch;  // a notch down among other changes; null for the changes to how the run is done
};

const std::vector<Step>& steps() {
  static const std::vector<Step> s = [] {
    std::vector<Step> v = {{expert_offload, nullptr}, {checkpointing, nullptr}, {activation_offloading, nullptr},
                           {micro_batch_major, nullptr}, {homes_on_disk, nullptr}};
    for (const Lowering& l : lowerings())
      v.push_back({[&l](const TrainConfig& c, const Replanner& r) { return l.largest_fitting(c, r); },
                   [&l](const TrainConfig& c, const Replanner&) { return l.halved(c); }});
    v.push_back({attention_only, attention_only});
    return v;
  }();
  return s;
}

// `key: value` as a YAML line; a dotted key nests (gradient_checkpointing_kwargs: {use_reentrant: false}).
std::string yaml_line(const std::string& key, const std::string& value) {
  const auto dot = key.find('.');
  if (dot == std::string::npos) return key + ": " + value;
  return key.substr(0, dot) + ": {" + key.substr(dot + 1) + ": " + value + "}";
}

void describe_one(std::ostringstream& os, const PlanFix& f, const std::string& label) {
  const std::string indent(label.size(), ' ');
  const std::string what = wrap(f.what, indent, kHelpWidth);
  std::string sets, yaml;
  const std::string in_yaml = "  in YAML: ";
  for (std::size_t i = 0; i < f.sets.size(); ++i) {
    sets += (i ? " " : "") + std::string("--set ") + f.sets[i].first + "=" + f.sets[i].second;
    yaml += indent + (i ? std::string(in_yaml.size(), ' ') : in_yaml) + yaml_line(f.sets[i].first, f.sets[i].second) +
            "\n";
  }
  os << label << what.substr(indent.size()) << indent << "peak " << human_bytes(f.peak) << ", " << human_bytes(f.peak + f.margin)
     << " with margin";
  if (f.host_pinned_per_node > 0) os << "; " << human_bytes(f.host_pinned_per_node) << " pinned host RAM per node";
  os << "\n" << indent << "  " << sets << "\n" << yaml;
}

}  // namespace

namespace {

// The changes together, leaving out the steps in `skip`: every change to how the run is done that
// lowers the peak (or the pinned host RAM); then the cheapest single change to what is trained that
// fits on top; else those changes a notch at a time, in turn, until the run fits.
struct Combined {
  PlanFix fix;
  std::vector<std::size_t> how_taken;  // the steps that change how the run is done, taken
  Sets trained;                        // the changes to what is trained
};

Combined combine(const TrainConfig& cfg, const Replanner& r, const std::vector<std::size_t>& skip) {
  Combined out;
  TrainConfig cur = cfg;
  PlanFix now = r.plan(cur, {}, "");
  Sets sets;
  std::vector<std::string> whats;
  auto take = [&](const Change& c) {
    const PlanFix f = r.plan(c.cfg, {}, "");
    if (f.peak >= now.peak && f.host_pinned_per_node >= now.host_pinned_per_node) return false;
    cur = c.cfg;
    for (const auto& kv : c.sets) {  // a key lowered again keeps its first place
      auto it = std::find_if(sets.begin(), sets.end(), [&](const auto& s) { return s.first == kv.first; });
      if (it == sets.end()) sets.push_back(kv);
      else it->second = kv.second;
    }
    if (std::find(whats.begin(), whats.end(), c.what) == whats.end()) whats.push_back(c.what);
    now = f;
    return true;
  };
  const auto& all = steps();
  for (std::size_t i = 0; i < all.size(); ++i)
    if (!all[i].notch && !now.fits && std::find(skip.begin(), skip.end(), i) == skip.end())
      if (const auto c = all[i].alone(cur, r); c && take(*c)) out.how_taken.push_back(i);
  const Sets how = sets;
  for (const Step& step : all) {
    if (!step.notch || now.fits) continue;
    if (const auto c = step.alone(cur, r); c && r.plan(c->cfg, {}, "").fits) take(*c);
  }
  for (bool progress = true; progress && !now.fits;) {
    progress = false;
    for (const Step& step : all) {
      if (!step.notch || now.fits) continue;
      if (const auto c = step.notch(cur, r)) progress |= take(*c);
    }
  }
  out.trained.assign(sets.begin() + static_cast<std::ptrdiff_t>(how.size()), sets.end());
  out.fix = now;
  out.fix.sets = sets;
  out.fix.what = join(whats, "; ");
  return out;
}

}  // namespace

FixPlan plan_fixes(const TrainConfig& cfg, const RunSpec& spec, double available, double host_ram) {
  const Replanner r{spec, available, host_ram};
  FixPlan out;
  for (const Step& step : steps())
    if (const auto c = step.alone(cfg, r))
      if (PlanFix f = r.plan(c->cfg, c->sets, c->what); f.fits) out.singles.push_back(std::move(f));
  if (!out.singles.empty()) return out;
  // A change to how the run is done that the rest fits without, giving up nothing more of what is
  // trained, is left out (the dearest first).
  std::vector<std::size_t> skip;
  Combined best = combine(cfg, r, skip);
  for (auto it = best.how_taken.rbegin(); best.fix.fits && it != best.how_taken.rend(); ++it) {
    skip.push_back(*it);
    const Combined without = combine(cfg, r, skip);
    if (without.fix.fits && without.trained == best.trained) best = without;
    else skip.pop_back();
  }
  out.combined = best.fix;
  return out;
}

std::string describe_fixes(const FixPlan& fixes, const std::string& limit) {
  std::ostringstream os;
  // The heading, then each change listed with its label.
  std::vector<std::pair<const PlanFix*, std::string>> listed;
  if (!fixes.singles.empty()) {
    os << "what to change to fit " << limit << " (cheapest first; each re-planned, the margin included):\n";
    for (std::size_t i = 0; i < fixes.singles.size(); ++i)
      listed.emplace_back(&fixes.singles[i], "  " + std::to_string(i + 1) + ". ");
  } else if (fixes.combined.sets.empty()) {
    os << "nothing in the config that eo-ddp can change makes it fit " << limit << "\n";
  } else if (fixes.combined.fits) {
    os << "no single change fits " << limit << "; these together do (re-planned, the margin included):\n";
    listed.emplace_back(&fixes.combined, "  ");
  } else {
    os << "nothing in the config that eo-ddp can change makes it fit " << limit
       << "; with every change below it still needs " << human_bytes(fixes.combined.peak + fixes.combined.margin) << ":\n";
    listed.emplace_back(&fixes.combined, "  ");
  }
  for (const auto& [fix, label] : listed) describe_one(os, *fix, label);
  return os.str();
}

}  // namespace eo
