#!/usr/bin/env bash
# The step's schedule end to end (eo-ddp binary, CPU fp32, tiny Qwen3-MoE, LoRA dropout on):
#  1. the layer-major order gives bitwise the losses and adapter of the micro-batch-major order for
#     gradient_accumulation_steps g = 1, 2, 4, with expert LoRA on (and, at g = 2, off), resident and
#     offloaded (one slot, prefetch depth 1 and 2), and with activation_offloading;
#  2. staged bytes per optimizer step never exceed 2 x the expert bytes, whatever g is (from
#     metrics.jsonl): every block is staged once in forward and once in backward per step.
# usage: schedule_train.sh BUILD_DIR SOURCE_DIR PYTHON
set -uo pipefail
source "$2/tests/testlib.sh"
eo_test_setup "$@"
experts='lora_target_modules=[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]'
run() {  # name g [extra --set ...]
  local name=$1 g=$2
  shift 2
  timeout 300 "$bin" --config configs/tiny-qwen3-moe.yaml --set max_steps=3 --set save_steps=0 --set lora_dropout=0.1 \
    --set micro_batch_size=1 --set gradient_accumulation_steps="$g" --set output_dir="$tmp/$name" "$@" \
    >"$tmp/$name.log" 2>&1 || { echo "run $name failed"; tail -5 "$tmp/$name.log"; fail=1; }
}
same() { check "$1 == $2, bitwise" "$py" tests/ref/compare_adapters.py "$tmp/$2" "$tmp/$1" --exact; }
offload=(--set expert_offload=true)
for g in 1 2 4; do
  run "mm$g" "$g" --set "$experts" --set step_order=micro_batch_major
  run "lm$g" "$g" --set "$experts"
  run "sync$g" "$g" --set "$experts" "${offload[@]}" --set expert_offload_prefetch=false
  run "d1_$g" "$g" --set "$experts" "${offload[@]}"
  run "d2_$g" "$g" --set "$experts" "${offload[@]}" --set expert_offload_prefetch_depth=2
  for r in "lm$g" "sync$g" "d1_$g" "d2_$g"; do same "$r" "mm$g"; done
  # Staged bytes per step <= 2 x expert bytes (4 MoE blocks of equal size); one slot copies 2N-1 blocks.
  check "g=$g: staged bytes per step <= 2 x expert bytes" "$py" - "$tmp/sync$g/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
block = rows[0]["staged_bytes"] / rows[0]["stagings"]
expert_bytes = 4 * block
assert len(rows) == 3, rows
for r in rows:
    assert r["staged_bytes"] <= 2 * expert_bytes, r
assert rows[0]["stagings"] == 7 and all(r["stagings"] == 6 for r in rows[1:]), [r["stagings"] for r in rows]
PY
done
run mm2_attn 2 --set step_order=micro_batch_major
run lm2_attn 2
same lm2_attn mm2_attn
run parked4 4 --set "$experts" "${offload[@]}" --set activation_offloading=true
same parked4 mm4
[ $fail = 0 ] && echo "schedule_train: all checks passed" || { echo "schedule_train: FAILED"; for f in "$tmp"/*.log; do echo "== $f"; tail -3 "$f"; done; }
exit $fail
