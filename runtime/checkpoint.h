// Activation checkpointing with PyTorch's non-reentrant semantics, in C++ (design.md §2.1 Route A).
//
// libtorch has no C++ checkpoint utility. We install a subclass of the autograd Engine whose
// get_default_saved_variable_hooks() hands every SavedVariable created inside a checkpointed
// forward a *handle* instead of the tensor. The first time backward unpacks a handle of a block,
// the block's function is re-run once (grad mode on, RNG restored) and the handles resolve to the
// recomputed tensors. The outer graph is the normal one: no nested backward runs, so gradient
// accumulation and post-accumulate hooks fire once, in the normal order, and blocks recompute
// lazily in reverse order (block k after block k+1's gradients are done).
//
// Usage:
//   eo::install_checkpoint_engine();            // FIRST, before any autograd work (see below)
//   auto out = eo::checkpoint([&](const std::vector<at::Tensor>& in) { return block(in); }, {x});
//
// install_checkpoint_engine() replaces the process' default autograd engine through
// torch::autograd::set_default_engine_stub. Call it before the first forward that records a graph
// and before the first backward: the engine is chosen per call, and an engine switched under a
// running graph would leave worker threads of the old one behind. checkpoint() refuses to run if
// the installed default engine is not ours (e.g. install was forgotten or something replaced it).
//
// Limits: nested checkpoints are refused; the recompute runs under the backward call's autocast
// state (the project uses explicit dtypes, no autocast); fn must be deterministic given its inputs
// and the RNG state (CPU generator and the CUDA generators of the inputs' devices are restored).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <vector>

namespace eo {

using CheckpointFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

// Installs the checkpoint-aware autograd engine as libtorch's default. Idempotent, thread-safe.
// Must run before any autograd work (first graph-recording forward, first backward).
void install_checkpoint_engine();

// Runs fn(inputs) so that the tensors its autograd nodes save are dropped and recomputed (once)
// the first time backward needs one of them. fn is copied and kept, with the inputs (by
// reference: same tensors, views and detached tensors included), until the block's backward nodes
// are gone. The RNG state at this call is restored for the recompute when preserve_rng_state is
// true (the global RNG is left as it was: fork semantics). Inputs must not be modified in place
// after this call (checked). Returns fn's outputs, connected to the graph normally.
std::vector<at::Tensor> checkpoint(const CheckpointFn& fn, const std::vector<at::Tensor>& inputs,
                                   bool preserve_rng_state = true);

// True while the current thread is re-running a checkpointed fn for backward (lets a block know
// it is in its recompute, e.g. to stage the previous block's weights).
bool checkpoint_is_recomputing();

// Process-wide counters, for tests and logs.
struct CheckpointStats {
  int64_t forwards = 0;                      // checkpoint() calls
  int64_t recomputes = 0;                    // re-runs of a fn triggered by backward
  int64_t handles_packed = 0;                // saved tensors replaced by handles in forwards
  int64_t live_recomputed_tensors = 0;       // recomputed tensors not yet consumed, now
  int64_t live_recomputed_bytes = 0;
  int64_t peak_live_recomputed_tensors = 0;  // maxima since the last reset
  int64_t peak_live_recomputed_bytes = 0;
};
CheckpointStats checkpoint_stats();
// Zeroes the counters; peaks restart from the current live values.
void reset_checkpoint_stats();

}  // namespace eo
