#!/usr/bin/env bash
# axolotl's NVFP4 example (tests/axolotl_examples/upstream/qwen3/30b-a3b-nvfp4-lora.yaml) on a tiny
# NVFP4 Qwen3-MoE in modelopt's layout (tools/axolotl_corpus.py model qwen3_moe_nvfp4): as written
# (nvfp4_merge_aware: true) it passes --check, `eo-ddp plan` counts its experts as NVFP4, and it
# trains 3 steps through the snapped forward, its adapter_config.json stamped as axolotl stamps it.
# nvfp4_merge_aware_start_step: the steps before it are plain LoRA's, bit for bit (the losses, and
# the adapter of a run that ends before it), the step at it is not; an adapter that never trained
# snapped is not stamped. And the refusals axolotl makes (no use_sonicmoe, adapter not lora, a
# start step without nvfp4_merge_aware, a bad start step) and eo-ddp's own (a base that is not NVFP4).
# usage: nvfp4_train.sh BUILD_DIR SOURCE_DIR PYTHON
source "$(dirname "$0")/testlib.sh"
eo_test_setup "$@"
rel=qwen3/30b-a3b-nvfp4-lora.yaml
model=$tmp/model
"$py" tools/axolotl_corpus.py model qwen3_moe_nvfp4 "$model" >/dev/null 2>&1 || { echo "FAILED: tiny NVFP4 model"; exit 1; }
"$py" tools/axolotl_corpus.py prepare "tests/axolotl_examples/upstream/$rel" "$model" "$tmp/data" "$tmp/as_written.yaml" ||
  { echo "FAILED: prepare"; exit 1; }
mkdir -p "$tmp/run"
if (cd "$tmp/run" && "$bin" --config "$tmp/as_written.yaml" --check > "$tmp/as_written.check" 2>&1); then
  echo "ok: as written --check passes"
else
  echo "FAILED: --check as written"; sed 's/^/    /' "$tmp/as_written.check" | head -20; fail=1
fi
if (cd "$tmp/run" && "$bin" plan --config "$tmp/as_written.yaml" > "$tmp/plan.txt" 2>&1) && grep -q "NVFP4" "$tmp/plan.txt"; then
  echo "ok: eo-ddp plan counts NVFP4 experts"
else
  echo "FAILED: plan"; sed 's/^/    /' "$tmp/plan.txt" | head -20; fail=1
fi
grep -v '^nvfp4_merge_aware:' "$tmp/as_written.yaml" > "$tmp/plain_lora.yaml"
cp "$tmp/as_written.yaml" "$tmp/start2.yaml" && echo "nvfp4_merge_aware_start_step: 2" >> "$tmp/start2.yaml"
cp "$tmp/as_written.yaml" "$tmp/start5.yaml" && echo "nvfp4_merge_aware_start_step: 5" >> "$tmp/start5.yaml"
# train NAME CONFIG STEPS: output_dir $tmp/NAME; its log $tmp/NAME.log
train() {
  (cd "$tmp/run" && "$bin" --config "$2" --set max_steps="$3" --set gradient_accumulation_steps=1 --set output_dir="$tmp/$1" \
     > "$tmp/$1.log" 2>&1) && grep -q "step $3/$3" "$tmp/$1.log"
}
losses() { "$py" -c 'import json,sys; print(" ".join(repr(json.loads(l)["loss"]) for l in open(sys.argv[1]) if "loss" in json.loads(l)))' "$1/metrics.jsonl"; }
stamp() { "$py" -c 'import json,sys; print(json.dumps(json.load(open(sys.argv[1] + "/adapter_config.json")).get("nvfp4_merge_aware"), sort_keys=True))' "$1"; }
if train snapped "$tmp/as_written.yaml" 3 && grep -q "NVFP4 linears held in NVFP4" "$tmp/snapped.log" &&
   grep -q "nvfp4_merge_aware: 12 NVFP4 linears and 6 NVFP4 expert matrices" "$tmp/snapped.log"; then
  echo "ok: as written trains 3 steps through the snapped forward"
else
  echo "FAILED: training as written"; tail -20 "$tmp/snapped.log" | sed 's/^/    /'; fail=1
fi
check "the adapter is stamped (start_step null)" test "$(stamp "$tmp/snapped")" = \
  '{"encoder": null, "pts_policy": "base_fused_max", "scale_mode": "fresh", "start_step": null}'
