// eo-ddp: QLoRA fine-tuning of Mixture-of-Experts models with experts streamed from host RAM.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>

#include <c10/util/Exception.h>

#include "common/error.h"
#include "common/log.h"
#include "launch/commands.h"
#include "launch/usage.h"
#include "runtime/config.h"
#include "runtime/config_help.h"
#include "runtime/ddp/world.h"
#include "runtime/signals.h"

namespace {


// --help-config [--markdown] [KEY]: the keys grouped for a terminal, one key, or the markdown table.
int print_config_help(const eo::launch::Args& args) {
  using namespace eo;
  bool markdown = false;
  std::string key;
  for (const auto& a : args) {
    if (a == "--markdown") markdown = true;
    else if (key.empty() && a.rfind("--", 0) != 0) key = a;
    else {
      std::fprintf(stderr, "eo-ddp: --help-config takes [--markdown] or one KEY, got '%s'\n", a.c_str());
      return kExitUsage;
    }
  }
  if (markdown && !key.empty()) {
    std::fprintf(stderr, "eo-ddp: --help-config takes --markdown or a KEY, not both\n");
    return kExitUsage;
  }
  if (markdown) {
    std::fputs(config_reference_markdown().c_str(), stdout);
    return kExitOk;
  }
  if (key.empty()) {
    std::fputs(config_reference_text().c_str(), stdout);
    return kExitOk;
  }
  const KeyHelp help = config_key_help(key);
  std::fputs(help.text.c_str(), help.found ? stdout : stderr);
  return help.found ? kExitOk : kExitUsage;
}

// An error on any rank ends every rank now, with the exit code a single process would give:
// the peers may be waiting in a collective (or MPI_Finalize) for this rank, which would never come.
int fail(const std::string& message, int code) {
  eo::log::error(message);
  if (eo::ddp::World::initialized() && eo::ddp::World::get().size() > 1) {
    std::fprintf(stderr, "eo-ddp: rank %d failed (exit %d); ending every rank\n", eo::ddp::World::get().rank(), code);
    eo::ddp::World::get().abort(code);
  }
  return code;
}

}  // namespace

int eo::launch::run_main(int argc, char** argv) {
  using namespace eo;
  // First: a signal from here on asks for a stop (runtime/signals.h) instead of killing the process.
  install_stop_signals();
  launch::Args args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "--help" || args[0] == "-h" || (args[0] == "help" && args.size() == 1)) {
    std::fputs(launch::overall_usage().c_str(), args.empty() ? stderr : stdout);
    return args.empty() ? kExitUsage : kExitOk;
  }
  // `eo-ddp help CMD`, and `eo-ddp [CMD] ... --help` (or -h) anywhere on the line: CMD's usage.
  const bool help_asked = args[0] == "help" || std::find(args.begin(), args.end(), "--help") != args.end() ||
                          std::find(args.begin(), args.end(), "-h") != args.end();
  if (help_asked && args[0] != "--help-config") {
    const std::string cmd = args[0] == "help" ? args[1] : args[0].rfind("--", 0) == 0 ? "train" : args[0];
    const std::string usage = launch::command_usage(cmd);
    if (usage.empty()) {
      std::fprintf(stderr, "eo-ddp: unknown command '%s' (commands: train, preprocess, score, plan, merge, generate)\n%s", cmd.c_str(),
                   launch::overall_usage().c_str());
      return kExitUsage;
    }
    std::fputs(usage.c_str(), stdout);
    return kExitOk;
  }
  if (args[0] == "--version") {
    std::printf("eo-ddp %s (%s)\n", EO_DDP_VERSION, EO_DDP_BUILD);
    return kExitOk;
  }
  if (args[0] == "--help-config") return print_config_help(launch::Args(args.begin() + 1, args.end()));
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
      ddp::World& world = ddp::World::init(&argc, &argv);
      log::set_rank(world.rank(), world.size());
      const int rc = launch::run_train(args);
      world.finalize();
      return rc;
    }
    if (cmd == "score") return launch::run_score(args);  // single process, no MPI
    if (cmd == "plan") return launch::run_plan(args);
    if (cmd == "merge") return launch::run_merge(args);  // single process, no MPI
    if (cmd == "generate") return launch::run_generate(args);  // single process, no MPI
    if (cmd == "preprocess") return launch::run_preprocess(args);  // single process, no MPI
    throw UsageError("unknown command '" + cmd + "' (commands: train, preprocess, score, plan, merge, generate; see eo-ddp --help)");
  } catch (const Stopped& e) {
    return fail(e.what(), kExitPreempted);
  } catch (const UsageError& e) {
    return fail(e.what(), kExitUsage);
  } catch (const c10::OutOfMemoryError& e) {
    // The start-up check let the run begin, so the plan said it fits: what is left to change is the cap
    // the plan fits to, or the allocator's way of carving memory.
    return fail(std::string(e.what_without_backtrace()) +
                    "\nThe memory plan said this run fits; fragmentation or a buffer the plan does not count took the "
                    "rest. Set device_memory_limit a GiB or two below the card so the plan chooses smaller pieces, "
                    "or run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.",
                kExitRuntime);
  } catch (const c10::Error& e) {
    return fail(e.what_without_backtrace(), kExitRuntime);  // the message, not libtorch's C++ backtrace
  } catch (const std::exception& e) {
    return fail(e.what(), kExitRuntime);
  }
}
