#!/usr/bin/env python3
"""tools/make_tiny_model.py through the test-reference cache.

usage: tiny_model.py MAKE_TINY_MODEL_ARGS... --out OUT

A tiny checkpoint is a pure function of the tool, its arguments and the reference stack, so it is
cached as the reference fixtures are (fixture_dir's key: the tool, what it imports, fixtures/; the same EO_TEST_REF_CACHE;
"off" runs the tool every time). Tests that make the same one (per family, in the normal and the ASan
phase, in every CI run) copy it instead of paying ~4 CPU seconds of torch and transformers imports.
"""
import os
import shutil
import subprocess
import sys

import fixture_dir

TOOL = os.path.join(fixture_dir.SOURCE, "tools", "make_tiny_model.py")


def main(argv):
    if "--out" not in argv or argv.index("--out") + 1 >= len(argv):
        sys.exit("tiny_model.py: --out OUT is required (the folder to write the tiny checkpoint to)")
    i = argv.index("--out")
    out, args = argv[i + 1], argv[:i] + argv[i + 2:]
    root = fixture_dir._cache_root()
    if not root:
        return subprocess.call([sys.executable, TOOL, *argv])
    # Keyed as a fixture is, by the tool and what it imports: an edit to a test script keeps the entries.
    entry = os.path.join(root, "tiny-model-" + fixture_dir._inputs_key("\0".join(args), [TOOL]))
    if not os.path.isdir(entry):
        os.makedirs(root, exist_ok=True)
        part = f"{entry}.part{os.getpid()}"
        rc = subprocess.call([sys.executable, TOOL, *args, "--out", part])
        if rc != 0:
            shutil.rmtree(part, ignore_errors=True)
            return rc
        try:
            os.rename(part, entry)  # a reader never sees half an entry; a racing writer's copy is as good
        except OSError:
            shutil.rmtree(part, ignore_errors=True)
    else:
        os.utime(entry)  # in use: kept by fixture_dir's pruning
    shutil.copytree(entry, out, symlinks=True, dirs_exist_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
