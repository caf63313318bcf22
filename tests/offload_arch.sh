#!/usr/bin/env bash
# Offloaded training of the newer families on the CPU build (issue #19): for glm4_moe, DeepSeek
# (latent attention with q_proj and with q_a/q_b, sigmoid and softmax group-limited routers,
# shared experts, dense first layers), GLM-4.7-Flash (a dense layer between sparse ones) and
# Mistral Small 4 (fused checkpoint experts, Llama 4's query scaling), Gemma 4 (a dense MLP beside the
# experts on every layer, full layers without v_proj, GELU experts, soft-capped logits), Llama 4 (dense
# and MoE layers interleaved, the shared expert, chunked attention, NoPE layers, the experts' inputs
# scaled by the router) and gpt-oss (sinks, sliding window, expert biases; LoRA on attention only), QLoRA on every linear with the routed experts offloaded
# (synchronous and with prefetch) gives bitwise the losses and adapter of resident training.
# Only the routed experts move; shared experts, dense layers and attention stay resident.
# gpt_oss_mxfp4: gpt-oss with its experts in MXFP4 as the Hub ships them, held so in the homes
# (expert_quant: auto), and `plan` / `--check` counting them as MXFP4. Every family also trains
# bitwise with its homes on disk (expert_offload_homes: disk: the file holds the arenas whatever
# they encode); an MXFP4 file is rebuilt for an NF4 run, the log naming the difference.
# gemma4_params: Gemma 4 with LoRA on its fused experts (lora_target_parameters); mistral4_mm:
# Mistral Small 4 as the Hub ships it (the text model inside Mistral 3's multimodal wrapper); qwen3_next:
# Qwen3-Next's gated delta-rule layers recomputed in the step's backward beside its gated attention.
# ernie4_5_moe: ERNIE-4.5-MoE (dense layers before and after the sparse ones, a softmax router with its
# correction bias, shared experts, tied embeddings); hunyuan_v1_moe: Hunyuan-MoE (its shared_mlp beside the
# experts, q/k norms after NTK-alpha RoPE, biased attention).
# usage: offload_arch.sh BUILD_DIR SOURCE_DIR PYTHON   (EO_OFFLOAD_ARCHS="a b": those families only)
set -uo pipefail
source "$2/tests/testlib.sh"
eo_test_setup "$@"
for arch in ${EO_OFFLOAD_ARCHS:-glm4_moe_grouped deepseek_v2_grouped deepseek_v3_yarn glm4_moe_lite_grouped mistral4_scaled mistral4_mm gemma4 gemma4_params llama4 gpt_oss gpt_oss_mxfp4}; do
  tool=(--arch "$arch")
  [ $arch = gpt_oss_mxfp4 ] && tool=(--arch gpt_oss --mxfp4-experts)
  [ $arch = gemma4_params ] && tool=(--arch gemma4)
  "$py" tests/ref/tiny_model.py "${tool[@]}" --out "$tmp/$arch/model" --seed 3 >/dev/null 2>&1 ||
    { echo "FAILED: make_tiny_model.py --arch $arch"; fail=1; continue; }
  common=(--config configs/tiny-qwen3-moe.yaml --set base_model="$tmp/$arch/model" --set max_steps=4 --set save_steps=0
          --set lora_dropout=0.1 --set lora_target_linear=true --set sequence_len=64)
  [ $arch = gemma4_params ] && common+=(--set lora_dropout=0 --set lora_target_linear=false
                                        --set 'lora_target_modules=[q_proj, k_proj, v_proj, o_proj]'
                                        --set 'lora_target_parameters=[experts.gate_up_proj, experts.down_proj]')
  for run in resident sync prefetch disk; do
    extra=()
    [ $run = sync ] && extra=(--set expert_offload=true --set expert_offload_prefetch=false)
    [ $run = prefetch ] && extra=(--set expert_offload=true)
    [ $run = disk ] && extra=(--set expert_offload=true --set expert_offload_homes=disk --set expert_offload_disk_path="$tmp/$arch/homes")
    timeout 300 "$bin" "${common[@]}" --set output_dir="$tmp/$arch/$run" "${extra[@]}" >"$tmp/$arch/$run.log" 2>&1 ||
      { echo "FAILED: $arch $run run"; tail -5 "$tmp/$arch/$run.log"; fail=1; }
  done
  check "$arch: offload (synchronous) == resident, bitwise" "$py" tests/ref/compare_adapters.py "$tmp/$arch/resident" "$tmp/$arch/sync" --exact
  check "$arch: offload (prefetch) == resident, bitwise" "$py" tests/ref/compare_adapters.py "$tmp/$arch/resident" "$tmp/$arch/prefetch" --exact
  check "$arch: offload (disk homes) == resident, bitwise" "$py" tests/ref/compare_adapters.py "$tmp/$arch/resident" "$tmp/$arch/disk" --exact
  check "$arch: the offload engine ran (slots logged)" grep -q "device slot(s) of" "$tmp/$arch/sync.log"
  if [ $arch = gpt_oss_mxfp4 ]; then
    for run in resident sync prefetch disk; do
      check "$arch $run: the log says the experts are held in MXFP4" grep -q "experts held in MXFP4" "$tmp/$arch/$run.log"
    done
    timeout 300 "$bin" "${common[@]}" --set expert_quant=nf4 --set expert_offload=true --set expert_offload_homes=disk \
      --set expert_offload_disk_path="$tmp/$arch/homes" --set output_dir="$tmp/$arch/disk_nf4" >"$tmp/$arch/disk_nf4.log" 2>&1
    check "$arch: an NF4 run rebuilds the MXFP4 disk homes, saying why" \
      grep -q "rebuilding $tmp/$arch/homes/eo-ddp-expert-homes.bin (.*): it holds the homes of another model or quantisation (experts: the file's is 'MXFP4 (the checkpoint's)', this run's 'NF4')" "$tmp/$arch/disk_nf4.log"
    "$bin" plan "${common[@]}" --set expert_offload=true >"$tmp/$arch/plan.txt" 2>&1
    check "$arch: plan counts the experts as MXFP4" grep -q "experts .*(MXFP4, the checkpoint's own bytes)" "$tmp/$arch/plan.txt"
    # 6 experts x 3 matrices of 64 x 32: 1024 code bytes and 64 scale bytes each, 256-byte aligned.
    check "$arch: plan's slot is the MXFP4 arena (22.50 KiB)" grep -q "slot(s) of 22.50 KiB" "$tmp/$arch/plan.txt"
    "$bin" plan "${common[@]}" --set expert_offload=true --set expert_quant=nf4 >"$tmp/$arch/plan_nf4.txt" 2>&1
    check "$arch: expert_quant: nf4 plans NF4" grep -q "experts .*(NF4)" "$tmp/$arch/plan_nf4.txt"
    "$bin" train "${common[@]}" --check >"$tmp/$arch/check.txt" 2>&1
    check "$arch: --check names MXFP4 experts" grep -q "MXFP4 experts" "$tmp/$arch/check.txt"
    continue
  fi
  # The adapter holds the latent-attention / shared-expert modules under peft's names.
  [ $arch = gpt_oss ] && continue
  if [ $arch = gemma4 ]; then  # the dense MLP on every layer; no v_proj on the full layer (2)
    check "$arch: adapter has the dense MLP's LoRA on every layer, v_proj on the sliding layers only" "$py" -c "
