"""Reference side of test_safetensors: the Python `safetensors` package (and huggingface_hub's
sharded writer) write files for eo-ddp to read, and read the files eo-ddp writes.

A manifest JSON carries, for every tensor, its safetensors dtype, shape and the hex of its raw
bytes taken from the torch tensor itself (never from a file), so each side checks the other
against bytes the file parser under test never touched.

  write  OUT.safetensors MANIFEST.json   every dtype, written by safetensors.torch.save_file
  shard  FOLDER MANIFEST.json            a sharded checkpoint by huggingface_hub.save_torch_state_dict
  check  IN.safetensors MANIFEST.json    load eo-ddp's file with safetensors.torch.load_file
"""
import json
import os
import struct
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
    "U16": torch.uint16, "F16": torch.float16, "BF16": torch.bfloat16, "I32": torch.int32,
    "U32": torch.uint32, "F32": torch.float32, "F64": torch.float64, "I64": torch.int64,
    "U64": torch.uint64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
NAME_OF = {v: k for k, v in DTYPES.items()}


def raw_bytes(t):
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def random_tensor(dtype, shape, gen):
    """Every bit pattern is fair game (NaN, inf, -0, subnormals, integer extremes), except BOOL."""
    n = 1
    for d in shape:
        n *= d
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).to(torch.bool)
    size = torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=gen).view(dtype).reshape(shape)


def tensors_of_every_dtype(seed):
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i, (name, dtype) in enumerate(DTYPES.items()):
        out[f"model.layers.{i}.{name.lower()}.weight"] = random_tensor(dtype, (3, 5 + i), gen)
    out["scalar.f32"] = random_tensor(torch.float32, (), gen)
    out["empty.bf16"] = random_tensor(torch.bfloat16, (0, 4), gen)
    out["unicode.名前.ß"] = random_tensor(torch.int16, (2, 2, 2), gen)
    return out


def write_manifest(path, tensors, metadata=None):
    m = {name: {"dtype": NAME_OF[t.dtype], "shape": list(t.shape), "hex": raw_bytes(t).hex()}
         for name, t in tensors.items()}
    if metadata is not None:
        m["__metadata__"] = metadata
    with open(path, "w", encoding="utf-8") as f:
        json.dump(m, f, ensure_ascii=False)


def cmd_write(out, manifest):
    tensors = tensors_of_every_dtype(1234)
    metadata = {"format": "pt", "origin": "python safetensors"}
    save_file(tensors, out, metadata=metadata)
    write_manifest(manifest, tensors, metadata)


def cmd_shard(folder, manifest):
    from huggingface_hub import save_torch_state_dict
    gen = torch.Generator().manual_seed(99)
    tensors = {f"model.layers.{i}.mlp.experts.{j}.w{k}.weight": random_tensor(torch.bfloat16, (16, 32), gen)
               for i in range(3) for j in range(2) for k in (1, 2, 3)}
    tensors["model.embed_tokens.weight"] = random_tensor(torch.float32, (64, 8), gen)
    # 4 KB shards: many shards, the index names each tensor's file.
    os.makedirs(folder, exist_ok=True)
    save_torch_state_dict(tensors, folder, max_shard_size=4096)
    write_manifest(manifest, tensors)


def cmd_check(path, manifest_path):
    with open(manifest_path, encoding="utf-8") as f:
        want = json.load(f)
    want_meta = want.pop("__metadata__")
    # The header as written: 8-byte length, padded so data starts 8-aligned, valid JSON.
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = f.read(n)
    assert n % 8 == 0, f"header length {n} is not a multiple of 8"
    json.loads(header.decode("utf-8"))
    got = load_file(path)
    assert sorted(got) == sorted(want), f"names differ: {sorted(got)} vs {sorted(want)}"
    for name, w in want.items():
        t = got[name]
        assert NAME_OF[t.dtype] == w["dtype"], f"{name}: dtype {t.dtype} vs {w['dtype']}"
        assert list(t.shape) == w["shape"], f"{name}: shape {list(t.shape)} vs {w['shape']}"
        assert raw_bytes(t).hex() == w["hex"], f"{name}: bytes differ"
    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
    assert meta == want_meta, f"metadata {meta} vs {want_meta}"
    print(f"ok: {len(want)} tensors, metadata {meta}")


if __name__ == "__main__":
    cmd, a, b = sys.argv[1:4]
    {"write": cmd_write, "shard": cmd_shard, "check": cmd_check}[cmd](a, b)
