#include "runtime/signals.h"

#include <unistd.h>

#include <atomic>
#include <csignal>
#include <string>

namespace eo {
namespace {
std::atomic<int> g_signal{0};

extern "C" void on_stop_signal(int sig) {
  if (g_signal.exchange(sig) != 0) _exit(128 + sig);  // second signal: leave now
  const char msg[] = "\neo-ddp: stop requested; stopping at the end of this step (saving a checkpoint) or, before training, of this stage (signal again to quit now)\n";
  ssize_t ignored = write(STDERR_FILENO, msg, sizeof msg - 1);
  (void)ignored;
}
}  // namespace

void install_stop_signals() {
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
  // mpirun forwards SIGUSR1 to every rank and lets the job end by itself (on SIGTERM it records
  // exit status 1 first): launch/eo-mpirun turns a SIGTERM into this, so the job exits 3.
  sigaction(SIGUSR1, &sa, nullptr);
  sigaction(SIGHUP, &sa, nullptr);
}

void throw_if_stopped(const std::string& during) {
  if (const int sig = stop_signal(); sig != 0)
    throw Stopped("stopped by signal " + std::to_string(sig) + " " + during + ", before training began: nothing was "
                  "trained, so nothing is lost and nothing was saved (exit 3); start the run again to continue");
}

bool stop_requested() { return g_signal.load() != 0; }
int stop_signal() { return g_signal.load(); }

}  // namespace eo
