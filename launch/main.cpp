// eo-ddp: QLoRA fine-tuning of Mixture-of-Experts models with experts streamed from host RAM.
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>

#include "common/error.h"
#include "common/log.h"
#include "launch/commands.h"
#include "runtime/config.h"
#include "runtime/dist/world.h"
#include "runtime/signals.h"

namespace {

const char* kUsage = R"(usage:
  eo-ddp [train] --config FILE [--set key=value ...] [--check]
      Train (or with --check: validate, print the resolved config and the plan, load nothing).
      --set overrides a config key (dotted for nested keys, values are YAML scalars), e.g.
      --set gradient_checkpointing_kwargs.use_reentrant=false --set learning_rate=1e-4
  eo-ddp preprocess --config FILE [--set key=value ...]
      Tokenise the chat_template / alpaca / completion / input_output datasets into
      dataset_prepared_path with the model's tokenizer (Python transformers); train does it too
      when the cache is missing or stale.
  eo-ddp score --model DIR [--adapter DIR] --data FILE [--dtype fp32|bf16] [--load-in-4bit | --no-load-in-4bit] [--window N] [--json]
      Mean next-token loss of a checkpoint (and optional peft adapter) on tokenized JSONL; the base
      is NF4 or not as the adapter was trained (its eo_ddp_base.json) unless a flag says otherwise.
      Rows longer than --window tokens (default 8192) are scored in windows sharing one token.
  eo-ddp plan --config FILE [--vram SIZE] [--host-ram SIZE] [--ranks-per-node N] [--set key=value ...]
      Predict per-rank peak VRAM and pinned host RAM (per node), and with disk homes the file and
      the drive reads per step, from config.json and the config alone (nothing is loaded); with
      --vram / --host-ram, say whether it fits such a card / node (exit 1 if not); without
      --host-ram the pinned RAM is set against this machine's available RAM.
  eo-ddp --help | --help-config | --help-axolotl-keys | --version

Multi-GPU / multi-node: mpirun -np N eo-ddp --config FILE (one rank per GPU).
Exit codes: 0 success, 1 runtime failure, 2 bad usage or config, 3 stopped by SIGTERM, SIGINT,
SIGUSR1 or SIGHUP with nothing lost (a checkpoint saved, or stopped before training began).
)";

// An error on any rank ends every rank now, with the exit code a single process would give:
// the peers may be waiting in a collective (or MPI_Finalize) for this rank, which would never come.
int fail(const std::string& message, int code) {
  eo::log::error(message);
  if (eo::dist::World::initialized() && eo::dist::World::get().size() > 1) {
    std::fprintf(stderr, "eo-ddp: rank %d failed (exit %d); ending every rank\n", eo::dist::World::get().rank(), code);
    eo::dist::World::get().abort(code);
  }
  return code;
}

}  // namespace

int eo::launch::run_main(int argc, char** argv) {
  using namespace eo;
  // First: a signal from here on asks for a stop (runtime/signals.h) instead of killing the process.
  install_stop_signals();
  launch::Args args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
    std::fputs(kUsage, args.empty() ? stderr : stdout);
    return args.empty() ? kExitUsage : kExitOk;
  }
  if (args[0] == "--version") {
    std::printf("eo-ddp %s (%s)\n", EO_DDP_VERSION, EO_DDP_BUILD);
    return kExitOk;
  }
  if (args[0] == "--help-config") {
    std::fputs(config_reference_markdown().c_str(), stdout);
    return kExitOk;
  }
  if (args[0] == "--help-axolotl-keys") {
    std::fputs(axolotl_keys_markdown().c_str(), stdout);
    return kExitOk;
  }
  try {
    std::string cmd = "train";
    if (args[0].rfind("--", 0) != 0) {
      cmd = args[0];
      args.erase(args.begin());
    }
    if (cmd == "train") {
      dist::World& world = dist::World::init(&argc, &argv);
      log::set_rank(world.rank(), world.size());
      const int rc = launch::run_train(args);
      world.finalize();
      return rc;
    }
    if (cmd == "score") return launch::run_score(args);  // single process, no MPI
    if (cmd == "plan") return launch::run_plan(args);
    if (cmd == "preprocess") return launch::run_preprocess(args);  // single process, no MPI
    throw UsageError("unknown command '" + cmd + "' (commands: train, preprocess, score, plan; see eo-ddp --help)");
  } catch (const Stopped& e) {
    return fail(e.what(), kExitPreempted);
  } catch (const UsageError& e) {
    return fail(e.what(), kExitUsage);
  } catch (const std::exception& e) {
    return fail(e.what(), kExitRuntime);
  }
}
