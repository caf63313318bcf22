#!/usr/bin/env python3
"""transformers' learning-rate multipliers, the reference for eo-ddp's lr_multiplier.

    lr_schedule_ref.py WARMUP:TOTAL...

For each case, prints one line per (schedule, step) for steps 0..TOTAL+1:
`warmup total name step multiplier` (repr: exact to the last bit), from
transformers.get_scheduler on a one-parameter optimizer with lr 1, read as the LambdaLR factor
used for optimizer step `step` (0-based), as HF's Trainer applies it.
"""
import sys

import torch
from transformers import get_scheduler

for case in sys.argv[1:]:
    warmup, total = (int(a) for a in case.split(":"))
    for name in ("constant", "constant_with_warmup", "linear", "cosine"):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        kwargs = {} if name == "constant" else {"num_warmup_steps": warmup}
        if name in ("linear", "cosine"):
            kwargs["num_training_steps"] = total
        sched = get_scheduler(name, opt, **kwargs)
        for step in range(total + 2):
            # LambdaLR's lr_lambdas[0](step) is the factor the Trainer's step `step` runs with.
            print(warmup, total, name, step, repr(sched.lr_lambdas[0](step)))
