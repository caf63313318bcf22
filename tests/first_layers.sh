#!/usr/bin/env bash
# bench/first_layers.py (the benchmarks' shapes cut to their first N layers, for synthetic-weight runs
# on a machine that cannot hold the whole model): every shipped shape cut to 4 layers is a model eo-ddp
# plans, with its per-layer lists cut and its layer-index lists (Llama 4's moe_layers) kept below 4;
# more layers than the model has is refused.
# usage: first_layers.sh BUILD_DIR SOURCE_DIR PYTHON
set -uo pipefail
source "$2/tests/testlib.sh"
eo_test_setup "$@"
touch "$tmp/tokens.u32"
for dir in configs/models/*/; do
  m=$(basename "$dir")
  check "$m: cut to 4 layers" "$py" bench/first_layers.py "$dir" "$tmp/$m" 4
  check "$m: eo-ddp plans it" "$bin" plan --config configs/bench/qwen3-30b-a3b-offload.yaml \
    --set base_model="$tmp/$m" --set datasets.0.path="$tmp/tokens.u32"
done
lists() { "$py" - "$1" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
t = c["text_config"]
assert t["num_hidden_layers"] == 4 and len(t["no_rope_layers"]) == 4, t
assert t["moe_layers"] and all(i < 4 for i in t["moe_layers"]), t["moe_layers"]
PY
}
check "llama-4-maverick: no_rope_layers cut, moe_layers below 4" lists "$tmp/llama-4-maverick-17b-128e/config.json"
check "more layers than the model has: refused" bash -c "! '$py' bench/first_layers.py configs/models/olmoe-1b-7b '$tmp/x' 1000"
[ $fail = 0 ] && echo "first_layers: all checks passed" || echo "first_layers: FAILED"
exit $fail
