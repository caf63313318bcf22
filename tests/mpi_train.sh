#!/usr/bin/env bash
# Data-parallel training as users run it (mpirun + the eo-ddp binary), CPU ranks:
#  1. 2 ranks x micro-batch 2 end with the same LoRA (and per-step losses) as 1 rank x micro-batch 4,
#     with offload off and on; 3 ranks (oversubscribed) x 1 vs 1 rank x 3; 4 ranks x 1 vs 1 x 4
#     with offload on;
#  2. every rank ends with bitwise identical LoRA (the trainer checks and logs it);
#  3. the bytes that went through collectives are exactly the LoRA gradients (+ the initial LoRA
#     broadcast): no expert byte was communicated;
#  4. a rank that throws, or is killed, takes every rank down with a non-zero exit within a bound,
#     naming the failed rank;
#  5. shared homes (per_numa_node) and disk homes train bitwise like per-rank homes (2 and 3 ranks).
# usage: mpi_train.sh BUILD_DIR SOURCE_DIR PYTHON
set -uo pipefail
bin=$1/eo-ddp
faults_bin=$1/eo-ddp-faults  # eo-ddp with the fault-injection test seam (tests/eo_ddp_faults.cpp)
src=$2
py=$3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cd "$src"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
mpirun="mpirun --oversubscribe --bind-to none"
source "$src/tests/testlib.sh"
common=(--config configs/tiny-qwen3-moe.yaml --set max_steps=4 --set save_steps=0 --set lora_dropout=0
        --set warmup_steps=1 --set logging_steps=1)

run() {  # name ranks mb [extra --set ...]
  local name=$1 ranks=$2 mb=$3
  shift 3
  if [ "$ranks" = 1 ]; then
    timeout 300 "$bin" "${common[@]}" --set micro_batch_size="$mb" --set output_dir="$tmp/$name" "$@" >"$tmp/$name.log" 2>&1
  else
    timeout 300 $mpirun -np "$ranks" "$bin" "${common[@]}" --set micro_batch_size="$mb" --set output_dir="$tmp/$name" "$@" >"$tmp/$name.log" 2>&1
  fi
  local rc=$?
  [ $rc = 0 ] || { echo "run $name exited $rc:"; tail -20 "$tmp/$name.log"; fail=1; }
}

run one4 1 4
run two2 2 2
check "2x2 == 1x4" "$py" tests/ref/compare_adapters.py "$tmp/one4" "$tmp/two2" --rtol 1e-3 --loss-rtol 1e-5
check "LoRA identical on 2 ranks" grep -q "LoRA identical on all 2 ranks" "$tmp/two2.log"
# Eval loss over ranks, token-weighted (issue #16): 2 ranks (rank 0 tokenises the chat data while
# rank 1 waits: a cold cache) and 1 rank give the same eval loss at every evaluation.
evalset=(--set "datasets=[{path: fixtures/tiny-chat/chat.jsonl, type: chat_template}]" --set val_set_size=0.25
         --set eval_steps=2 --set sequence_len=256 --set dataset_prepared_path="$tmp/prepared")
run eval_two 2 2 "${evalset[@]}"
run eval_one 1 4 "${evalset[@]}"
check "rank 0 tokenised the chat data for both ranks" grep -q "prepare: .*fixtures/tiny-chat/chat.jsonl" "$tmp/eval_two.log"
check "eval loss: 2 ranks == 1 rank" "$py" -c "
import json, sys
ev = lambda d: [(m['step'], m['eval_loss'], m['eval_tokens']) for m in map(json.loads, open(d + '/metrics.jsonl')) if 'eval_loss' in m]
a, b = ev('$tmp/eval_one'), ev('$tmp/eval_two')
print(a, b)
sys.exit(not (len(a) == 2 and [x[::2] for x in a] == [x[::2] for x in b] and all(abs(x[1] - y[1]) <= 1e-5 * x[1] for x, y in zip(a, b))))"
# The other ranks' wait for rank 0's tokenisation is bounded: a tokeniser that hangs ends the job
# after dataset_prepare_timeout, naming the key.
printf '#!/bin/sh\nexec sleep 60\n' >"$tmp/hanging-python"
chmod +x "$tmp/hanging-python"
start=$(date +%s)
EO_DDP_PYTHON="$tmp/hanging-python" timeout 120 $mpirun -np 2 -x EO_DDP_PYTHON "$bin" "${common[@]}" "${evalset[@]}" \
  --set dataset_prepare_timeout=10 --set dataset_prepared_path="$tmp/prepared-hang" --set output_dir="$tmp/hang" >"$tmp/hang.log" 2>&1
