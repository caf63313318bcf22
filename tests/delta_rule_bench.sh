#!/usr/bin/env bash
# The delta-rule benchmark's cross-check works (scripts/device-qwen35 compares fla's numbers with eo's
# through it): eo-delta-rule --dump writes eo's inputs, output and gradients, and bench/delta_rule_fla.py
# --check runs transformers' torch_chunk_gated_delta_rule on those inputs and finds eo's output and all
# five gradients to fp32 rounding (T 200, not a multiple of the chunk; two value heads per key head); a
# 1 % change to one of eo's gradients is reported as such. fla itself needs a GPU and is skipped here.
# usage: delta_rule_bench.sh BUILD_DIR SOURCE_DIR PYTHON
set -uo pipefail
source "$2/tests/testlib.sh"
eo_test_setup "$@"
shape=(--shape 2,4,16,16 --seq 200 --batches 1 --packed 0 --iters 1)
"$1/eo-delta-rule" "${shape[@]}" --dump "$tmp/dump" >"$tmp/eo.log" 2>&1 || { cat "$tmp/eo.log"; fail=1; }
"$py" bench/delta_rule_fla.py "${shape[@]}" --impls fla,torch --check "$tmp/dump" --json "$tmp/py.json" >"$tmp/py.log" 2>&1 ||
  { cat "$tmp/py.log"; fail=1; }
# errors BOUND_OUT BOUND_DQ: the torch row's check is below / above the bounds as named.
checked() { "$py" - "$tmp/py.json" "$@" <<'PY'
import json, sys
rows = [r for r in json.load(open(sys.argv[1])) if r.get("impl") == "torch" and "check" in r]
e = rows[0]["check"]
print(e)
ok = all(e[k] < 1e-5 for k in ("out", "dk", "dv", "dg", "dbeta"))
assert ok and (e["dq"] < 1e-5 if sys.argv[2] == "exact" else 5e-3 < e["dq"] < 2e-2), e
PY
}
check "torch path equals eo on eo's inputs (fp32)" checked exact
check "fla skipped without a GPU, and says so" grep -q "fla: skipped" "$tmp/py.log"
"$py" -c "import numpy as n, sys; p = sys.argv[1]; (n.fromfile(p, n.float32) * 1.01).astype(n.float32).tofile(p)" "$tmp/dump/dq.f32"
"$py" bench/delta_rule_fla.py "${shape[@]}" --impls torch --check "$tmp/dump" --json "$tmp/py.json" >"$tmp/py.log" 2>&1 || fail=1
check "a 1 % change to eo's dq is seen" checked changed
[ "$fail" = 0 ] && echo "delta_rule_bench: all checks passed"
exit "$fail"