import sys; from safetensors import safe_open
names = list(safe_open('$tmp/$arch/resident/adapter_model.safetensors', 'np').keys())
ok = all(any(f'layers.{i}.mlp.gate_proj.lora_A' in n for n in names) for i in range(3))
ok = ok and any('layers.0.self_attn.v_proj' in n for n in names) and not any('layers.2.self_attn.v_proj' in n for n in names)
sys.exit(0 if ok and not any('.experts.' in n for n in names) else 1)"
    continue
  fi
  if [ $arch = gemma4_params ]; then  # peft's nested ParamWrappers on layers.{i}.experts, every layer
    check "$arch: adapter has the fused expert LoRA on every layer, target_parameters experts.*" "$py" -c "
import json, sys; from safetensors import safe_open
names = list(safe_open('$tmp/$arch/resident/adapter_model.safetensors', 'np').keys())
ok = all(any(f'layers.{i}.experts.base_layer.lora_A.weight' in n for n in names) for i in range(3))
t = json.load(open('$tmp/$arch/resident/adapter_config.json'))['target_parameters']
sys.exit(0 if ok and t == ['experts.gate_up_proj', 'experts.down_proj'] else 1)"
    continue
  fi
  if [ $arch = qwen3_next ]; then  # delta-rule layers 0-2, full attention on 3, the gated shared expert; experts fused only
    check "$arch: adapter has the delta-rule layers', the gated attention's and the shared expert's LoRA" "$py" -c "