rc=$?
took=$(( $(date +%s) - start ))
check "a hanging tokeniser: the job fails ($rc), not a timeout" test "$rc" -ne 0 -a "$rc" -ne 124
check "a hanging tokeniser: ended within the bound ($took s)" test "$took" -lt 55
check "a hanging tokeniser: the message names dataset_prepare_timeout" grep -q "within 10 s (dataset_prepare_timeout" "$tmp/hang.log"
run one4_off 1 4 --set expert_offload=true
run two2_off 2 2 --set expert_offload=true
check "2x2 == 1x4 with offload" "$py" tests/ref/compare_adapters.py "$tmp/one4_off" "$tmp/two2_off" --rtol 1e-3 --loss-rtol 1e-5
run one3 1 3
run three1 3 1
check "3x1 == 1x3" "$py" tests/ref/compare_adapters.py "$tmp/one3" "$tmp/three1" --rtol 1e-3 --loss-rtol 1e-5
check "LoRA identical on 3 ranks" grep -q "LoRA identical on all 3 ranks" "$tmp/three1.log"
# Issue #9's CPU share: 4 oversubscribed ranks, each with its own expert homes.
run four1_off 4 1 --set expert_offload=true
check "4x1 == 1x4 with offload" "$py" tests/ref/compare_adapters.py "$tmp/one4_off" "$tmp/four1_off" --rtol 1e-3 --loss-rtol 1e-5
check "LoRA identical on 4 ranks" grep -q "LoRA identical on all 4 ranks" "$tmp/four1_off.log"

# The layer-major step under DDP: 2 ranks x (mb 1, g 2) vs 1 rank x (mb 1, g 4), offload on; each
# block's buckets launch after its last micro-batch's backward, and the bytes stay the LoRA
# gradients once per step whatever g is.
run one_g4 1 1 --set gradient_accumulation_steps=4 --set expert_offload=true
run two_g2 2 1 --set gradient_accumulation_steps=2 --set expert_offload=true
check "2 ranks x g2 == 1 rank x g4" "$py" tests/ref/compare_adapters.py "$tmp/one_g4" "$tmp/two_g2" --rtol 1e-5 --loss-rtol 1e-5

# expert_offload_homes: per_numa_node (issue #17): one copy per NUMA node, mapped by every rank of
# it, trains bitwise like per-rank homes with 2 and 3 ranks; it lives in an anonymous memory file,
# so nothing is left in /dev/shm after a normal exit, an error exit or a rank killed with -9.
# Open MPI's own shared-memory segments (vader_segment.*) come and go with every job, including
# other tests' jobs running beside this one under ctest -j: they are not ours to count.
ours_in_shm() { ls /dev/shm | grep -v '^vader_segment\.' | sort; }
shm_before=$(ours_in_shm)
run two2_shared 2 2 --set expert_offload=true --set expert_offload_homes=per_numa_node
check "per_numa_node == per_rank, 2 ranks, bitwise" "$py" tests/ref/compare_adapters.py "$tmp/two2_off" "$tmp/two2_shared" --exact
check "one shared copy mapped by both ranks" grep -q "1 shared copy of .* mapped by 2 ranks" "$tmp/two2_shared.log"
run three1_off 3 1 --set expert_offload=true
run three1_shared 3 1 --set expert_offload=true --set expert_offload_homes=per_numa_node
check "per_numa_node == per_rank, 3 ranks, bitwise" "$py" tests/ref/compare_adapters.py "$tmp/three1_off" "$tmp/three1_shared" --exact
check "one shared copy mapped by 3 ranks" grep -q "1 shared copy of .* mapped by 3 ranks" "$tmp/three1_shared.log"
for kind in throw kill; do
  EO_DDP_FAULT_STEP=2 EO_DDP_FAULT_RANK=1 EO_DDP_FAULT=$kind timeout 120 $mpirun -np 2 -x EO_DDP_FAULT_STEP -x EO_DDP_FAULT_RANK \
    -x EO_DDP_FAULT "$faults_bin" "${common[@]}" --set max_steps=20 --set expert_offload=true --set expert_offload_homes=per_numa_node \
    --set output_dir="$tmp/shared_$kind" >"$tmp/shared_$kind.log" 2>&1
  check "per_numa_node, rank 1 fails ($kind): the job fails" test $? -ne 0
done
check "per_numa_node: nothing left in /dev/shm" test "$(ours_in_shm)" = "$shm_before"

