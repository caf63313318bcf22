// SIGTERM / SIGINT / SIGUSR1 / SIGHUP (cluster preemption, Ctrl-C, launch/eo-mpirun, a closed
// terminal) ask the run to stop. main installs the handler before anything else, so a signal at
// any moment is a request, never the default death (143, 129, 138):
//  - during training, at the next step boundary: a checkpoint is saved, exit kExitPreempted;
//  - before training (config, output_dir, tokenising the datasets, loading), at the next of those
//    stages: the tokeniser child is ended, nothing has been trained so nothing is saved, and the
//    run exits kExitPreempted as well (Stopped). A second signal exits at once (128 + signal).
#pragma once

#include <string>

#include "common/error.h"

namespace eo {

void install_stop_signals();
bool stop_requested();
int stop_signal();  // the signal that asked, 0 if none

// A stop honoured before training began: main exits kExitPreempted with this message.
class Stopped : public Error {
 public:
  using Error::Error;
};
// Throws Stopped saying what was interrupted (`during`) when a stop was requested.
void throw_if_stopped(const std::string& during);

}  // namespace eo
