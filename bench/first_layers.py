#!/usr/bin/env python3
"""A model folder of a shape's first N decoder layers: its config.json with num_hidden_layers N, every
per-layer list (layer_types, Llama 4's no_rope_layers, ...) cut to N, and every list of layer indices
(Llama 4's moe_layers) left with the indices below N. Multimodal wrappers
(Gemma 4, Llama 4, Mistral 3, Qwen3.5) keep the decoder's shape in text_config, which is cut instead.
For runs on synthetic weights of a shape that does not fit the machine whole.

usage: first_layers.py SOURCE_MODEL_DIR DEST_DIR N
"""
import json
import os
import sys


def main() -> None:
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    src, dst, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with open(os.path.join(src, "config.json")) as f:
        c = json.load(f)
    text = c.get("text_config")
    t = text if isinstance(text, dict) and "num_hidden_layers" in text else c
    total = t["num_hidden_layers"]
    if not 0 < n <= total:
        sys.exit(f"first_layers.py: {n} layers asked of a model of {total}")
    t["num_hidden_layers"] = n
    for k, v in list(t.items()):
        if not isinstance(v, list):
            continue
        if len(v) == total:
            t[k] = v[:n]
        elif k.endswith("_layers") and all(isinstance(i, int) and 0 <= i < total for i in v):
            t[k] = [i for i in v if i < n]
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(c, f, indent=2)


if __name__ == "__main__":
    main()
