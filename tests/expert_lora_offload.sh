#!/usr/bin/env bash
# The experts' LoRA state on the host (expert_lora_offload, runtime/expert_lora_offload.h) trains
# exactly as with that state on the device, on the CPU build (the same state machine: working
# copies staged with their block, gradients home, each block's AdamW when it is next staged):
#  1. 10 steps with clipping active (max_grad_norm below every step's norm): bitwise the same
#     losses, gradient norms, adapter and checkpoint (LoRA and AdamW state), 1 rank and 2 ranks;
#  2. a resume in the middle both ways (a device-state checkpoint resumed offloaded, and the
#     reverse) ends bitwise where the uninterrupted run ends;
#  3. micro-batch-major accumulation (a block leaves with part of its gradient and brings it
#     back): bitwise too; the per-expert form (lora_target_modules on the experts) too;
#  4. fp16 loss scaling with injected overflows: the same skips and adapter;
#  5. the log says where the state lives; across ranks metrics.jsonl has the host side's times.
# usage: expert_lora_offload.sh BUILD_DIR SOURCE_DIR PYTHON
set -uo pipefail
source "$2/tests/testlib.sh"
eo_test_setup "$@"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
common=(--config configs/tiny-qwen3-moe.yaml --set max_steps=10 --set save_steps=5 --set save_total_limit=5
        --set warmup_steps=2 --set lora_dropout=0 --set max_grad_norm=0.05 --set expert_offload=true
        --set 'lora_target_modules=[q_proj, k_proj, v_proj, o_proj]'
        --set 'lora_target_parameters=[mlp.experts.gate_up_proj, mlp.experts.down_proj]')
device=(--set expert_lora_offload=false)
# A resumed run: the same adapter, and its steps' losses and norms those of the uninterrupted run.
same_resumed() { "$py" - "$1" "$2" <<'PY'
import json, sys
from safetensors.torch import load_file
x, y = (load_file(f"{d}/adapter_model.safetensors") for d in sys.argv[1:])
assert x.keys() == y.keys() and all(x[k].equal(y[k]) for k in x)
a, b = ({r["step"]: (r["loss"], r["grad_norm"]) for r in map(json.loads, open(f"{d}/metrics.jsonl")) if "loss" in r}
        for d in sys.argv[1:])
assert sorted(b) == list(range(6, 11)) and all(a[s] == b[s] for s in b), (a, b)
PY
}
same_state() { "$py" - "$1" "$2" <<'PY'
import sys
from safetensors.torch import load_file
for f in ("optimizer.safetensors", "adapter_model.safetensors"):
    x, y = (load_file(f"{d}/{f}") for d in sys.argv[1:])
    assert x.keys() == y.keys() and x, f
    assert all(x[k].equal(y[k]) for k in x), f
PY
}

for ranks in 1 2; do
  run "device$ranks" $ranks "${device[@]}"
  run "host$ranks" $ranks
  check "$ranks rank(s): offloaded == on the device, adapter bitwise" same "$tmp/device$ranks" "$tmp/host$ranks"
  check "$ranks rank(s): every step's loss and norm equal, clipping active" same_steps "$tmp/device$ranks" "$tmp/host$ranks" 5
  check "$ranks rank(s): checkpoint-5 holds the same LoRA and AdamW state" \
    same_state "$tmp/device$ranks/checkpoint-5" "$tmp/host$ranks/checkpoint-5"
  run "resume_host$ranks" $ranks --set resume_from_checkpoint="$tmp/device$ranks/checkpoint-5"
  check "$ranks rank(s): device checkpoint resumed offloaded == uninterrupted" same_resumed "$tmp/device$ranks" "$tmp/resume_host$ranks"
done
run resume_device1 1 "${device[@]}" --set resume_from_checkpoint="$tmp/host1/checkpoint-5"
check "offloaded checkpoint resumed on the device == uninterrupted" same_resumed "$tmp/device1" "$tmp/resume_device1"
check "the log says where the state lives" grep -q "expert LoRA offloaded: .* in host RAM" "$tmp/host1.log"
# Across ranks every step's row says what the host side took (seconds, none negative); on one rank the
# norm is the device's and there is no host side, as in the device run. Both say the bytes copied.
host_times() { "$py" - "$1" "$2" "$3" <<'PY'
import json, sys
keys = ("lora_host_read_s", "lora_host_norm_s")
host, one, device = ([r for r in map(json.loads, open(f"{d}/metrics.jsonl")) if "loss" in r] for d in sys.argv[1:])
assert len(host) == 10 and all(all(k in r and r[k] >= 0 for k in keys) for r in host), host[0]
# Every step of both copies the state both ways; the device run copies none.
links = ("lora_h2d_bytes", "lora_d2h_bytes")
assert all(all(r.get(k, 0) > 0 for k in links) for r in host + one), one[0]
assert not any(k in r for r in device for k in links), device[0]
assert sum(r["lora_host_norm_s"] for r in host) > 0 and sum(r["lora_host_read_s"] for r in host) > 0, host
assert len(one) == 10 and not any(k in r for r in one + device for k in keys), one[0]
PY
}
check "metrics.jsonl: the host side's times on every step across ranks, none on one" host_times "$tmp/host2" "$tmp/host1" \
  "$tmp/device1"
check "the device run says it kept it" grep -q "stay on the device (expert_lora_offload: false)" "$tmp/device1.log"

mbm=(--set max_steps=4 --set save_steps=0 --set step_order=micro_batch_major --set gradient_accumulation_steps=2
     --set micro_batch_size=2)
run mbm_device 1 "${mbm[@]}" "${device[@]}"
run mbm_host 1 "${mbm[@]}"
check "micro-batch-major accumulation: offloaded == on the device" same "$tmp/mbm_device" "$tmp/mbm_host"

per_expert=(--set max_steps=4 --set save_steps=0 --set 'lora_target_parameters=[]' --set lora_dropout=0.1
            --set 'lora_target_modules=[q_proj, v_proj, gate_proj, up_proj, down_proj]')
run expert_device 1 "${per_expert[@]}" "${device[@]}"
run expert_host 1 "${per_expert[@]}"
check "per-expert LoRA with dropout: offloaded == on the device" same "$tmp/expert_device" "$tmp/expert_host"
# fp16 loss scaling with overflows injected at steps 2 and 3 (the fault seam's binary): the same
# skips, scales and adapter.
fp16=(--set max_steps=6 --set save_steps=0 --set fp16=true --set bf16=false --set loss_scale_growth_interval=2
      --set max_nonfinite_steps=5)
for kind in device host; do
  extra=()
  [ $kind = device ] && extra=("${device[@]}")
  EO_DDP_FAULT_OVERFLOW=2,3 timeout 300 "$1/eo-ddp-faults" "${common[@]}" "${fp16[@]}" "${extra[@]}" \
    --set output_dir="$tmp/fp16_$kind" >"$tmp/fp16_$kind.log" 2>&1 || { echo "run fp16_$kind failed"; fail=1; }
done
check "fp16 with overflows: offloaded == on the device" same "$tmp/fp16_device" "$tmp/fp16_host"
check "fp16: the injected overflows were skipped" grep -q "step 3: the gradients overflowed fp16" "$tmp/fp16_host.log"
[ $fail = 0 ] && echo "expert_lora_offload: all checks passed" || { echo "expert_lora_offload: FAILED"; for f in "$tmp"/*.log; do echo "== $f"; tail -3 "$f"; done; }
exit $fail
