#!/usr/bin/env python3
"""Writes the seed corpus in fuzz/corpus/<harness>/: a few small valid and near-valid inputs per
harness (Python standard library only, independent of eo-ddp's writers). Run again after editing;
files are named by content so re-running is idempotent. Reproducers of fixed bugs live in
fuzz/regressions/<harness>/ and are added to the corpus by scripts/fuzz."""
import hashlib
import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def put(harness, name, data):
    if isinstance(data, str):
        data = data.encode()
    d = os.path.join(HERE, "corpus", harness)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, f"{name}-{hashlib.sha1(data).hexdigest()[:8]}"), "wb") as f:
        f.write(data)


def safetensors(tensors, metadata=None, pad=True):
    """tensors: list of (name, dtype, shape, bytes), laid out in order."""
    header, blobs, off = {}, b"", 0
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(data)]}
        off += len(data)
        blobs += data
    text = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        text += b" " * ((8 - len(text) % 8) % 8)
    return struct.pack("<Q", len(text)) + text + blobs


# --- safetensors -------------------------------------------------------------------------------
st = "safetensors"
f32 = struct.pack("<4f", 1, 2, 3, 4)
put(st, "valid_f32", safetensors([("w", "F32", [2, 2], f32)], {"format": "pt"}))
put(st, "valid_mixed", safetensors([("a", "I64", [1], struct.pack("<q", -5)), ("b", "BF16", [3], b"\x80\x3f" * 3),
                                    ("m", "BOOL", [2], b"\x00\x01"), ("e", "U8", [0], b"")]))
put(st, "valid_empty", safetensors([]))
put(st, "valid_unpadded", safetensors([("x", "F16", [1, 2], b"\x00\x3c\x00\x40")], pad=False))
put(st, "bad_bool", safetensors([("m", "BOOL", [2], b"\x00\x02")]))
put(st, "truncated", safetensors([("w", "F32", [2, 2], f32)])[:-3])
put(st, "hole", struct.pack("<Q", 60) + b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}     ' + b"\0" * 8)
put(st, "zero_dim_huge", safetensors([("z", "F32", [0, 4611686018427387904, 8], b"")]))
put(st, "dup_key", struct.pack("<Q", 2 * 51 + 3) + b'{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
    b'"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}' + b"\x07")

# --- safetensors_index (shards a, b in model-00001-of-00002, c in model-00002-of-00002) --------
ix = "safetensors_index"
s1, s2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
put(ix, "valid", json.dumps({"metadata": {"total_size": 30}, "weight_map": {"a": s1, "b": s1, "c": s2}}))
put(ix, "missing_tensor", json.dumps({"weight_map": {"a": s1, "b": s1}}))
put(ix, "wrong_shard", json.dumps({"weight_map": {"a": s2, "b": s1, "c": s2}}))
put(ix, "absent_name", json.dumps({"weight_map": {"a": s1, "b": s1, "c": s2, "d": s2}}))
put(ix, "traversal", json.dumps({"weight_map": {"a": "../" + s1}}))
put(ix, "broken_shard", json.dumps({"weight_map": {"a": s1, "b": s1, "c": s2, "x": "broken.safetensors"}}))
put(ix, "folder_shard", json.dumps({"weight_map": {"x": "subfolder.safetensors"}}))
put(ix, "not_object", '["weight_map"]')

