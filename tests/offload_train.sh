#!/usr/bin/env bash
# Offloaded training on the CPU build (the same state machine as on a GPU, slots in host memory):
#  1. offload (prefetch off, depth 1 and depth 2) gives bitwise the losses and adapter of resident
#     training;
#  2. every block is staged once in forward and once in backward per step (stage_calls 2N-1: the top
#     block's forward and backward are one run of uses), and the copies per step are exactly
#     2N-1 (one slot) or 2N-2 on the first step and 2N-4 after (two slots keep one more block at the
#     turn and at the start of the next step); in general S = 1 + depth slots keep S blocks across
#     each turn: 2N-S, then 2N-2S (S <= N);
#  3. pageable homes work and warn; offload on a model without expert blocks is a clear error.
# usage: offload_train.sh BUILD_DIR SOURCE_DIR PYTHON
set -uo pipefail
source "$2/tests/testlib.sh"
eo_test_setup "$@"
common=(--config configs/tiny-qwen3-moe.yaml --set max_steps=5 --set save_steps=0 --set lora_dropout=0.1
        --set 'lora_target_modules=[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]')
run() {  # name [extra --set ...]
  local name=$1
  shift
  timeout 300 "$bin" "${common[@]}" --set output_dir="$tmp/$name" "$@" >"$tmp/$name.log" 2>&1 || { echo "run $name failed"; tail -5 "$tmp/$name.log"; fail=1; }
}
run resident
run sync --set expert_offload=true --set expert_offload_prefetch=false
run prefetch --set expert_offload=true
run depth2 --set expert_offload=true --set expert_offload_prefetch_depth=2
check "offload (synchronous) == resident, bitwise" "$py" tests/ref/compare_adapters.py "$tmp/resident" "$tmp/sync" --exact
check "offload (prefetch) == resident, bitwise" "$py" tests/ref/compare_adapters.py "$tmp/resident" "$tmp/prefetch" --exact
check "offload (prefetch depth 2) == resident, bitwise" "$py" tests/ref/compare_adapters.py "$tmp/resident" "$tmp/depth2" --exact

# The tiny model has 4 MoE blocks (N = 4).
counts() { "$py" -c "
import json, sys
rows = [json.loads(l) for l in open('$1/metrics.jsonl')]
print(' '.join(f\"{r['stage_calls']}/{r['stagings']}/{r['staged_bytes']}\" for r in rows))"; }
sync_counts=$(counts "$tmp/sync")
pre_counts=$(counts "$tmp/prefetch")
echo "stage_calls/copies/bytes per step: sync [$sync_counts] prefetch [$pre_counts]"
block=$(( $(echo "$sync_counts" | cut -d' ' -f1 | cut -d/ -f3) / 7 ))
check "sync: 7 stage calls and 7 copies (2N-1) on step 1" test "$(echo "$sync_counts" | cut -d' ' -f1)" = "7/7/$((7 * block))"
check "sync: 6 copies (2N-2) on later steps" test "$(echo "$sync_counts" | cut -d' ' -f2)" = "7/6/$((6 * block))"
check "prefetch: 6 copies (2N-2) on step 1" test "$(echo "$pre_counts" | cut -d' ' -f1)" = "7/6/$((6 * block))"
check "prefetch: 4 copies (2N-4) on later steps" test "$(echo "$pre_counts" | cut -d' ' -f5)" = "7/4/$((4 * block))"
depth2_counts=$(counts "$tmp/depth2")
echo "prefetch depth 2 (3 slots): [$depth2_counts]"
check "depth 2: 5 copies (2N-3) on step 1" test "$(echo "$depth2_counts" | cut -d' ' -f1)" = "7/5/$((5 * block))"
later="7/2/$((2 * block))"
check "depth 2: 2 copies (2N-6) on each later step" test "$(echo "$depth2_counts" | cut -d' ' -f2-)" = "$later $later $later $later"
check "depth 2: the log says 3 slots" grep -q "3 device slot(s) of .* (prefetch 2 ahead)" "$tmp/depth2.log"

# lora_target_parameters (fused expert LoRA, no dropout as peft requires): offload == resident too.
fused=(--set lora_dropout=0 --set 'lora_target_modules=[q_proj, k_proj, v_proj, o_proj]'
       --set 'lora_target_parameters=[mlp.experts.gate_up_proj, mlp.experts.down_proj]')
run fused_resident "${fused[@]}"
run fused_prefetch "${fused[@]}" --set expert_offload=true
check "fused expert LoRA: offload (prefetch) == resident, bitwise" "$py" tests/ref/compare_adapters.py "$tmp/fused_resident" "$tmp/fused_prefetch" --exact
check "fused expert LoRA is in the adapter" grep -q "experts.base_layer.lora_A" "$tmp/fused_prefetch/adapter_model.safetensors"

run pageable --set expert_offload=true --set expert_offload_pin_memory=false
check "pageable homes warn" grep -q "expert_offload_pin_memory: false gives pageable homes" "$tmp/pageable.log"
check "pageable homes train like pinned" "$py" tests/ref/compare_adapters.py "$tmp/resident" "$tmp/pageable" --exact

# A Qwen3-MoE checkpoint whose layers are all dense (mlp_only_layers) has nothing to offload.
mkdir -p "$tmp/dense"
"$py" - "$tmp/dense" <<'PY'
import json, sys, torch, transformers
cfg = transformers.Qwen3MoeConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  num_key_value_heads=1, head_dim=16, intermediate_size=64, moe_intermediate_size=16,
                                  num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0, 1])
transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(sys.argv[1], safe_serialization=True)
PY
timeout 120 "$bin" "${common[@]}" --set base_model="$tmp/dense" --set expert_offload=true --set output_dir="$tmp/dense_out" >"$tmp/dense.log" 2>&1
rc=$?
check "offload without expert blocks exits 2" test $rc = 2
check "and says what was looked for" grep -q "has no MoE expert blocks" "$tmp/dense.log"
timeout 120 "$bin" "${common[@]}" "${fused[@]}" --set base_model="$tmp/dense" --set output_dir="$tmp/dense_fused" >"$tmp/dense_fused.log" 2>&1
rc=$?
check "lora_target_parameters without expert blocks exits 2" test $rc = 2
check "and names the key" grep -q "lora_target_parameters: qwen3_moe .* has no MoE block" "$tmp/dense_fused.log"
[ $fail = 0 ] && echo "offload_train: all checks passed" || { echo "offload_train: FAILED"; for f in "$tmp"/*.log; do echo "== $f"; tail -3 "$f"; done; }
exit $fail