# expert_offload_homes: disk (issue #17): one homes file per host, written by one rank and read by
# all through their own read rings, trains bitwise like per-rank homes with 2 and 3 ranks; a second
# 3-rank run reuses the file (same inode and modification time).
run two2_disk 2 2 --set expert_offload=true --set expert_offload_homes=disk --set expert_offload_disk_path="$tmp/homes2"
check "disk == per_rank, 2 ranks, bitwise" "$py" tests/ref/compare_adapters.py "$tmp/two2_off" "$tmp/two2_disk" --exact
check "one disk file read by both ranks" grep -q "1 disk file(s) of .* read by 2 ranks" "$tmp/two2_disk.log"
run three1_disk 3 1 --set expert_offload=true --set expert_offload_homes=disk --set expert_offload_disk_path="$tmp/homes3"
check "disk == per_rank, 3 ranks, bitwise" "$py" tests/ref/compare_adapters.py "$tmp/three1_off" "$tmp/three1_disk" --exact
check "one disk file read by 3 ranks" grep -q "1 disk file(s) of .* read by 3 ranks" "$tmp/three1_disk.log"
check "3 ranks: the file was written" grep -q "expert homes on disk: writing $tmp/homes3/eo-ddp-expert-homes.bin" "$tmp/three1_disk.log"
homes3=$(stat -c '%i %y' "$tmp/homes3/eo-ddp-expert-homes.bin")
run three1_disk_again 3 1 --set expert_offload=true --set expert_offload_homes=disk --set expert_offload_disk_path="$tmp/homes3"
check "3 ranks again: the file is reused" grep -q "expert homes on disk: reusing $tmp/homes3/eo-ddp-expert-homes.bin" "$tmp/three1_disk_again.log"
check "3 ranks again: its inode and mtime are unchanged" test "$(stat -c '%i %y' "$tmp/homes3/eo-ddp-expert-homes.bin")" = "$homes3"
check "3 ranks again: bitwise" "$py" tests/ref/compare_adapters.py "$tmp/three1_off" "$tmp/three1_disk_again" --exact
# The writer's drive fills up while the other rank waits for the file: the job ends (no hang),
# naming the file, and leaves nothing in the directory.
start=$(date +%s)
EO_DDP_FAULT_DISK_FULL_AFTER=50000 timeout 120 $mpirun -np 2 -x EO_DDP_FAULT_DISK_FULL_AFTER "$faults_bin" "${common[@]}" \
  --set expert_offload=true --set expert_offload_homes=disk --set expert_offload_disk_path="$tmp/homes_full" \
  --set output_dir="$tmp/disk_full" >"$tmp/disk_full.log" 2>&1
rc=$?
took=$(( $(date +%s) - start ))
check "disk homes, full drive on 2 ranks: the job fails ($rc), not a timeout" test "$rc" -ne 0 -a "$rc" -ne 124
check "disk homes, full drive on 2 ranks: within the bound ($took s)" test "$took" -lt 100
check "disk homes, full drive on 2 ranks: the message names the file" \
  grep -q "cannot write the expert homes file $tmp/homes_full/.eo-ddp-expert-homes.bin.tmp.* No space left on device" "$tmp/disk_full.log"
check "disk homes, full drive on 2 ranks: nothing left in the directory" test -z "$(ls -A "$tmp/homes_full")"

# Collective bytes = steps x (LoRA gradient bytes + the step's losses, 3 fp64) (allreduce) + LoRA
# bytes once (broadcast).
lora_bytes=$("$py" -c "
from safetensors.torch import load_file
t = load_file('$tmp/two2_off/adapter_model.safetensors'); print(sum(v.numel() * 4 for v in t.values()))")
check "collective bytes = LoRA grads + broadcast" grep -q "collectives: allreduce $((4 * (lora_bytes + 24))) bytes, broadcast $lora_bytes bytes" "$tmp/two2_off.log"
check "collective bytes with g 2 = LoRA grads once per step + broadcast" grep -q "collectives: allreduce $((4 * (lora_bytes + 24))) bytes, broadcast $lora_bytes bytes" "$tmp/two_g2.log"

# A rank that throws at step 2, and a rank killed at step 2: everyone exits non-zero, quickly.
for kind in throw kill; do
  start=$(date +%s)
  EO_DDP_FAULT_STEP=2 EO_DDP_FAULT_RANK=1 EO_DDP_FAULT=$kind timeout 120 $mpirun -np 2 \
    -x EO_DDP_FAULT_STEP -x EO_DDP_FAULT_RANK -x EO_DDP_FAULT \
    "$faults_bin" "${common[@]}" --set max_steps=50 --set output_dir="$tmp/fault_$kind" >"$tmp/fault_$kind.log" 2>&1
  rc=$?
  took=$(( $(date +%s) - start ))
  check "fault $kind: non-zero exit ($rc), not a timeout" test "$rc" -ne 0 -a "$rc" -ne 124
  check "fault $kind: every rank exited within bound ($took s)" test "$took" -lt 100
  check "fault $kind: no final adapter and no half-written checkpoint left" \
    test ! -e "$tmp/fault_$kind/adapter_model.safetensors" -a -z "$(find "$tmp/fault_$kind" -name '.tmp*' -o -name 'checkpoint-*')"
  if [ "$kind" = throw ]; then
    check "fault throw: message names rank 1" grep -q "\[rank 1\] error: fault injected at step 2 on rank 1" "$tmp/fault_$kind.log"
  else
    check "fault kill: the launcher names the dead rank" grep -qiE "rank 1|signal 9|killed" "$tmp/fault_$kind.log"
  fi
done
[ $fail = 0 ] && echo "mpi_train: all checks passed" || { echo "mpi_train: FAILED"; for f in "$tmp"/*.log; do echo "== $f"; tail -5 "$f"; done; }
exit $fail
