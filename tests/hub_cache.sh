#!/usr/bin/env bash
# A model and a dataset named as on the Hub (org/name), present only in a Hugging Face cache laid
# out as huggingface_hub lays it out (refs/<revision> holding a commit, snapshots/<commit>/ files
# linked into blobs/), train with HF_HUB_OFFLINE=1; the adapter names the model as peft does.
# revision_of_model picks a ref. A name that is not cached, offline, is a config error (exit 2,
# before any weight is loaded) naming the cache folder searched and the command that downloads it.
# The download itself (huggingface_hub's snapshot_download) needs the network and is not run here.
# usage: hub_cache.sh BUILD_DIR SOURCE_DIR PYTHON
set -uo pipefail
source "$2/tests/testlib.sh"
eo_test_setup "$@"

# The cache, written as huggingface_hub writes it: each file a blob named by its sha256, linked
# from the snapshot with a relative link.
"$py" - "$tmp/hf/hub" "$src/fixtures/tiny-qwen3-moe" "$src/fixtures/tiny-chat/chat.jsonl" <<'PY'
import hashlib, os, shutil, sys
cache, model, chat = sys.argv[1:]
def repo(folder, files, commit, refs):
    root = os.path.join(cache, folder)
    for rel, source in files.items():
        data = open(source, "rb").read()
        blob = os.path.join(root, "blobs", hashlib.sha256(data).hexdigest())
        os.makedirs(os.path.dirname(blob), exist_ok=True)
        open(blob, "wb").write(data)
        link = os.path.join(root, "snapshots", commit, rel)
        os.makedirs(os.path.dirname(link), exist_ok=True)
        os.symlink(os.path.relpath(blob, os.path.dirname(link)), link)
    os.makedirs(os.path.join(root, "refs"), exist_ok=True)
    for ref in refs:
        open(os.path.join(root, "refs", ref), "w").write(commit)
repo("models--tiny-org--tiny-qwen3-moe", {f: os.path.join(model, f) for f in os.listdir(model)}, "a" * 40, ["main", "v1"])
repo("datasets--tiny-org--tiny-chat", {"data/train-00000-of-00001.jsonl": chat}, "b" * 40, ["main"])
PY
export HF_HOME=$tmp/hf HF_HUB_OFFLINE=1
unset HF_HUB_CACHE HUGGINGFACE_HUB_CACHE
mkdir -p "$tmp/run" && cd "$tmp/run" || exit 1
config() {  # MODEL EXTRA_YAML
  printf 'base_model: %s\nload_in_4bit: true\nadapter: qlora\nlora_r: 4\nlora_alpha: 8\n' "$1"
  printf 'lora_target_modules: [q_proj, v_proj]\nsequence_len: 128\nmicro_batch_size: 2\nmax_steps: 3\n'
  printf 'learning_rate: 1.0e-3\nseed: 7\nlogging_steps: 1\noutput_dir: %s/out\n' "$tmp/run"
  printf 'dataset_prepared_path: %s/prepared\ndatasets: [{path: tiny-org/tiny-chat, type: chat_template}]\n%s\n' "$tmp/run" "$2"
}

config tiny-org/tiny-qwen3-moe "revision_of_model: v1" >hub.yaml
"$bin" --config hub.yaml >train.log 2>&1
rc=$?
check "Hub names from the cache train (exit $rc)" test $rc -eq 0
check "the model is read from its snapshot" grep -q "base_model: tiny-org/tiny-qwen3-moe at v1 from the Hugging Face cache: $tmp/hf/hub/models--tiny-org--tiny-qwen3-moe/snapshots/aaaa" train.log
check "the dataset is read from its snapshot" grep -q "tiny-org/tiny-chat from the Hugging Face cache" train.log
check "3 steps ran" grep -qE "step 3/3|3/3" train.log
check "adapter_config.json names the Hub model" "$py" -c "import json,sys; sys.exit(json.load(open('out/adapter_config.json'))['base_model_name_or_path'] != 'tiny-org/tiny-qwen3-moe')"

absent() {  # LABEL CONFIG_FILE EXPECTED_TEXT...
  local label=$1 f=$2
  shift 2
  "$bin" --config "$f" >absent.log 2>&1
  local rc=$?
  check "$label: exit 2 (got $rc)" test $rc -eq 2
  for text in "$@"; do check "$label: says '$text'" grep -qF -- "$text" absent.log; done
  check "$label: before any weight is loaded" bash -c "! grep -qiE 'loading|quantis|safetensors' absent.log"
}
config tiny-org/absent-model "" >absent-model.yaml
absent "a model not cached" absent-model.yaml "base_model: 'tiny-org/absent-model'" \
  "$tmp/hf/hub/models--tiny-org--absent-model/refs/main" "HF_HUB_OFFLINE is set" "hf download tiny-org/absent-model"
config tiny-org/tiny-qwen3-moe "revision_of_model: nope" >absent-rev.yaml
absent "a revision not cached" absent-rev.yaml "models--tiny-org--tiny-qwen3-moe/refs/nope" \
  "hf download tiny-org/tiny-qwen3-moe --revision nope"
config tiny-org/tiny-qwen3-moe "" | sed 's#tiny-org/tiny-chat#tiny-org/absent-data#' >absent-data.yaml
absent "a dataset not cached" absent-data.yaml "datasets.0.path" "datasets--tiny-org--absent-data" \
  "hf download --repo-type dataset tiny-org/absent-data"

[ $fail -eq 0 ] && echo "hub_cache: all checks passed"
exit $fail
