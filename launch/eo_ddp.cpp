// eo-ddp: QLoRA fine-tuning of Mixture-of-Experts models with experts streamed from host RAM.
#include "launch/commands.h"

int main(int argc, char** argv) { return eo::launch::run_main(argc, argv); }