# --- hf_config ---------------------------------------------------------------------------------
hc = "hf_config"
qwen3 = {"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
         "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "intermediate_size": 96,
         "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [1], "tie_word_embeddings": False}
put(hc, "qwen3_moe", json.dumps(qwen3))
put(hc, "olmoe", json.dumps({"model_type": "olmoe", "hidden_size": 64, "num_hidden_layers": 2,
                             "num_attention_heads": 4, "vocab_size": 128, "rope_theta": 1e4, "num_experts": 8,
                             "num_experts_per_tok": 2, "intermediate_size": 32, "clip_qkv": None}))
put(hc, "mixtral_v5", json.dumps({"model_type": "mixtral", "hidden_size": 64, "num_hidden_layers": 1,
                                  "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 50,
                                  "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
                                  "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 16,
                                  "router_jitter_noise": 0.0}))
put(hc, "qwen2_moe", json.dumps({"model_type": "qwen2_moe", "hidden_size": 32, "num_hidden_layers": 4,
                                 "num_attention_heads": 2, "vocab_size": 64, "rope_theta": 1e6, "num_experts": 4,
                                 "num_experts_per_tok": 1, "moe_intermediate_size": 8, "intermediate_size": 16,
                                 "shared_expert_intermediate_size": 16, "decoder_sparse_step": 2}))
# The newer families (issue #19): the real shapes, Hub spelling (rope_scaling, partial_rotary_factor).
for name in ("deepseek-v2-lite", "glm-4.5-air", "gpt-oss-20b"):
    with open(os.path.join(HERE, "..", "configs", "models", name, "config.json")) as f:
        put(hc, name.replace(".", "_"), f.read())
put(hc, "huge_layers", json.dumps(dict(qwen3, num_hidden_layers=4000000000, mlp_only_layers=[])))
put(hc, "float_field", json.dumps(dict(qwen3, hidden_size=64.0)))
put(hc, "bad_type", json.dumps(dict(qwen3, model_type="llama")))

# --- train_config (YAML; NUL-separated --set overrides after the text) --------------------------
tc = "train_config"
base = """base_model: ./tiny
load_in_4bit: true
adapter: qlora
lora_r: 8
lora_alpha: 16
lora_target_modules: [q_proj, v_proj, gate_proj]
datasets:
  - path: train.jsonl
    type: tokenized
  - path: train.bin
    type: tokens
    dtype: uint16
    eos_token_id: 2
sequence_len: 128
micro_batch_size: 2
learning_rate: 2e-4
lr_scheduler: cosine
gradient_checkpointing: true
gradient_checkpointing_kwargs:
  use_reentrant: false
expert_offload: true
bf16: auto
"""
put(tc, "valid", base)
put(tc, "valid_overrides", base + "\0learning_rate=1e-4\0datasets.0.path=other.jsonl\0lora_target_modules=[w1, w2]")
put(tc, "axolotl_ignored", "base_model: m\nadapter: lora\ndatasets: [{path: d.jsonl}]\nwandb_project: x\nstrict: false\n"
    "val_set_size: 0.05\nfsdp: null\n")
put(tc, "unknown_keys", "base_modle: m\nadapter: qlorra\nlora_r: 1.5\ndatasets: {path: x}\nfp16: true\n")
put(tc, "aliases", "a: &a {x: 1, y: 2}\nb: &b {p: *a, q: *a}\nc: {p: *b, q: *b}\n")
put(tc, "not_a_map", "- just\n- a list\n")

# --- jsonl -------------------------------------------------------------------------------------
jl = "jsonl"
put(jl, "valid", '{"input_ids": [1, 2, 3], "labels": [-100, 2, 3], "attention_mask": [1, 1, 1]}\n\n'
    '{"input_ids": [5, 6]}\n')
put(jl, "nulls", '{"input_ids": [7], "labels": null, "attention_mask": null}\r\n')
put(jl, "mismatch", '{"input_ids": [1, 2], "labels": [1]}\n')
put(jl, "bad_values", '{"input_ids": [1, 2.5, 18446744073709551615, -1]}\n')
put(jl, "not_object", '[1, 2, 3]\n{"input_ids": []}\n')

# --- tokens (8-byte options prefix, then the file; see fuzz_tokens.cpp) --------------------------
tk = "tokens"
def tok_opts(u32=False, eos=None, chunk=4, vocab=None):
    flags = (1 if u32 else 0) | (2 if eos is not None else 0) | (4 if vocab is not None else 0)
    return struct.pack("<BHBHH", flags, eos or 0, chunk, vocab or 0, 0)
put(tk, "u16_eos", tok_opts(eos=2, vocab=100) + struct.pack("<7H", 5, 6, 2, 7, 2, 8, 9))
put(tk, "u16_chunks", tok_opts(chunk=3) + struct.pack("<8H", *range(8)))
put(tk, "u32_eos", tok_opts(u32=True, eos=0) + struct.pack("<5I", 0, 1, 0, 0, 70000))
put(tk, "out_of_vocab", tok_opts(vocab=10) + struct.pack("<3H", 1, 10, 2))
put(tk, "partial_token", tok_opts(u32=True) + b"\x01\x02\x03\x04\x05")
put(tk, "zero_chunk", tok_opts(chunk=0) + b"\x01\x00")

# --- nf4_bnb (flags byte, then the quant-state JSON; see fuzz_nf4_bnb.cpp) -----------------------
nb = "nf4_bnb"
qs = {"quant_type": "nf4", "blocksize": 64, "dtype": "bfloat16", "shape": [8, 16]}
nested = dict(qs, nested_blocksize=256, nested_dtype="float32", nested_offset=0.03125)
put(nb, "valid", b"\x00" + json.dumps(qs).encode())
put(nb, "valid_nested", b"\x00" + json.dumps(nested).encode())
put(nb, "odd_numel", b"\x00" + json.dumps(dict(qs, shape=[3, 5], blocksize=32)).encode())
put(nb, "fp4", b"\x00" + json.dumps(dict(qs, quant_type="fp4")).encode())
put(nb, "bad_absmax", b"\x04" + json.dumps(qs).encode())
put(nb, "missing_nested", b"\x08" + json.dumps(nested).encode())
put(nb, "float_blocksize", b"\x00" + json.dumps(dict(qs, blocksize=1e30)).encode())
put(nb, "huge_offset", b"\x00" + json.dumps(dict(nested, nested_offset=1e300)).encode())
put(nb, "unknown_key", b"\x00" + json.dumps(dict(qs, packed=True)).encode())

# --- disk_homes (mode byte, then the file or the header JSON; see fuzz_disk_homes.cpp) ----------
dh = "disk_homes"
# The expected header of the harness: layers 0 (100 bytes) and 2 (5000 bytes) after a 4096-byte
# header region, each block padded to 4096.
blocks = [[0, 4096, 100, "0x0000000000001234"], [2, 8192, 5000, "0x000000000000abcd"]]
ident = {"base_model": "/m", "bnb_4bit_blocksize": "64"}
header = {"blocks": blocks, "file_bytes": 12288, "identity": ident}
put(dh, "valid", b"\x03" + json.dumps(header, separators=(",", ":")).encode())
put(dh, "unpadded", b"\x01" + json.dumps(header, separators=(",", ":")).encode())
put(dh, "other_identity", b"\x03" + json.dumps(dict(header, identity=dict(ident, bnb_4bit_blocksize="128"))).encode())
put(dh, "other_layout", b"\x03" + json.dumps(dict(header, blocks=blocks[:1])).encode())
put(dh, "bad_checksum", b"\x03" + json.dumps(dict(header, blocks=[blocks[0], [2, 8192, 5000, "zz"]])).encode())
put(dh, "wrong_types", b"\x03" + json.dumps(dict(header, blocks=[[0, "a", None, 1]])).encode())
put(dh, "raw_magic_only", b"\x00EODDPHOM" + bytes(40))
