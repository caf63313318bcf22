// eo-ddp's usage text: the overview (`eo-ddp --help`) and each command's own (`eo-ddp CMD --help`).
#pragma once

#include <string>

namespace eo::launch {

std::string overall_usage();
// The usage of `command` (train, preprocess, score, plan); empty when there is no such command.
std::string command_usage(const std::string& command);

}  // namespace eo::launch
