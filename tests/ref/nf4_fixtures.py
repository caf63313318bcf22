"""NF4 reference fixtures from bitsandbytes (CPU) for tests/test_nf4.cpp.

Usage: nf4_fixtures.py OUT.safetensors

For each case c<i>: the input weight x, bitsandbytes' packed bytes and absmax (and for double
quantisation the absmax codes, nested absmax and offset), the dequantised weight, and the module
state transformers saves (QuantState.as_dict(packed=True)) under the prefix c<i>.mod.
The metadata "cases" holds a JSON list of {name, blocksize, double_quant, dtype}.

Dequantisation reference: bitsandbytes' flat-index semantics (its pure-torch default kernel,
like its CUDA kernel). bnb 0.50.2's native CPU dequantize_4bit agrees whenever a row is a whole
number of blocks (asserted below); its AVX-512 path indexes absmax per row and is wrong otherwise.
"""
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fixture_dir  # noqa: E402


def cache_entry():
    """The file in the test-reference cache (fixture_dir.s key: this script and what it imports, the reference stack), or None."""
    root = fixture_dir._cache_root()
    if not root:
        return None
    return os.path.join(root, "nf4-fixtures-" + fixture_dir._inputs_key("nf4", [__file__]))


if __name__ == "__main__":
    # A cached copy skips torch and bitsandbytes altogether (the unit label runs this in the normal
    # and the ASan phase of every CI run).
    ENTRY = cache_entry()
    if ENTRY and os.path.exists(ENTRY):
        os.utime(ENTRY)  # in use: kept by fixture_dir's pruning
        shutil.copyfile(ENTRY, sys.argv[1])
        print(f"{sys.argv[1]}: from the cache ({ENTRY})")
        sys.exit(0)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import bitsandbytes.functional as F  # noqa: E402
from bitsandbytes.backends.default import ops as default_ops  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CODE = F.get_4bit_type("nf4", device="cpu")
MIDPOINTS = ((CODE[:-1] + CODE[1:]) / 2).numpy()


def tricky_values(rng, count, absmax):
    """Values whose scaled image hits NF4 midpoints/table values, for a block with this absmax."""
    am = np.float32(absmax)
    inv = np.float32(1) / am
    out = []
    for m in list(MIDPOINTS) + list(CODE.numpy()):
        x = np.float32(m * am)
        out += [x, -x, np.nextafter(x, np.float32(0)), np.nextafter(x, np.float32(np.inf))]
        # values where x / am and x * (1 / am) land on different sides of a midpoint
        for k in range(-3, 4):
            y = np.float32(x + k * np.spacing(x))
            if (np.float32(y / am) == m) != (np.float32(y * inv) == m):
                out.append(y)
    out = np.array(out, np.float32)
    out = out[np.abs(out) <= am]
    return rng.choice(out, count).astype(np.float32)


def make_weight(rng, shape, blocksize, kind, huge):
    n = shape[0] * shape[1]
    x = rng.standard_normal(n).astype(np.float32)
    if kind == "special":
        for b in range(0, n, blocksize):
            blk = slice(b, min(n, b + blocksize))
            size = blk.stop - blk.start
            choice = 2 if blk.stop == n else (b // blocksize) % 6  # last block: divide-vs-multiply cases
            if choice == 0:
                x[blk] = 0  # all-zero block
            elif choice == 1:  # power-of-two absmax: exact midpoints and table values
                x[blk] = tricky_values(rng, size, 2.0)
                x[blk.start] = 2.0
            elif choice == 2:  # odd absmax: multiply-vs-divide boundary cases
                am = np.float32(rng.uniform(0.01, 3))
                x[blk] = tricky_values(rng, size, am)
                x[blk.start] = -am
            elif choice == 3:
                x[blk] *= np.float32(huge)  # huge
            elif choice == 4:
                x[blk] = rng.choice(np.array([0, 1e-40, -1e-40, 3e-41], np.float32), size)  # subnormal
            else:
                x[blk] *= np.float32(1e-36)  # tiny
    return torch.from_numpy(x.reshape(shape))


def main(out_path):
    rng = np.random.default_rng(1234)
    tensors, cases = {}, []
    shapes = [(96, 200), (3, 5), (7, 64), (4, 48), (1, 1), (33, 97), (16, 256)]
    combos = []
    for shape in shapes:
        for bs in (32, 64, 128, 4096):
            for dt in DTYPES:
                combos.append((shape, bs, dt, False, "special" if (bs + len(combos)) % 2 else "randn"))
        for dt in DTYPES:
            combos.append((shape, 64, dt, True, "randn"))
            combos.append((shape, 32, dt, True, "special"))
    combos.append(((300, 512), 32, "float32", True, "randn"))  # > 256 absmax blocks: several nested blocks
    combos.append(((64, 4096), 64, "bfloat16", True, "randn"))

    for i, (shape, bs, dt, dq, kind) in enumerate(combos):
        name = f"c{i}"
        # huge but finite in the dtype, and (double quantisation) with a finite mean of absmax
        huge = 1e4 if dt == "float16" else (1e33 if dq else 1e37)
        x = make_weight(rng, shape, bs, kind, huge).to(DTYPES[dt])
        assert torch.isfinite(x).all()
        packed, state = F.quantize_4bit(x, blocksize=bs, quant_type="nf4", compress_statistics=dq)
        absmax = F.dequantize_blockwise(state.absmax, state.state2) + state.offset if dq else state.absmax
        ref = default_ops._dequantize_4bit_compute.__wrapped__(
            packed.reshape(-1), absmax.float(), CODE, bs, list(shape), DTYPES[dt])
        native = F.dequantize_4bit(packed, state)
        if shape[1] % bs == 0:
            assert torch.equal(native, ref), f"bnb CPU dequantize_4bit disagrees with its reference on {name}"
        tensors[f"{name}.x"] = x
        tensors[f"{name}.packed"] = packed
        tensors[f"{name}.deq"] = ref
        if dq:
            tensors[f"{name}.absmax_codes"] = state.absmax
            tensors[f"{name}.nested_absmax"] = state.state2.absmax
            tensors[f"{name}.offset"] = state.offset.reshape(1).float()
            tensors[f"{name}.absmax_fp32"] = absmax.float()
        else:
            tensors[f"{name}.absmax"] = state.absmax
        for key, value in state.as_dict(packed=True).items():
            tensors[f"{name}.mod.weight.{key}"] = value
        tensors[f"{name}.mod.weight"] = packed
        cases.append({"name": name, "blocksize": bs, "double_quant": dq, "dtype": dt})

    tensors = {k: v.contiguous().clone() for k, v in tensors.items()}
    save_file(tensors, out_path, metadata={"cases": json.dumps(cases)})
    print(f"wrote {len(cases)} cases to {out_path}")


if __name__ == "__main__":
    main(sys.argv[1])
    if ENTRY:  # copied under a private name, then renamed: a reader never sees half a file
        os.makedirs(os.path.dirname(ENTRY), exist_ok=True)
        shutil.copyfile(sys.argv[1], f"{ENTRY}.part{os.getpid()}")
        os.replace(f"{ENTRY}.part{os.getpid()}", ENTRY)
