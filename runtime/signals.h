// SIGTERM / SIGINT / SIGUSR1 (cluster preemption, Ctrl-C, launch/eo-mpirun) ask the trainer to stop at the next step
// boundary, save a checkpoint and exit with kExitPreempted. A second signal exits at once.
#pragma once

namespace eo {

void install_stop_signals();
bool stop_requested();
int stop_signal();  // the signal that asked, 0 if none

}  // namespace eo
