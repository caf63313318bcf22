#!/usr/bin/env python3
"""Reference for the gated delta rule (tests/test_delta_rule.cpp): transformers' own
torch_chunk_gated_delta_rule (Qwen3-Next's; Qwen3.5-MoE's is the same function), never eo-ddp.

    delta_rule_ref.py qwen3_next OUT_DIR

Writes OUT_DIR/qwen3_next/ref.safetensors with, for PREFIX in plain. and packed.:
  PREFIX{q,k,v,g,beta,h0}  random fp32 inputs shaped as a Qwen3-Next layer's (two value heads per
                           key head, dk != dv, g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b))
  PREFIXsegment_ids        (packed only) document ids of two packed rows, three documents each
  PREFIXout, final_state   transformers' outputs: chunk 64, use_qk_l2norm_in_kernel=True, the initial
                           state h0; packed rows run document by document (the first document of a row
                           from h0, the others from zeros), as fla's cu_seqlens does; final_state is the
                           state after each row's last document
  PREFIXw_out, w_state     weights of the loss sum(out * w_out) + sum(final_state * w_state)
  PREFIXgrad.{q,k,v,g,beta,h0}  that loss's gradients, autograd through transformers' function
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fixture_dir  # noqa: E402

ARCH, OUT = sys.argv[1], sys.argv[2]
assert ARCH == "qwen3_next"
out = fixture_dir.begin(OUT, ARCH, __file__)
# The reference stack only when the fixture is to be made: an up-to-date or cached one exits above
# without paying its imports (~3 CPU seconds).
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers.models.qwen3_next import modeling_qwen3_next  # noqa: E402
# The torch function itself, not whatever kernel the hub wrapper would pick.
chunk_rule = getattr(modeling_qwen3_next.torch_chunk_gated_delta_rule, "__wrapped__",
                     modeling_qwen3_next.torch_chunk_gated_delta_rule)

B, T, HK, HV, DK, DV = 2, 150, 2, 4, 32, 24
DOCS = [[40, 64, 46], [64, 1, 85]]
gen = torch.Generator().manual_seed(46)


def randn(*shape):
    return torch.randn(*shape, generator=gen)


def inputs():
    a_log, dt_bias = torch.rand(HV, generator=gen) * 2 - 1, randn(HV)
    return {
        "q": randn(B, T, HK, DK), "k": randn(B, T, HK, DK), "v": randn(B, T, HV, DV),
        "g": -a_log.exp() * F.softplus(randn(B, T, HV) + dt_bias),
        "beta": torch.sigmoid(randn(B, T, HV)), "h0": randn(B, HV, DK, DV) * 0.5,
    }


def rule(x, h0):
    return chunk_rule(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], chunk_size=64, initial_state=h0,
                      output_final_state=True, use_qk_l2norm_in_kernel=True)


def run(x, docs):
    if docs is None:
        return rule(x, x["h0"])
    outs, states = [], []
    for row, lengths in enumerate(docs):
        start, pieces, state = 0, [], None
        for d, n in enumerate(lengths):
            piece = {name: t[row:row + 1, start:start + n] for name, t in x.items() if name != "h0"}
            o, state = rule(piece, x["h0"][row:row + 1] if d == 0 else None)
            pieces.append(o)
            start += n
        outs.append(torch.cat(pieces, 1))
        states.append(state)
    return torch.cat(outs), torch.cat(states)


ref = {}
for prefix, docs in (("plain.", None), ("packed.", DOCS)):
    x = {name: t.requires_grad_() for name, t in inputs().items()}
    o, state = run(x, docs)
    w_out, w_state = randn(*o.shape), randn(*state.shape)
    loss = (o * w_out).sum() + (state * w_state).sum()
    grads = torch.autograd.grad(loss, list(x.values()))
    for name, t in x.items():
        ref[prefix + name] = t.detach()
    for name, gr in zip(x, grads):
        ref[f"{prefix}grad.{name}"] = gr
    ref[prefix + "out"], ref[prefix + "final_state"] = o.detach(), state.detach()
    ref[prefix + "w_out"], ref[prefix + "w_state"] = w_out, w_state
    if docs is not None:
        ref[prefix + "segment_ids"] = torch.cat(
            [torch.cat([torch.full((n,), d, dtype=torch.long) for d, n in enumerate(r)]) for r in docs]).view(B, T)
fixture_dir.finish(out, ref)
