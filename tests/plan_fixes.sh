#!/usr/bin/env bash
# `eo-ddp plan --vram` on real model shapes (configs/models: config.json only, nothing is loaded)
# that do not fit a 12 GiB or a 24 GiB card: the plan lists what to change, and applying any listed
# change (the first included) makes the same command say it fits, at the peak the list predicted.
# `--check` of a run that does not fit device_memory_limit exits 2 with the list, not "config ok".
# usage: plan_fixes.sh BUILD_DIR SOURCE_DIR PYTHON
set -uo pipefail
source "$2/tests/testlib.sh"
eo_test_setup "$@"

# gpt-oss-120b: gpt-oss-20b's file with 120b's layer and expert counts, and its MXFP4 experts.
"$py" - "$src/configs/models/gpt-oss-20b/config.json" "$tmp/gpt-oss-120b" <<'PY'
import json, os, sys
c = json.load(open(sys.argv[1]))
c.update(num_hidden_layers=36, num_local_experts=128, layer_types=["sliding_attention", "full_attention"] * 18,
         quantization_config={"quant_method": "mxfp4"})
os.makedirs(sys.argv[2])
json.dump(c, open(os.path.join(sys.argv[2], "config.json"), "w"), indent=1)
PY

# A typical axolotl QLoRA config on a 24 GB card.
config() {  # MODEL_DIR EXTRA_YAML
  printf 'base_model: %s\nload_in_4bit: true\nadapter: qlora\nlora_r: 16\nlora_alpha: 32\nsequence_len: 2048\n' "$1"
  printf 'micro_batch_size: 2\ngradient_accumulation_steps: 4\ngradient_checkpointing: true\n'
  printf 'datasets: [{path: %s/fixtures/tiny-data/train.jsonl}]\n%s\n' "$src" "$2"
}
n=0
case_() {  # MODEL_DIR CARD EXTRA_YAML
  n=$((n + 1))
  local f=$tmp/case$n.yaml label="$(basename "$1") on a $2 card${3:+ ($3)}"
  config "$1" "$3" >"$f"
  "$bin" plan --config "$f" --vram "$2" >"$tmp/plan$n.log" 2>&1
  local rc=$?
  check "$label: does not fit (plan exits 1)" test $rc -eq 1
  check "$label: lists what to change" grep -qE "^(what to change|no single change fits)" "$tmp/plan$n.log"
  local first
  first=$(grep -m1 -E '^ +--set ' "$tmp/plan$n.log")
  check "$label: a change is listed" test -n "$first"
  local i=0
  while read -r sets; do
    i=$((i + 1))
    # shellcheck disable=SC2086 # the listed --set pairs have no spaces
    "$bin" plan --config "$f" --vram "$2" $sets >"$tmp/plan$n-$i.log" 2>&1
    rc=$?
    check "$label: change $i ($sets) fits" test $rc -eq 0
    check "$label: change $i: plan says it fits" grep -q "^  fits a " "$tmp/plan$n-$i.log"
    local predicted actual
    predicted=$(grep -B1 -F -- "$sets" "$tmp/plan$n.log" | grep -m1 -oE '^ +peak [0-9.]+ [KMG]iB' | grep -oE '[0-9.]+ [KMG]iB')
    actual=$(grep -m1 -E '^  peak VRAM' "$tmp/plan$n-$i.log" | grep -oE '[0-9.]+ [KMG]iB')
    check "$label: change $i: the peak listed ($predicted) is the peak planned ($actual)" test -n "$actual" -a "$predicted" = "$actual"
  done < <(grep -E '^ +--set ' "$tmp/plan$n.log" | sed -E 's/^ +//')
  if [ "$fail" -ne 0 ]; then cat "$tmp/plan$n.log"; fi
}
case_ "$src/configs/models/qwen3-30b-a3b" 24GiB "lora_target_linear: true"
case_ "$src/configs/models/qwen3-30b-a3b" 12GiB "lora_target_linear: true"
case_ "$src/configs/models/glm-4.5-air" 24GiB ""
case_ "$src/configs/models/glm-4.5-air" 12GiB "lora_target_linear: true"
case_ "$tmp/gpt-oss-120b" 24GiB ""
case_ "$tmp/gpt-oss-120b" 12GiB ""

# Host RAM too small for the pinned homes (--host-ram): the offload change puts them on a drive.
config "$src/configs/models/qwen3-30b-a3b" "lora_target_linear: true" >"$tmp/host.yaml"
"$bin" plan --config "$tmp/host.yaml" --vram 24GiB --host-ram 16GiB >"$tmp/host.log" 2>&1
check "with --host-ram 16GiB: does not fit (exit 1)" test $? -eq 1
first=$(grep -m1 -E '^ +--set ' "$tmp/host.log")
check "the first change puts the homes on a drive" grep -q -- "--set expert_offload=true .*--set expert_offload_homes=disk" <<<"$first"
# shellcheck disable=SC2086
"$bin" plan --config "$tmp/host.yaml" --vram 24GiB --host-ram 16GiB $first >"$tmp/host2.log" 2>&1
check "and with it card and host RAM fit (exit 0)" test $? -eq 0

# --check against device_memory_limit: exit 2, the list, no "config ok".
config "$src/configs/models/qwen3-30b-a3b" "lora_target_linear: true
device_memory_limit: 24GiB
output_dir: $tmp/out" >"$tmp/check.yaml"
"$bin" --config "$tmp/check.yaml" --check >"$tmp/check.log" 2>&1
rc=$?
check "--check of a run that does not fit exits 2" test $rc -eq 2
check "--check lists what to change" grep -qE "^(what to change to|no single change) fits? device_memory_limit 24.00 GiB" "$tmp/check.log"
check "--check does not say config ok" bash -c "! grep -q 'config ok' '$tmp/check.log'"
# shellcheck disable=SC2046
"$bin" --config "$tmp/check.yaml" --check $(grep -m1 -E '^ +--set ' "$tmp/check.log") >"$tmp/check2.log" 2>&1
check "--check with the first change exits 0" test $? -eq 0
check "and says config ok" grep -q "config ok" "$tmp/check2.log"
if [ "$fail" -ne 0 ]; then cat "$tmp/check.log"; exit 1; fi
echo "plan_fixes: all checks passed"
