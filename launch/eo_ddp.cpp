// eo-ddp: QLoRA fine-tuning of Mixture-of-Experts models with experts streamed from host RAM.
#include "launch/commands.h"
#include "runtime/signals.h"

// The stop handler goes in before any shared library's initialisers run (libtorch's take about
// 150 ms): the executable's .preinit_array runs first. A SIGTERM from then on is a stop request
// (exit 3, runtime/signals.h), not death by signal (143). run_main installs it again, harmlessly.
namespace {
void install_before_libraries(int, char**, char**) { eo::install_stop_signals(); }
}  // namespace
__attribute__((section(".preinit_array"), used)) static void (*const eo_preinit)(int, char**, char**) =
    install_before_libraries;

int main(int argc, char** argv) { return eo::launch::run_main(argc, argv); }