import sys; from safetensors import safe_open
names = list(safe_open('$tmp/$arch/resident/adapter_model.safetensors', 'np').keys())
ok = all(any(f'layers.{i}.linear_attn.{m}.lora_A' in n for n in names) for i in (0, 1, 2)
         for m in ('in_proj_qkvz', 'in_proj_ba', 'out_proj'))
ok = ok and any('layers.3.self_attn.q_proj.lora_B' in n for n in names) and any('shared_expert_gate.lora_A' in n for n in names)
sys.exit(0 if ok and any('.mlp.shared_expert.up_proj.lora_A' in n for n in names) and not any('.experts.' in n for n in names) else 1)"
    continue
  fi
  if [ $arch = llama4 ]; then  # dense layers 0, 2; MoE layers 1, 3 with the shared expert; no routed expert
    check "$arch: adapter has the dense layers' and the shared experts' LoRA, no routed expert's" "$py" -c "
import sys; from safetensors import safe_open
names = list(safe_open('$tmp/$arch/resident/adapter_model.safetensors', 'np').keys())
ok = all(any(f'layers.{i}.feed_forward.gate_proj.lora_A' in n for n in names) for i in (0, 2))
ok = ok and all(any(f'layers.{i}.feed_forward.shared_expert.down_proj.lora_B' in n for n in names) for i in (1, 3))
sys.exit(0 if ok and not any('.experts.' in n for n in names) else 1)"
    continue
  fi
  if [ $arch = hunyuan_v1_moe ]; then  # the shared MLP is mlp.shared_mlp
    check "$arch: adapter has the shared MLP's and the experts' LoRA" "$py" -c "
import sys; from safetensors import safe_open
names = list(safe_open('$tmp/$arch/resident/adapter_model.safetensors', 'np').keys())
sys.exit(0 if any('.mlp.shared_mlp.gate_proj.lora_A' in n for n in names) and any('.experts.0.up_proj.lora_B' in n for n in names) else 1)"
    continue
  fi
  check "$arch: adapter has shared-expert LoRA" "$py" -c "
import sys; from safetensors import safe_open
f = safe_open('$tmp/$arch/resident/adapter_model.safetensors', 'np'); names = list(f.keys())
sys.exit(0 if any('.mlp.shared_experts.gate_proj.lora_A' in n for n in names) and any('.experts.0.up_proj.lora_B' in n for n in names) else 1)"
done
# The target modules of the families run here (CTest runs the families in groups).
ran() { [ -f "$tmp/$1/resident/adapter_config.json" ]; }
if ran deepseek_v2_grouped; then
  check "deepseek_v2_grouped: adapter targets q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj" "$py" -c "
import json, sys; t = json.load(open('$tmp/deepseek_v2_grouped/resident/adapter_config.json'))['target_modules']
sys.exit(0 if {'q_a_proj', 'q_b_proj', 'kv_a_proj_with_mqa', 'kv_b_proj', 'o_proj'} <= set(t) and 'k_proj' not in t else 1)"
fi
if ran deepseek_v3_yarn; then
  check "deepseek_v3_yarn: adapter targets q_proj" "$py" -c "
import json, sys; t = json.load(open('$tmp/deepseek_v3_yarn/resident/adapter_config.json'))['target_modules']
sys.exit(0 if 'q_proj' in t and 'q_a_proj' not in t else 1)"
fi
if ran gpt_oss; then
  check "gpt_oss: lora_target_linear is the attention" "$py" -c "
import json, sys; t = json.load(open('$tmp/gpt_oss/resident/adapter_config.json'))['target_modules']
sys.exit(0 if sorted(t) == ['k_proj', 'o_proj', 'q_proj', 'v_proj'] else 1)"
fi
[ $fail = 0 ] && echo "offload_arch: all checks passed" || { echo "offload_arch: FAILED"; for f in "$tmp"/*/*.log; do echo "== $f"; tail -3 "$f"; done; }
exit $fail
