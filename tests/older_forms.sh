#!/usr/bin/env bash
# A config in axolotl's older forms, as users still run them, passes --check and trains 3 steps on the
# tiny model, each older form noted with what it became; its prepared token ids and labels equal those
# of the same config written by hand in the current forms (which tests/axolotl_* check against
# axolotl). The older forms: type: sharegpt with and without conversation:, sharegpt:chat, the named
# templates inst / llama3 / mistral_v2v3, path: json with data_files, shards, a dataset without a type
# (ds_type: json), fractional save_steps, model_config overrides of config.json, and keys that change
# nothing trained (debug, report_to, use_auth_token, eval_dataset, hub_model_id, push_to_hub).
# usage: older_forms.sh BUILD_DIR SOURCE_DIR PYTHON
set -uo pipefail
source "$2/tests/testlib.sh"
eo_test_setup "$@"

data=$src/fixtures/tiny-chat
# inst renders user and assistant turns only: its rows are sharegpt's without the system turn.
"$py" - "$data/sharegpt.jsonl" "$tmp/sharegpt-no-system.jsonl" <<'PY'
import json, sys
with open(sys.argv[1]) as f, open(sys.argv[2], "w") as out:
    for line in f:
        row = json.loads(line)
        row["conversations"] = [t for t in row["conversations"] if t["from"] != "system"]
        out.write(json.dumps(row) + "\n")
PY
common() {  # NAME
  printf 'base_model: %s/fixtures/tiny-qwen3-moe\nload_in_4bit: true\nadapter: qlora\nlora_r: 4\nlora_alpha: 8\n' "$src"
  printf 'lora_target_modules: [q_proj, v_proj]\nsequence_len: 256\nmicro_batch_size: 2\nmax_steps: 3\n'
  printf 'learning_rate: 1.0e-3\nseed: 7\nlogging_steps: 1\noutput_dir: %s/out-%s\ndataset_prepared_path: %s/prepared\n' \
    "$tmp" "$1" "$tmp"
  # llama3's template starts with bos_token, which the tiny tokenizer lacks (transformers' own
  # apply_chat_template fails there too).
  printf 'special_tokens: {bos_token: "<|endoftext|>"}\n'
}
{
  common older
  cat <<EOF
chat_template: llama3
save_steps: 0.5
model_config:
  rope_theta: 20000
  max_position_embeddings: 4096
debug: true
report_to: wandb
use_auth_token: true
eval_dataset: held_out.jsonl
hub_model_id: me/tiny-adapter
push_to_hub: true
datasets:
  - path: $data/sharegpt.jsonl
    type: sharegpt
  - path: $data/sharegpt.jsonl
    type: sharegpt
    conversation: chatml
  - path: $tmp/sharegpt-no-system.jsonl
    type: sharegpt
    chat_template: inst
  - path: $data/sharegpt.jsonl
    type: sharegpt:chat
    chat_template: mistral_v2v3
  - path: json
    data_files: $data/alpaca.jsonl
    type: alpaca
    shards: 2
    shards_idx: 1
  - path: $src/fixtures/tiny-data/train.jsonl
    ds_type: json
EOF
} >"$tmp/older.yaml"
chat='type: chat_template\n    field_messages: conversations\n    message_property_mappings: {role: from, content: value}'
{
  common current
  printf 'save_steps: 2\noverrides_of_model_config: {rope_theta: 20000, max_position_embeddings: 4096}\ndatasets:\n'
  printf "  - path: %s\n    $chat\n    chat_template: %s\n" "$data/sharegpt.jsonl" llama3 "$data/sharegpt.jsonl" chatml \
    "$tmp/sharegpt-no-system.jsonl" inst "$data/sharegpt.jsonl" mistral_v2v3
  printf '  - path: %s\n    type: alpaca\n    shards: 2\n    shards_idx: 1\n' "$data/alpaca.jsonl"
  printf '  - path: %s/fixtures/tiny-data/train.jsonl\n    type: tokenized\n' "$src"
} >"$tmp/current.yaml"

