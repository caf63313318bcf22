#!/usr/bin/env python3
"""A float checkpoint quantised to NVIDIA modelopt's NVFP4 checkpoint format (tiny fixtures).

    make_nvfp4_model.py SRC_DIR OUT_DIR

SRC_DIR: a float checkpoint (one model.safetensors, per-expert expert tensors, as
tools/make_tiny_model.py writes). OUT_DIR gets what modelopt's export (NVFP4_DEFAULT_CFG,
export_hf_checkpoint) writes for a Qwen3-MoE model such as nvidia/Qwen3-30B-A3B-NVFP4:

  every decoder-block linear (`model.layers.*.*_proj`: attention, dense MLP, every expert) as
    P.weight          uint8 [out, in / 2]   FP4 E2M1 codes, element 2j in the low nibble of byte j
    P.weight_scale    float8_e4m3fn [out, in / 16]
    P.weight_scale_2  float32 []            the global scale
    P.input_scale     float32 []            the activation scale (W4A4 inference; eo-ddp reads none)
  lm_head, the routers (mlp.gate), embeddings and norms unchanged;
  config.json with modelopt's quantization_config, and hf_quant_config.json.

The encoding is modelopt's NVFP4QTensor.quantize: global = amax(|W|) / (6 * 448), shared by the
linears an inference engine fuses (q/k/v, gate/up: modelopt's export takes their maximum); per 16
values scale = amax / (6 * global) rounded to E4M3; codes = the nearest E2M1 value of
W / (scale * global) (ties to the even code), the sign kept (negative values that round to 0 are -0).
The decode that tests check eo-ddp against is tests/ref/nvfp4_ref.py's, not this file.

A few blocks of layer 1's expert 0 gate projection are scaled down first, so that the fixture holds
E4M3 subnormal scale bytes and an all-zero block (scale 0) beside the ordinary ones.
"""
import json
import os
import re
import shutil
import sys

import torch
from safetensors.torch import load_file, save_file

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
FUSED = [("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")]


def encode_e2m1(x):
    """Nearest E2M1 code of each float64 value (|x| <= 6 after scaling), ties to the even code."""
    a = x.abs().clamp(max=6.0)
    bounds = (E2M1[1:] + E2M1[:-1]) / 2  # 0.25, 0.75, ..., 5
    idx = torch.bucketize(a, bounds, right=False)  # a on a midpoint: the lower neighbour
    tie_to_odd = (idx < 7) & (a == bounds[idx.clamp(max=6)]) & (idx % 2 == 1)
    idx = idx + tie_to_odd.to(idx.dtype)
    return idx.to(torch.uint8) | (torch.signbit(x).to(torch.uint8) << 3)


def quantize(w, global_scale):
    """w [out, in] float → (codes uint8 [out, in/2], scales float8_e4m3fn [out, in/16])."""
    out, inn = w.shape
    assert inn % 16 == 0, w.shape
    blocks = w.double().reshape(out, inn // 16, 16)
    amax = blocks.abs().amax(-1)
    scale = (amax / (6.0 * global_scale)).clamp(max=448.0).to(torch.float32).to(torch.float8_e4m3fn)
    denom = scale.to(torch.float64) * global_scale
    q = torch.where(denom.unsqueeze(-1) > 0, blocks / denom.unsqueeze(-1).clamp(min=1e-300), torch.zeros_like(blocks))
    codes = encode_e2m1(q).reshape(out, inn)
    return codes[:, 0::2] | (codes[:, 1::2] << 4), scale


def fused_group(name):
    """The names whose weights share a global scale with `name` (modelopt's export fuses them)."""
    for group in FUSED:
        for n in group:
            if name.endswith("." + n + ".weight"):
                base = name[: -len(n + ".weight")]
                return [base + m + ".weight" for m in group]
    return [name]


def main(src, out):
    sd = load_file(os.path.join(src, "model.safetensors"))
    edge = "model.layers.1.mlp.experts.0.gate_proj.weight"
    if edge in sd:  # subnormal E4M3 scales and a zero block (see the docstring)
        w = sd[edge].clone()
        w[0, 0:16] = 0.0
        w[0, 16:32] *= 3e-5
        w[1, 0:16] *= 1e-5
        sd[edge] = w
    linear = re.compile(r"^model\.layers\.\d+\..*_proj\.weight$")
    names = sorted(n for n in sd if linear.match(n))
    globals_ = {}
    for n in names:
        if n in globals_:
            continue
        group = [m for m in fused_group(n) if m in sd]
        g = max(float(sd[m].abs().max()) for m in group) / (6.0 * 448.0)
        g = float(torch.tensor(g, dtype=torch.float32))  # stored as float32
        for m in group:
            globals_[m] = g
    res = {}
    for n, t in sd.items():
        if n not in globals_:
            res[n] = t
            continue
        p = n[: -len(".weight")]
        codes, scales = quantize(t, globals_[n])
        res[p + ".weight"] = codes
        res[p + ".weight_scale"] = scales
        res[p + ".weight_scale_2"] = torch.tensor(globals_[n], dtype=torch.float32)
        res[p + ".input_scale"] = torch.tensor(1.0 / 448.0, dtype=torch.float32)
    os.makedirs(out, exist_ok=True)
    save_file(res, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    for f in os.listdir(src):
        if f not in ("model.safetensors", "config.json") and os.path.isfile(os.path.join(src, f)):
            shutil.copyfile(os.path.join(src, f), os.path.join(out, f))
    cfg = json.load(open(os.path.join(src, "config.json")))
    exclude = ["lm_head", "model.layers.*.mlp.gate"]
    cfg["quantization_config"] = {
        "quant_method": "modelopt", "quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
        "exclude_modules": exclude, "producer": {"name": "modelopt", "version": "0.35.0"}}
    json.dump(cfg, open(os.path.join(out, "config.json"), "w"), indent=2)
    json.dump({"producer": {"name": "modelopt", "version": "0.35.0"},
               "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                                "exclude_modules": exclude}},
              open(os.path.join(out, "hf_quant_config.json"), "w"), indent=2)
    print(json.dumps({"out": out, "nvfp4_linears": len(globals_)}))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
