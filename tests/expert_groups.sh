#!/usr/bin/env bash
# Blocks streamed in groups of experts (expert_group_size) train exactly as resident blocks, on
# the CPU build (the same engine state machine: group slots, double-buffered copies):
#  1. 6 steps with expert LoRA (peft's fused parameters) and clipping active, experts offloaded in
#     groups of 1, 3 (not dividing the 8 experts) and 4, the experts' LoRA state on the host: every
#     step's loss and gradient norm and the adapter bitwise those of resident experts; 2 ranks too;
#  2. the per-expert LoRA (lora_target_modules on the experts), micro-batch-major accumulation: bitwise;
#  3. the log, --check and `eo-ddp plan` say the group size (plan: auto's choice for Maverick at 24 GiB);
#  4. config errors name the key and the fix.
# usage: expert_groups.sh BUILD_DIR SOURCE_DIR PYTHON
set -uo pipefail
source "$2/tests/testlib.sh"
eo_test_setup "$@"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
common=(--config configs/tiny-qwen3-moe.yaml --set max_steps=6 --set save_steps=0 --set warmup_steps=2
        --set lora_dropout=0 --set max_grad_norm=0.05 --set 'lora_target_modules=[q_proj, k_proj, v_proj, o_proj]'
        --set 'lora_target_parameters=[mlp.experts.gate_up_proj, mlp.experts.down_proj]')
resident=(--set expert_offload=false)

for ranks in 1 2; do
  run "resident$ranks" $ranks "${resident[@]}"
  sizes="1 3 4"
  [ $ranks = 2 ] && sizes="3"
  for g in $sizes; do
    run "groups${g}_$ranks" $ranks --set expert_offload=true --set expert_group_size=$g
    check "$ranks rank(s), groups of $g: adapter bitwise the resident one" same "$tmp/resident$ranks" "$tmp/groups${g}_$ranks"
    check "$ranks rank(s), groups of $g: every step's loss and norm equal, clipping active" \
      same_steps "$tmp/resident$ranks" "$tmp/groups${g}_$ranks" 6
  done
done
check "the log says the blocks stream in groups" grep -q "a group of 3 experts each; blocks of .* stream group by group" "$tmp/groups3_1.log"
check "the log says the experts' LoRA state is on the host" grep -q "expert LoRA offloaded: .* in host RAM" "$tmp/groups3_1.log"

per_expert=(--set max_steps=4 --set 'lora_target_parameters=[]' --set step_order=micro_batch_major
            --set gradient_accumulation_steps=2 --set micro_batch_size=2
            --set 'lora_target_modules=[q_proj, v_proj, gate_proj, up_proj, down_proj]')
run expert_resident 1 "${per_expert[@]}" "${resident[@]}"
run expert_groups 1 "${per_expert[@]}" --set expert_offload=true --set expert_group_size=3
check "per-expert LoRA, micro-batch-major, groups of 3: bitwise the resident run" same "$tmp/expert_resident" "$tmp/expert_groups"

"$bin" "${common[@]}" --set expert_offload=true --set expert_group_size=3 --check >"$tmp/check.txt" 2>&1
check "--check names the groups" grep -q "blocks streamed in groups of 3 experts (expert_group_size)" "$tmp/check.txt"
"$bin" plan --config configs/tiny-qwen3-moe.yaml --set base_model="$src/configs/models/llama-4-maverick-17b-128e" \
  --set expert_offload=true --set sequence_len=2048 --set micro_batch_size=1 --set lora_r=16 --vram 24GiB >"$tmp/plan.txt" 2>&1
check "plan at 24 GiB: Maverick's blocks go in groups (auto)" grep -q "expert_group_size: auto -> [0-9]*, as training would take it" "$tmp/plan.txt"
check "plan at 24 GiB: Maverick fits" grep -q "  fits a 24.00 GiB card" "$tmp/plan.txt"

# Config errors: the key and what to do.
err() {  # expected-text [--set ...]: the run must fail before training and name the problem
  local want=$1
  shift
  ! "$bin" "${common[@]}" --set output_dir="$tmp/err" "$@" --check >"$tmp/err.txt" 2>&1 && grep -qF -- "$want" "$tmp/err.txt"
}
check "expert_group_size: 0 is refused" err "expert_group_size: expected auto, whole, or a number of experts of at least 1" \
  --set expert_offload=true --set expert_group_size=0
check "expert_group_size without expert_offload is refused" err "expert_group_size: streams offloaded blocks in groups: it needs expert_offload: true" \
  --set expert_group_size=2
check "expert_group_size with disk homes is refused" err "expert_group_size: needs the homes in host RAM" \
  --set expert_offload=true --set expert_group_size=2 --set expert_offload_homes=disk --set expert_offload_disk_path="$tmp/d"
[ $fail = 0 ] && echo "expert_groups: all checks passed" || { echo "expert_groups: FAILED"; for f in "$tmp"/*.log; do echo "== $f"; tail -3 "$f"; done; }
exit $fail
