// The tensors a use of the step schedule hands BlockGraphs (runtime/block_graphs.h), by name. A
// graph reads and writes flat lists at fixed positions (its static buffers are per position);
// these structs are the one place each order is written: pack() makes the list, unpack() reads one
// back inside the function a graph captures. A tensor added to BlockContext is added here, once.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <vector>

#include "models/moe_model.h"

namespace eo {

// A block's forward, or its recompute + backward: the input, the micro-batch's BlockContext
// tensors and, for the backward, the gradients arriving from above.
struct BlockUseInputs {
  at::Tensor x;                                          // the block's input
  at::Tensor cos, sin, attn_mask, document_starts, chunk_mask, q_scale, segment_ids, token_mask;  // BlockContext's
  at::Tensor dy;       // backward: dL/d(the block's output)
  at::Tensor drouter;  // backward with the aux loss: dL/d(its router logits); else undefined

  BlockUseInputs(const at::Tensor& input, const model::BlockContext& c, const at::Tensor& dy_ = {}, const at::Tensor& dr = {})
      : x(input), cos(c.cos), sin(c.sin), attn_mask(c.attn_mask), document_starts(c.document_starts),
        chunk_mask(c.chunk_mask), q_scale(c.q_scale), segment_ids(c.segment_ids), token_mask(c.token_mask), dy(dy_),
        drouter(dr) {}

  std::vector<at::Tensor> pack() const {
    return {x, cos, sin, attn_mask, document_starts, chunk_mask, q_scale, segment_ids, token_mask, dy, drouter};
  }
  static BlockUseInputs unpack(const std::vector<at::Tensor>& in) {
    BlockUseInputs u(in[0], {}, in[9], in[10]);
    u.cos = in[1];
    u.sin = in[2];
    u.attn_mask = in[3];
    u.document_starts = in[4];
    u.chunk_mask = in[5];
    u.q_scale = in[6];
    u.segment_ids = in[7];
    u.token_mask = in[8];
    return u;
  }
  // `c` (the micro-batch's context: training, router capture) reading these tensors.
  model::BlockContext context(model::BlockContext c) const {
    c.cos = cos;
    c.sin = sin;
    c.attn_mask = attn_mask;
    c.document_starts = document_starts;
    c.chunk_mask = chunk_mask;
    c.q_scale = q_scale;
    c.segment_ids = segment_ids;
    c.token_mask = token_mask;
    return c;
  }
};

// The loss of a micro-batch and its backward: in, the final hidden state, the labels, the scalars
// the graph must read afresh each step (as device tensors) and every block's router logits (aux
// loss; undefined for dense blocks); out, the gradients (all of the scaled loss) and the sums.
struct LossUseInputs {
  at::Tensor h, labels;
  at::Tensor tokens;  // the step's target tokens, all ranks: the loss's divisor
  at::Tensor poison;  // 1, or NaN where a test poisons this micro-batch
  at::Tensor scale;   // the loss scale (1 unless fp16)
  std::vector<at::Tensor> router_logits;

  std::vector<at::Tensor> pack() const {
    std::vector<at::Tensor> in{h, labels, tokens, poison, scale};
    in.insert(in.end(), router_logits.begin(), router_logits.end());
    return in;
  }
  static LossUseInputs unpack(const std::vector<at::Tensor>& in) {
    return {in[0], in[1], in[2], in[3], in[4], std::vector<at::Tensor>(in.begin() + 5, in.end())};
  }
};

struct LossUseOutputs {
  at::Tensor dh;       // dL/dh
  at::Tensor ce, aux;  // the cross-entropy sum (unscaled, unnormalised) and the raw aux loss (or undefined)
  std::vector<at::Tensor> drouter;  // dL/d(each block's router logits), undefined where there are none

  std::vector<at::Tensor> pack() const {
    std::vector<at::Tensor> out{dh, ce, aux};
    out.insert(out.end(), drouter.begin(), drouter.end());
    return out;
  }
  static LossUseOutputs unpack(const std::vector<at::Tensor>& out) {
    return {out[0], out[1], out[2], std::vector<at::Tensor>(out.begin() + 3, out.end())};
  }
};

}  // namespace eo
