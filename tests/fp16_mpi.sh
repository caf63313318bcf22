#!/usr/bin/env bash
# fp16 data-parallel (CPU ranks, fp16 tensors): an overflow on one rank only (its loss scale made
# infinite at step 2 through the fault seam) is found by every rank from the all-reduced
# gradients, so both skip step 2 and halve the scale, and they end with bitwise identical LoRA
# (the trainer checks); 2 ranks x micro-batch 2 follow 1 rank x 4 with the same overflow.
# usage: fp16_mpi.sh BUILD_DIR SOURCE_DIR PYTHON
set -uo pipefail
source "$2/tests/testlib.sh"
eo_test_setup "$@"
faults_bin=$1/eo-ddp-faults
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
common=(--config configs/tiny-qwen3-moe.yaml --set max_steps=5 --set save_steps=0 --set lora_dropout=0
        --set warmup_steps=1 --set logging_steps=1 --set fp16=true --set bf16=false)
EO_DDP_FAULT_OVERFLOW=2 EO_DDP_FAULT_RANK=1 timeout 300 mpirun --oversubscribe --bind-to none -np 2 \
  "$faults_bin" "${common[@]}" --set micro_batch_size=2 --set output_dir="$tmp/two" >"$tmp/two.log" 2>&1
check "2 ranks, overflow on rank 1: exit 0" test $? = 0
check "LoRA identical on 2 ranks" grep -q "LoRA identical on all 2 ranks" "$tmp/two.log"
EO_DDP_FAULT_OVERFLOW=2 timeout 300 "$faults_bin" "${common[@]}" --set micro_batch_size=4 --set output_dir="$tmp/one" \
  >"$tmp/one.log" 2>&1
check "1 rank: exit 0" test $? = 0
check "step 2 skipped on the overflow, the scale halved, on 2 ranks as on 1" "$py" -c "
import json, sys
for d in ('$tmp/two', '$tmp/one'):
    m = {j['step']: j for j in map(json.loads, open(d + '/metrics.jsonl'))}
    print(d, [(s, m[s]['loss_scale'], m[s]['skipped_overflow'], m[s]['grad_norm']) for s in sorted(m)])
    ok = [m[s]['loss_scale'] for s in range(1, 6)] == [65536.0, 65536.0, 32768.0, 32768.0, 32768.0]
    ok = ok and m[2]['grad_norm'] is None and m[2]['skipped_overflow'] == 1 and m[5]['skipped_overflow'] == 1
    ok = ok and m[5]['skipped_nonfinite'] == 0
    if not ok: sys.exit(1)"
check "2x2 == 1x4 (fp16)" "$py" tests/ref/compare_adapters.py "$tmp/one" "$tmp/two" --rtol 2e-2 --loss-rtol 1e-2
[ $fail = 0 ] && echo "fp16_mpi: all checks passed" || { echo "fp16_mpi: FAILED"; for f in "$tmp"/*.log; do echo "== $f"; tail -8 "$f"; done; }
exit $fail
