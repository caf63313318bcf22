#!/usr/bin/env python3
"""Logs a run's metrics.jsonl to Weights & Biases as eo-ddp writes it (eo-ddp starts it for
wandb_project; runtime/trackers.h).

    wandb_follow.py --metrics FILE --project P --dir OUTPUT_DIR [--mode M] [--entity E] [--name N] [--run-id ID]

Each complete line is one wandb.log(fields, step=line["step"]) (nested fields as "a/b"). It ends
when its stdin closes (eo-ddp's last step is in the file): the rest of the file is logged and the
run finished. Training never waits for it: eo-ddp reads nothing from it and ends it if it is still
running a while after the last step.
"""
import argparse
import json
import os
import select
import sys
import time


def flat(prefix, obj, out):
    for k, v in obj.items():
        tag = f"{prefix}/{k}" if prefix else k
        if isinstance(v, dict):
            flat(tag, v, out)
        elif isinstance(v, bool):
            out[tag] = int(v)
        elif isinstance(v, (int, float)):
            out[tag] = v
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--metrics", required=True)
    p.add_argument("--project", required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--mode", default="online")
    p.add_argument("--entity")
    p.add_argument("--name")
    p.add_argument("--run-id")
    a = p.parse_args()
    import wandb

    run = wandb.init(project=a.project, entity=a.entity, name=a.name, id=a.run_id, mode=a.mode, dir=a.dir,
                     resume="allow" if a.run_id else None)
    offset, pending, ended = 0, "", False
    while True:
        if not ended:  # stdin closes when training is over
            ready, _, _ = select.select([sys.stdin], [], [], 0.5)
            ended = bool(ready) and not os.read(sys.stdin.fileno(), 4096)
        try:
            with open(a.metrics, "rb") as f:
                f.seek(offset)
                chunk = f.read()
        except FileNotFoundError:
            chunk = b""
        offset += len(chunk)
        pending += chunk.decode("utf-8", errors="replace")
        *lines, pending = pending.split("\n")
        for line in lines:
            if line.strip():
                fields = json.loads(line)
                run.log(flat("", fields, {}), step=int(fields["step"]))
        if ended:
            break
        if not lines:
            time.sleep(0.5)
    run.finish()


if __name__ == "__main__":
    main()
