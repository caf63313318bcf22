#!/usr/bin/env python3
"""torch.amp.GradScaler's loss scale, the reference for eo-ddp's LossScaler (runtime/loss_scale.h).

    grad_scaler_ref.py GROWTH_INTERVAL FLAGS

FLAGS is one character per optimizer step, 1 where its gradients overflow (inf), 0 where clean.
Prints one line per step: `step scale_used` (repr), the scale GradScaler multiplies that step's
loss by, then a last line `final scale growth_tracker` after the last update. The GradScaler
runs on the CPU with its defaults (init 2^16, growth 2, backoff 0.5) on a one-parameter SGD.
"""
import sys

import torch

interval = int(sys.argv[1])
flags = sys.argv[2]
p = torch.nn.Parameter(torch.zeros(1))
opt = torch.optim.SGD([p], lr=1.0)
scaler = torch.amp.GradScaler("cpu", growth_interval=interval)
for step, flag in enumerate(flags, start=1):
    scaled = scaler.scale(torch.ones((), requires_grad=True))  # the scale this step uses
    print(step, repr(float(scaler.get_scale())))
    opt.zero_grad()
    p.grad = torch.full((1,), float("inf") if flag == "1" else 1.0)
    scaler.step(opt)
    scaler.update()
print("final", repr(float(scaler.get_scale())), int(scaler._growth_tracker.item()))
