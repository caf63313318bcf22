"""The life of a reference-fixture folder OUT/ARCH, shared by the tests/ref/*_ref.py scripts.

begin() exits early when OUT/ARCH/ref.safetensors is newer than the generating scripts; otherwise it
returns a fresh temporary folder. finish() writes ref.safetensors there and swaps the folder into
place, so tests reading the previous fixtures never see a half-written one.
"""
import json
import os
import shutil
import sys

from safetensors.torch import save_file


def begin(out_root, arch, *sources):
    final = os.path.join(out_root, arch)
    marker = os.path.join(final, "ref.safetensors")
    if os.path.exists(marker) and os.path.getmtime(marker) > max(os.path.getmtime(s) for s in sources):
        print(json.dumps({"arch": arch, "out": final, "up_to_date": True}))
        sys.exit(0)
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    return tmp


def finish(tmp, ref):
    final = tmp[: -len(".tmp")]
    save_file({k: v.contiguous() for k, v in ref.items()}, os.path.join(tmp, "ref.safetensors"), metadata={"format": "pt"})
    old = final + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(final):
        os.rename(final, old)
    os.rename(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    print(json.dumps({"out": final, "tensors": len(ref)}))
