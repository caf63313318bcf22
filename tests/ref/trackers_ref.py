#!/usr/bin/env python3
"""The trackers read back what metrics.jsonl says, and never change training.

    trackers_ref.py EO_DDP_BINARY SOURCE_DIR WORK_DIR

1. use_tensorboard: tensorboard's own EventAccumulator reads output_dir/runs/ and finds every
   numeric metrics.jsonl field of every line as a scalar at that step, equal as float32 (TensorBoard's
   simple_value), and no other tag.
2. wandb_project with wandb_mode offline: the wandb run folder under output_dir/wandb/ holds a history
   (read here from its .wandb file: LevelDB log records of wandb's Record protobuf) whose rows equal
   metrics.jsonl's lines.
3. A wandb that raises in init, and one that hangs in log (stand-ins first on PYTHONPATH): training
   finishes, says so once, and the adapter is bitwise the adapter of a run without any tracker.
"""
import glob
import json
import os
import shutil
import struct
import subprocess
import sys
import time

import numpy as np

BINARY, SRC, WORK = sys.argv[1:4]
shutil.rmtree(WORK, ignore_errors=True)
os.makedirs(WORK)
env = dict(os.environ, OMP_NUM_THREADS="1")
failures = []


def check(ok, msg):
    print(("ok   " if ok else "FAIL ") + msg)
    if not ok:
        failures.append(msg)


def train(name, *sets, extra_env=None):
    out = os.path.join(WORK, name)
    cmd = [BINARY, "--config", "configs/tiny-qwen3-moe.yaml", "--set", "output_dir=" + out, "--set", "max_steps=6",
           "--set", "save_steps=0", "--set", "logging_steps=1"]
    for s in sets:
        cmd += ["--set", s]
    start = time.time()
    r = subprocess.run(cmd, cwd=SRC, env=dict(env, **(extra_env or {})), timeout=600, capture_output=True, text=True)
    if r.returncode != 0:
        print(r.stderr[-2000:])
    return out, r, time.time() - start


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


def metrics(out):
    return [flat("", json.loads(l), {}) for l in open(os.path.join(out, "metrics.jsonl")) if l.strip()]


# ---- 1. TensorBoard
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

out, r, _ = train("tensorboard", "use_tensorboard=true")
check(r.returncode == 0, "a use_tensorboard run exits 0")
rows = metrics(out)
ea = EventAccumulator(os.path.join(out, "runs"), size_guidance={"scalars": 0})
ea.Reload()
tags = set(ea.Tags()["scalars"])
want_tags = set().union(*(row.keys() for row in rows))
check(tags == want_tags, f"the scalars are metrics.jsonl's {len(want_tags)} fields: only in the events "
      f"{sorted(tags - want_tags)}, only in metrics.jsonl {sorted(want_tags - tags)}")
bad = []
for row in rows:
    for tag, v in row.items():
        events = [e for e in ea.Scalars(tag) if e.step == row["step"]] if tag in tags else []
        if len(events) != 1 or np.float32(events[0].value) != np.float32(v):
            bad.append((tag, row["step"], v, [e.value for e in events]))
check(not bad and len(rows) == 6, f"EventAccumulator reads every value of the {len(rows)} lines back (float32) {bad[:3]}")
# The framing as TensorFlow's reader checks it (tensorboard's stub reads without checking): each record's
# length and data carry TFRecord's masked CRC-32C, computed here by tensorboard's own crc32c.
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
events = glob.glob(os.path.join(out, "runs", "events.out.tfevents.*"))
data, pos, records, crc_ok = open(events[0], "rb").read(), 0, 0, True
while pos < len(data):
    header = data[pos:pos + 8]
    (length,) = struct.unpack("<Q", header)
    crc_ok &= struct.unpack("<I", data[pos + 8:pos + 12])[0] == masked_crc32c(header)
    body = data[pos + 12:pos + 12 + length]
    crc_ok &= struct.unpack("<I", data[pos + 12 + length:pos + 16 + length])[0] == masked_crc32c(body)
    pos, records = pos + 16 + length, records + 1
check(len(events) == 1 and crc_ok and pos == len(data) and records == len(rows) + 1,
      f"{records} TFRecords (the file version, then one per line), every masked CRC-32C right")


# ---- 2. W&B offline
def wandb_history(run_file):
    """Rows of a .wandb file: wandb's LevelDB-style log (a 7-byte ':W&B' header, 32 KiB blocks of
    records with a 7-byte header: crc32c, length, type FULL/FIRST/MIDDLE/LAST), each a Record."""
    from wandb.proto import wandb_internal_pb2
    data = open(run_file, "rb").read()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B" and magic == 0xBEE1, (ident, magic, version)
    pos, block, records, part = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        part += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            records.append(part)
            part = b""
    rows = []
    for raw in records:
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(raw)
        if rec.WhichOneof("record_type") == "history":
            row = {}
            for item in rec.history.item:
                key = item.key or "/".join(item.nested_key)
                row[key] = json.loads(item.value_json)
            rows.append(row)
    return rows


out, r, _ = train("wandb", "wandb_project=eo-ddp-test", "wandb_mode=offline", "wandb_name=tiny")
check(r.returncode == 0 and "wandb_project: eo-ddp-test" in r.stderr, "a wandb_mode offline run exits 0 and says W&B logs it")
files = glob.glob(os.path.join(out, "wandb", "offline-run-*", "run-*.wandb"))
check(len(files) == 1, f"one wandb run folder under output_dir/wandb/ {files}")
if files:
    history = wandb_history(files[0])
    rows = metrics(out)
    got = [{k: v for k, v in h.items() if not k.startswith("_")} for h in history]
    steps = [h.get("_step") for h in history]
    check(steps == [row["step"] for row in rows], f"W&B history steps {steps} are metrics.jsonl's")
    check(got == rows, f"W&B history equals metrics.jsonl ({len(got)} rows); first difference "
          f"{next(((a, b) for a, b in zip(got, rows) if a != b), None)}")

# ---- 3. a wandb that fails or hangs changes nothing
fake = os.path.join(WORK, "fake")
for kind, body in (("raises", "def init(**kw):\n    raise RuntimeError('wandb stand-in: init fails')\n"),
                   ("hangs", "import time\nclass Run:\n    def log(self, *a, **k):\n        time.sleep(10 ** 6)\n"
                             "    def finish(self):\n        pass\ndef init(**kw):\n    return Run()\n")):
    os.makedirs(os.path.join(fake, kind, "wandb"))
    open(os.path.join(fake, kind, "wandb", "__init__.py"), "w").write(body)
plain, r0, _ = train("plain")
adapter = open(os.path.join(plain, "adapter_model.safetensors"), "rb").read()
for kind, said in (("raises", "the W&B logger failed"), ("hangs", "did not finish")):
    out, r, took = train(kind, "wandb_project=eo-ddp-test", "wandb_mode=offline",
                         extra_env={"PYTHONPATH": os.path.join(fake, kind)})
    check(r.returncode == 0, f"a wandb that {kind}: training exits 0 ({took:.0f} s)")
    check(r.stderr.count(said) == 1, f"and says once '{said}'")
    same = open(os.path.join(out, "adapter_model.safetensors"), "rb").read() == adapter
    check(same, f"and the adapter is bitwise the adapter of a run without a tracker")

print(f"{len(failures)} failed")
sys.exit(1 if failures else 0)
