// The gated delta rule's chain through its chunks as one kernel (models/delta_rule.cpp calls it for
// fp32 on a GPU). Plain pointers and a stream, like fused_cuda.h: no libtorch headers in the .cu.
//
// Both the forward's state chain and the backward's state-gradient chain have this form, per
// (row, value head) pair and chunk n of C tokens, with a state S [dk, dv]:
//   saved[n] = S
//   y[n]     = x[n] + sign_p · P[n] · S                       (x, y [C, dv]; P [C, dk])
//   S        = decay[n] · S + z[n] + sign_q · Q[n]ᵀ · y[n]     (Q [C, dk]; z [dk, dv], may be null)
// over n = 0 .. N−1, or N−1 .. 0 when `reverse`; S starts as `state` and ends in `final_state`.
// The forward: x = U, P = W, sign_p = −1, Q = e ⊙ k, sign_q = +1 (y = Ṽ, saved = entry states).
// The backward: x = dṼ from dO, P = e ⊙ k, sign_p = +1, Q = W, sign_q = −1, z = (Γ ⊙ q)ᵀ dO
// (y = dṼ, saved = dS of each chunk's exit).
// Value columns are independent, so one block runs the whole chain for 32 columns of one pair, its
// state slice in shared memory: one launch instead of a handful of small ones per chunk.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace eo::delta_rule::cuda {

struct ChainShape {
  std::int64_t pairs, chunks;  // B · Hv, N
  int C, dk, dv;
};

// Every pointer fp32 and contiguous: x, y [pairs, N, C, dv] (y may be x), P, Q [pairs, N, C, dk],
// z [pairs, N, dk, dv] or null, decay [pairs, N], saved [pairs, N, dk, dv], state and
// final_state [pairs, dk, dv].
struct ChainArgs {
  const float *x, *p, *q, *z, *decay, *state;
  float *y, *saved, *final_state;
  float sign_p, sign_q;
  bool reverse;
};

// Whether the kernel takes this shape on the current device (its shared memory: the state slice,
// one chunk of P or Q, and y's slice); where not, the caller runs the chain as tensor ops.
bool chain_fits(const ChainShape& s);
cudaError_t chunk_chain(const ChainShape& s, const ChainArgs& a, cudaStream_t stream);

// inv[b] = (I + a[b])⁻¹ for `batch` strictly lower-triangular C × C matrices (fp32, contiguous; what
// a holds on and above its diagonal is not read): forward substitution, one thread per column of the
// inverse, one block per matrix. The UT transform of each chunk; C ≤ kMaxInverseC.
constexpr int kMaxInverseC = 64;
cudaError_t unit_lower_inverse(const float* a, float* inv, std::int64_t batch, int C, cudaStream_t stream);

}  // namespace eo::delta_rule::cuda