train plain3 "$tmp/plain_lora.yaml" 3 || { echo "FAILED: plain LoRA training"; tail -20 "$tmp/plain3.log"; fail=1; }
train start2 "$tmp/start2.yaml" 3 || { echo "FAILED: start_step 2 training"; tail -20 "$tmp/start2.log"; fail=1; }
read -ra p <<< "$(losses "$tmp/plain3")"
read -ra s <<< "$(losses "$tmp/start2")"
read -ra a <<< "$(losses "$tmp/snapped")"
echo "losses: plain ${p[*]}; start_step 2: ${s[*]}; start_step 0: ${a[*]}"
if [ ${#p[@]} -eq 3 ] && [ "${s[0]}" = "${p[0]}" ] && [ "${s[1]}" = "${p[1]}" ] && [ "${s[2]}" != "${p[2]}" ] &&
   [ "${a[2]}" = "${s[2]}" ]; then
  # (with B = 0, steps 1 and 2 here: warmup_ratio 0.1 gives step 1 learning rate 0, Q(dequant(W))
  # is dequant(W): the checkpoint's grid is the fresh quantiser's fixed point; so start_step 0
  # first differs at step 3, where it is start_step 2's)
  echo "ok: steps before nvfp4_merge_aware_start_step are plain LoRA's, the step at it is not"
else
  echo "FAILED: start_step schedule"; fail=1
fi
check "start_step 2's adapter is stamped" test "$(stamp "$tmp/start2")" = \
  '{"encoder": null, "pts_policy": "base_fused_max", "scale_mode": "fresh", "start_step": 2}'
check "the log names the step the snapped forward starts at" grep -q "NVFP4-snapped forward is on from step 3" "$tmp/start2.log"
# A run that ends before its start step trained plain LoRA: the plain run's adapter, unstamped.
train start5 "$tmp/start5.yaml" 3 || { echo "FAILED: start_step 5 training"; fail=1; }
check "a run ending before start_step is plain LoRA's adapter, bit for bit" cmp "$tmp/start5/adapter_model.safetensors" \
  "$tmp/plain3/adapter_model.safetensors"
check "and is not stamped" test "$(stamp "$tmp/start5")" = null
check "plain LoRA is not stamped" test "$(stamp "$tmp/plain3")" = null
# The refusals, each naming its key.
refused() {  # LABEL TEXT CONFIG: --check exits 2 with TEXT among the problems
  (cd "$tmp/run" && "$bin" --config "$3" --check > "$tmp/r.check" 2>&1)
  local rc=$?
  if [ $rc -eq 2 ] && grep -qF -- "$2" "$tmp/r.check"; then echo "ok: refused: $1"; else
    echo "FAILED: $1: exit $rc"; sed 's/^/    /' "$tmp/r.check" | head; fail=1; fi
}
grep -v '^use_sonicmoe:' "$tmp/as_written.yaml" > "$tmp/no_sonic.yaml"
refused "without use_sonicmoe" "nvfp4_merge_aware: requires the sonicmoe expert backend" "$tmp/no_sonic.yaml"
sed 's/^use_sonicmoe: true/expert_backend: sonicmoe/' "$tmp/as_written.yaml" > "$tmp/backend.yaml"
check "expert_backend: sonicmoe stands for use_sonicmoe" bash -c "cd '$tmp/run' && '$bin' --config '$tmp/backend.yaml' --check"
sed 's/^adapter: lora/adapter: qlora\nload_in_4bit: true/' "$tmp/as_written.yaml" > "$tmp/qlora.yaml"
refused "adapter: qlora" "nvfp4_merge_aware: requires a LoRA adapter (adapter: lora" "$tmp/qlora.yaml"
cp "$tmp/as_written.yaml" "$tmp/kernel.yaml" && echo "lora_qkv_kernel: true" >> "$tmp/kernel.yaml"
refused "lora_qkv_kernel" "lora_qkv_kernel: nvfp4_merge_aware is incompatible with lora_qkv_kernel" "$tmp/kernel.yaml"
echo "nvfp4_merge_aware_start_step: 3" >> "$tmp/plain_lora.yaml"
refused "a start step without nvfp4_merge_aware" "nvfp4_merge_aware_start_step: requires nvfp4_merge_aware: true" "$tmp/plain_lora.yaml"
for bad in -1 2.0 1.5 true; do
  cp "$tmp/as_written.yaml" "$tmp/bad.yaml" && echo "nvfp4_merge_aware_start_step: $bad" >> "$tmp/bad.yaml"
  refused "start step $bad" "nvfp4_merge_aware_start_step: must be an int >= 0 (absolute step) or a float in (0, 1)" "$tmp/bad.yaml"
done
cp "$tmp/as_written.yaml" "$tmp/frac.yaml" && echo "nvfp4_merge_aware_start_step: 0.5" >> "$tmp/frac.yaml"
check "a fraction start step" bash -c "cd '$tmp/run' && '$bin' --config '$tmp/frac.yaml' --check"
plain_model=$tmp/plain_model
"$py" tests/ref/tiny_model.py --arch qwen3_moe --out "$plain_model" >/dev/null 2>&1 &&
  cp "$model"/tokenizer*.json "$plain_model/" 2>/dev/null
sed "s#^base_model: .*#base_model: $plain_model#" "$tmp/as_written.yaml" > "$tmp/float_base.yaml"
refused "a float base" "nvfp4_merge_aware: snaps the LoRA delta onto an NVFP4 base's grid, but" "$tmp/float_base.yaml"
[ $fail -eq 0 ] && echo "nvfp4_train: all checks passed"
exit $fail
