#!/usr/bin/env bash
# axolotl's NVFP4 example (tests/axolotl_examples/upstream/qwen3/30b-a3b-nvfp4-lora.yaml) on a tiny
# NVFP4 Qwen3-MoE in modelopt's layout (tools/axolotl_corpus.py model qwen3_moe_nvfp4): as written,
# --check refuses only nvfp4_merge_aware (not implemented); without that line it passes, trains 3
# steps with the experts held in NVFP4, and `eo-ddp plan` counts them as NVFP4.
# usage: nvfp4_train.sh BUILD_DIR SOURCE_DIR PYTHON
source "$(dirname "$0")/testlib.sh"
eo_test_setup "$@"
rel=qwen3/30b-a3b-nvfp4-lora.yaml
model=$tmp/model
"$py" tools/axolotl_corpus.py model qwen3_moe_nvfp4 "$model" >/dev/null 2>&1 || { echo "FAILED: tiny NVFP4 model"; exit 1; }
"$py" tools/axolotl_corpus.py prepare "tests/axolotl_examples/upstream/$rel" "$model" "$tmp/data" "$tmp/as_written.yaml" ||
  { echo "FAILED: prepare"; exit 1; }
mkdir -p "$tmp/run"
(cd "$tmp/run" && "$bin" --config "$tmp/as_written.yaml" --check > "$tmp/as_written.check" 2>&1)
rc=$?
problems=$(grep -c '^  - ' "$tmp/as_written.check")
if [ $rc -eq 2 ] && [ "$problems" -eq 1 ] && grep -q '^  - nvfp4_merge_aware: not supported' "$tmp/as_written.check"; then
  echo "ok: as written, nvfp4_merge_aware is the one problem"
else
  echo "FAILED: as written: exit $rc, $problems problems"; sed 's/^/    /' "$tmp/as_written.check" | head -20; fail=1
fi
grep -v '^nvfp4_merge_aware:' "$tmp/as_written.yaml" > "$tmp/plain_lora.yaml"
if (cd "$tmp/run" && "$bin" --config "$tmp/plain_lora.yaml" --check > "$tmp/plain.check" 2>&1); then
  echo "ok: without nvfp4_merge_aware --check passes"
else
  echo "FAILED: --check without nvfp4_merge_aware"; sed 's/^/    /' "$tmp/plain.check" | head -20; fail=1
fi
if (cd "$tmp/run" && "$bin" plan --config "$tmp/plain_lora.yaml" > "$tmp/plan.txt" 2>&1) && grep -q "NVFP4" "$tmp/plan.txt"; then
  echo "ok: eo-ddp plan counts NVFP4 experts"
else
  echo "FAILED: plan"; sed 's/^/    /' "$tmp/plan.txt" | head -20; fail=1
fi
if (cd "$tmp/run" && "$bin" --config "$tmp/plain_lora.yaml" --set max_steps=3 --set gradient_accumulation_steps=1 \
      > "$tmp/train.log" 2>&1) && grep -q "step 3/3" "$tmp/train.log" && grep -q "NVFP4 linears held in NVFP4" "$tmp/train.log"; then
  echo "ok: trains 3 steps with NVFP4 experts"
else
  echo "FAILED: training"; tail -20 "$tmp/train.log" | sed 's/^/    /'; fail=1
fi
[ $fail -eq 0 ] && echo "nvfp4_train: all checks passed"
exit $fail
