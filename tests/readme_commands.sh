#!/usr/bin/env bash
# The commands the README shows, as a user runs them, on the bundled tiny model (CPU): train (and a
# re-run into the same output_dir as quickstart does it), --check, plan, score with the adapter, and
# the metrics plot, and the tiny chat config (preprocess, train with eval, score, plot). Each must
# exit 0 and leave what the README says it leaves. `cmake --install` and `mpirun -np 2 eo-ddp --config
# qwen3-moe.yaml` from another folder are tests/install_mission.sh.
# usage: readme_commands.sh BUILD_DIR SOURCE_DIR PYTHON
set -uo pipefail
source "$2/tests/testlib.sh"
eo_test_setup "$@"
out="$tmp/tiny"
short=(--set max_steps=4 --set save_steps=2 --set output_dir="$out")
check "train the bundled tiny model" timeout 300 "$bin" --config configs/tiny-qwen3-moe.yaml "${short[@]}"
check "the adapter and metrics are there" test -s "$out/adapter_model.safetensors" -a -s "$out/adapter_config.json" -a -s "$out/metrics.jsonl"
check "a quickstart re-run replaces its own output" timeout 300 "$bin" --config configs/tiny-qwen3-moe.yaml "${short[@]}" --set overwrite_output_dir=true
check "--check" timeout 60 "$bin" --config configs/tiny-qwen3-moe.yaml --check
check "plan" timeout 60 "$bin" plan --config configs/tiny-qwen3-moe-offload.yaml --vram 8GiB
check "score with the adapter" timeout 300 "$bin" score --model fixtures/tiny-qwen3-moe --adapter "$out" --data fixtures/tiny-data/train.jsonl --json
# A QLoRA adapter is scored on the NF4 base it was trained on, unless told otherwise.
score() { "$bin" score --model fixtures/tiny-qwen3-moe --adapter "$out" --data fixtures/tiny-data/train.jsonl --json "$@"; }
default=$(score 2>"$tmp/score-default.log"); nf4=$(score --load-in-4bit 2>/dev/null); dense=$(score --no-load-in-4bit 2>/dev/null)
check "score --adapter defaults to the NF4 base the adapter was trained on" test -n "$default" -a "$default" = "$nf4"
check "and says so" grep -q "NF4, as the adapter was trained" "$tmp/score-default.log"
check "--no-load-in-4bit scores on the stored weights (a different loss)" test -n "$dense" -a "$default" != "$dense"
# The base model's tokenizer files (and chat template) are copied beside the adapter.
cp -r fixtures/tiny-qwen3-moe "$tmp/model-with-tokenizer"
printf '{"chat_template": "{{ messages }}", "model_max_length": 512}\n' >"$tmp/model-with-tokenizer/tokenizer_config.json"
printf '{%% for m in messages %%}{{ m.content }}{%% endfor %%}\n' >"$tmp/model-with-tokenizer/chat_template.jinja"
check "train on a model folder with a tokenizer" timeout 300 "$bin" --config configs/tiny-qwen3-moe.yaml --set max_steps=2 \
  --set save_steps=0 --set base_model="$tmp/model-with-tokenizer" --set output_dir="$tmp/with-tok"
for f in tokenizer_config.json chat_template.jinja; do
  check "$f copied beside the adapter" cmp "$tmp/model-with-tokenizer/$f" "$tmp/with-tok/$f"
done
# Datasets as axolotl writes them: preprocess, then train with an eval loss (README "Data").
chat=(--config configs/tiny-qwen3-moe-chat.yaml --set dataset_prepared_path="$tmp/prepared")
check "preprocess the tiny chat config" timeout 300 "$bin" preprocess "${chat[@]}"
check "train the tiny chat config" timeout 300 "$bin" "${chat[@]}" --set max_steps=4 --set eval_steps=2 --set output_dir="$tmp/chat"
check "its metrics have the eval loss" grep -q eval_loss "$tmp/chat/metrics.jsonl"
check "score its eval rows" timeout 300 "$bin" score --model fixtures/tiny-qwen3-moe --adapter "$tmp/chat" --data "$tmp/chat/eval.jsonl"
check "plot the chat metrics" "$py" tools/plot_metrics.py "$tmp/chat/metrics.jsonl"
check "plot the metrics (tools/plot_metrics.py)" "$py" tools/plot_metrics.py "$out/metrics.jsonl"
check "the plot is a PNG" sh -c "ls '$out'/*.png >/dev/null 2>&1 || ls '$tmp'/*.png >/dev/null 2>&1"
[ $fail = 0 ] && echo "readme_commands: all checks passed" || echo "readme_commands: FAILED"
exit $fail