"$bin" train --check --config "$tmp/older.yaml" >"$tmp/check.log" 2>&1
rc=$?
check "the older config passes --check (exit $rc)" test $rc -eq 0
notes=(
  "datasets.0: type: sharegpt (axolotl's removed sharegpt loader) became type: chat_template, field_messages: conversations"
  "datasets.1: type: sharegpt (axolotl's removed sharegpt loader) became type: chat_template"
  "chat_template: chatml (from conversation: chatml)"
  "datasets.3: type: sharegpt:chat"
  "datasets.4: path: json with data_files: $data/alpaca.jsonl became path: $data/alpaca.jsonl"
  "datasets.5: no type: read as pre-tokenized rows (input_ids, labels)"
  "config.json's rope_parameters.rope_theta: 10000.0 -> 20000, max_position_embeddings: 512 -> 4096, as axolotl sets them"
  "'debug' is ignored by eo-ddp" "'report_to' is ignored by eo-ddp" "'use_auth_token' is ignored by eo-ddp"
  "'eval_dataset' is ignored by eo-ddp" "'hub_model_id' is ignored by eo-ddp" "'push_to_hub' is ignored by eo-ddp"
)
for n in "${notes[@]}"; do check "noted: $n" grep -qF -- "$n" "$tmp/check.log"; done
check "the resolved config shows save_steps: 0.5" grep -q "^save_steps: 0.5" "$tmp/check.log"

# The same token ids and labels as the current forms: each prepared file compared row by row.
prepared() {  # CONFIG -> the prepared files, one a line
  "$bin" preprocess --config "$1" 2>"$1.err" | sed -n 's/.* -> //p'
}
mapfile -t older < <(prepared "$tmp/older.yaml")
mapfile -t current < <(prepared "$tmp/current.yaml")
check "5 datasets prepared from each config (older ${#older[@]}, current ${#current[@]})" \
  test "${#older[@]}" -eq 5 -a "${#current[@]}" -eq 5
names=(sharegpt-llama3 sharegpt-chatml sharegpt-inst sharegpt:chat-mistral_v2v3 json-data_files-shards)
for i in 0 1 2 3 4; do
  check "${names[$i]}: token ids and labels == the current form's" "$py" - "${older[$i]:-none}" "${current[$i]:-none}" <<'PY'
import json, sys
rows = [[(r["input_ids"], r["labels"]) for r in map(json.loads, open(p))] for p in sys.argv[1:]]
sys.exit(0 if rows[0] == rows[1] and len(rows[0]) > 0 and any(l != -100 for _, ls in rows[0] for l in ls) else 1)
PY
done

"$bin" train --config "$tmp/older.yaml" >"$tmp/train.log" 2>&1
rc=$?
check "the older config trains (exit $rc)" test $rc -eq 0
check "3 steps ran" "$py" -c "import json,sys; s=[json.loads(l)['step'] for l in open(sys.argv[1])]; sys.exit(s[-1] != 3)" \
  "$tmp/out-older/metrics.jsonl"
check "save_steps: 0.5 of 3 steps saved at step 2 (ceil(1.5), as transformers rounds)" test -d "$tmp/out-older/checkpoint-2"
check "and only there" test ! -d "$tmp/out-older/checkpoint-1"

# An override that changes the weights' shapes is a config error, before any weight is read.
"$bin" train --check --config "$tmp/older.yaml" --set model_config.num_attention_heads=8 >"$tmp/shape.log" 2>&1
rc=$?
check "an override of the attention heads: exit 2 (got $rc)" test $rc -eq 2
check "it names the key and what changes" grep -qF "overrides_of_model_config: overrides_of_model_config (" "$tmp/shape.log"
check "it says the heads change" grep -qF "changes the attention projections' shapes" "$tmp/shape.log"

[ $fail -eq 0 ] && echo "older_forms: all checks passed"
exit $fail
