"""The life of a reference-fixture folder OUT/ARCH, shared by the tests/ref/*_ref.py scripts.

begin() exits early when OUT/ARCH/ref.safetensors is newer than the generating scripts; otherwise it
returns a fresh temporary folder. finish() writes ref.safetensors there and swaps the folder into
place, so tests reading the previous fixtures never see a half-written one.

A fixture is a pure function of its inputs: the sources its script names to begin() (the script, the tools
it runs), the tests/ref and tools modules those import (found by reading their import lines), the fixtures
folder, the arguments and the reference stack's versions (torch, transformers, peft, bitsandbytes, ...).
Nothing else: a change to another test script or tool leaves these fixtures cached. begin() hashes all of
them and, when a fixture made from the same inputs is in
the cache (EO_TEST_REF_CACHE, default ~/.cache/eo-ddp/test-refs; "off" turns it off), copies that
one in instead of recomputing it: the expectations are still transformers' and peft's, as ccache's
objects are still the compiler's. A fresh clone (CI's) then skips the minutes the reference stack
takes on a small machine.
"""
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import sys
import time


HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.normpath(os.path.join(HERE, "..", ".."))
STACK = ("torch", "transformers", "peft", "bitsandbytes", "safetensors", "tokenizers", "numpy", "accelerate")
_cache_entry = None


def _cache_root():
    root = os.environ.get("EO_TEST_REF_CACHE", "")
    if root == "off":
        return None
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "eo-ddp", "test-refs")
    return root


_IMPORT = re.compile(r"^\s*(?:from\s+([A-Za-z_]\w*)|import\s+([A-Za-z_]\w*))", re.M)


def _local_inputs(sources):
    """The named sources and, transitively, the tests/ref and tools modules they import."""
    found, todo = set(), [os.path.abspath(s) for s in sources] + [os.path.abspath(__file__)]
    while todo:
        path = todo.pop()
        if path in found or not os.path.isfile(path):
            continue
        found.add(path)
        if path.endswith(".py"):
            with open(path, encoding="utf-8", errors="replace") as fh:
                for m in _IMPORT.finditer(fh.read()):
                    for folder in ("tests/ref", "tools"):
                        todo.append(os.path.join(SOURCE, folder, (m.group(1) or m.group(2)) + ".py"))
    return found


def _inputs_key(arch, sources):
    h = hashlib.sha256()
    h.update(f"{os.path.basename(sources[0])}\0{arch}\0{sys.version}\0".encode())
    for name in STACK:
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            version = "-"
        h.update(f"{name}={version}\0".encode())
    files = set(_local_inputs(sources))
    for dirpath, dirnames, names in os.walk(os.path.join(SOURCE, "fixtures")):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        files.update(os.path.join(dirpath, f) for f in names)
    for path in sorted(files, key=lambda p: os.path.relpath(p, SOURCE)):
        h.update(os.path.relpath(path, SOURCE).encode() + b"\0")
        with open(path, "rb") as fh:
            h.update(hashlib.sha256(fh.read()).digest())
    return h.hexdigest()[:32]


def _prune(root, days=14):
    """Entries unused for `days` go: every change to the scripts makes new ones."""
    cutoff = time.time() - days * 86400
    for name in os.listdir(root):
        path = os.path.join(root, name)
        try:
            if os.path.getmtime(path) < cutoff:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass


def _swap_in(tmp):
    final = tmp[: -len(".tmp")]
    old = final + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(final):
        os.rename(final, old)
    os.rename(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def begin(out_root, arch, *sources):
    global _cache_entry
    final = os.path.join(out_root, arch)
    marker = os.path.join(final, "ref.safetensors")
    if os.path.exists(marker) and os.path.getmtime(marker) > max(os.path.getmtime(s) for s in sources):
        print(json.dumps({"arch": arch, "out": final, "up_to_date": True}))
        sys.exit(0)
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    root = _cache_root()
    if root:
        _cache_entry = os.path.join(root, _inputs_key(arch, sources))
        if os.path.exists(os.path.join(_cache_entry, "ref.safetensors")):
            os.utime(_cache_entry)  # in use: kept by _prune
            shutil.copytree(_cache_entry, tmp, symlinks=True)
            print(json.dumps({"arch": arch, "out": _swap_in(tmp), "from_cache": _cache_entry}))
            sys.exit(0)
    os.makedirs(tmp)
    return tmp


def finish(tmp, ref):
    from safetensors.torch import save_file  # here: importing this module stays torch-free (tiny_model.py)

    save_file({k: v.contiguous() for k, v in ref.items()}, os.path.join(tmp, "ref.safetensors"), metadata={"format": "pt"})
    final = _swap_in(tmp)
    if _cache_entry and not os.path.exists(_cache_entry):
        # Copied under a private name, then renamed: a reader never sees half an entry.
        part = f"{_cache_entry}.part{os.getpid()}"
        try:
            shutil.copytree(final, part, symlinks=True)
            os.rename(part, _cache_entry)
        except OSError:
            shutil.rmtree(part, ignore_errors=True)
        _prune(os.path.dirname(_cache_entry))
    print(json.dumps({"out": final, "tensors": len(ref)}))
