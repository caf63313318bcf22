// `eo-ddp plan --config F [--vram SIZE] [--host-ram SIZE] [--ranks-per-node N] [--card NAME |
// --card-figures F] [--set k=v ...]`: the memory plan from config.json and the training config alone
// (nothing is loaded), whether it fits the card, and whether the pinned host RAM per node fits
// (--host-ram, else this machine's available RAM), with what the other expert homes would take when
// it does not; with a card, the predicted step time there (runtime/step_time.h).
#include <cmath>
#include <cstdio>
#include <optional>

#include "common/error.h"
#include "common/text.h"
#include "launch/commands.h"
#include "models/hf_config.h"
#include "offload/host_memory.h"
#include "runtime/cards.h"
#include "runtime/config.h"
#include "runtime/plan.h"
#include "runtime/plan_fixes.h"
#include "runtime/step_time.h"

namespace eo::launch {

int run_plan(const Args& args) {
  ArgReader reader(args);
  const std::string config_path = reader.value("--config");
  const std::string vram_text = reader.value("--vram");
  const std::string host_text = reader.value("--host-ram");
  const std::string ranks_text = reader.value("--ranks-per-node", "1");
  const std::string card_name = reader.value("--card");
  const std::string card_text = reader.value("--card-figures");
  const auto overrides = reader.values("--set");
  reader.finish("plan");
  if (config_path.empty()) throw UsageError("plan: --config FILE is required (see eo-ddp --help)");
  if (!card_name.empty() && !card_text.empty())
    throw UsageError("plan: give --card or --card-figures, not both");
  std::optional<CardFigures> card;
  if (!card_name.empty()) card = find_card(card_name, "plan: --card");
  if (!card_text.empty()) card = card_from_figures(card_text, "plan: --card-figures");
  double vram = 0;
  if (card && vram_text.empty()) vram = card->vram_gib * 1024.0 * 1024.0 * 1024.0;
  if (!vram_text.empty()) {
    const auto b = parse_bytes(vram_text);
    if (!b || *b == 0) throw UsageError("plan: --vram expects a size such as 12GiB or 80GB, got '" + vram_text + "'");
    vram = double(*b);
  }
  double host_ram = 0;
  if (!host_text.empty()) {
    const auto b = parse_bytes(host_text);
    if (!b || *b == 0) throw UsageError("plan: --host-ram expects a size such as 512GiB, got '" + host_text + "'");
    host_ram = double(*b);
  }
  int ranks = 0;
  try {
    ranks = std::stoi(ranks_text);
  } catch (...) {
  }
  if (ranks < 1) throw UsageError("plan: --ranks-per-node expects an integer >= 1, got '" + ranks_text + "'");

  ConfigLoadOptions lo;
  lo.check_files = false;  // planning needs config.json only
  lo.check_architecture = true;  // targets as training resolves them (DeepSeek's defaults, peft's forms)
  model::ModelConfig mc;
  lo.model_out = &mc;
  const TrainConfig cfg = load_config_file(config_path, overrides, lo);
  // A plan is for a GPU: with bf16: auto one with bf16 (fp16 takes the same bytes).
  const RunSpec spec = resolve_run_spec(cfg, std::move(mc), resolve_compute(cfg, /*on_cuda=*/true, /*cuda_has_bf16=*/true).dtype,
                                        /*on_gpu=*/true, ranks);
  // Against a card: the plan the start-up check would take (auto's alternatives where only they fit).
  const FittedPlan fitted = vram > 0 ? fit_plan(spec, vram) : FittedPlan{spec, plan_memory(spec)};
  const MemoryPlan& plan = fitted.plan;
  std::fputs(describe_plan(plan, vram).c_str(), stdout);
  if (fitted.down_from > 0) std::printf("  (expert_bank_reuse: auto -> down, as training would take it: all did not fit)\n");
  if (fitted.grouped_from > 0)
    std::printf("  (expert_group_size: auto -> %d, as training would take it: whole blocks did not fit)\n", fitted.spec.group_size);
  if (fitted.sliced_from > 0) std::printf("  (expert_dequant_chunk: auto -> 64 MiB slices, as training would take it: whole banks did not fit)\n");
  std::string source = "--host-ram";
  if (host_ram <= 0) {
    const offload::HostMemory m = offload::host_memory_available();
    host_ram = double(m.available);
    source = "available on this machine: " + m.source;
  }
  const HostRamFit host = describe_host_ram(fitted.spec, plan, host_ram, source);
  std::fputs(host.text.c_str(), stdout);
  if (card) std::fputs(describe_step_time(predict_step_time(step_work(fitted.spec, plan), *card), *card).c_str(), stdout);
  const bool vram_short = vram > 0 && plan.device_peak + plan.margin > vram;
  const bool host_short = !host_text.empty() && !host.fits;  // only a limit given explicitly fails the command
  if (vram_short || host_short) {
    std::vector<std::string> limits;
    if (vram > 0) limits.push_back("a " + human_bytes(vram) + " card");
    if (!host_text.empty()) limits.push_back(human_bytes(host_ram) + " of host RAM per node");
    const std::string limit = join(limits, " and ");
    std::fputs(describe_fixes(plan_fixes(cfg, spec, vram > 0 ? vram : HUGE_VAL, host_text.empty() ? 0 : host_ram), limit).c_str(),
               stdout);
  }
  return vram_short || host_short ? kExitRuntime : kExitOk;
}

}  // namespace eo::launch
