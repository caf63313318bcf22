#!/usr/bin/env bash
# The mission's command as written (issue #16 item 6): `cmake --install` to a temporary prefix, then
# from another folder, with the installed eo-ddp on the PATH, `mpirun -np 2 eo-ddp --config
# qwen3-moe.yaml` on a copy of configs/qwen3-moe.yaml pointed at the tiny fixture and a chat JSONL
# (CPU ranks). Rank 0 tokenises the chat data with the installed tools/prepare_data.py while rank 1
# waits; the run evaluates, saves and writes an adapter with the tokenizer beside it.
# usage: install_mission.sh BUILD_DIR SOURCE_DIR PYTHON
set -uo pipefail
source "$2/tests/testlib.sh"
eo_test_setup "$@"
build=$(cd "$1" && pwd)
py=$( [ -e "$py" ] && realpath -s "$py" || command -v "$py")
prefix="$tmp/prefix"
check "cmake --install build --prefix P" cmake --install "$build" --prefix "$prefix"
for f in bin/eo-ddp bin/eo-mpirun share/eo-ddp/tools/prepare_data.py share/eo-ddp/tools/plot_metrics.py \
         share/eo-ddp/tools/wandb_follow.py share/eo-ddp/tools/chat_io.py \
         share/eo-ddp/configs/qwen3-moe.yaml share/eo-ddp/configs/olmoe.yaml share/eo-ddp/configs/mixtral.yaml; do
  check "installed $f" test -s "$prefix/$f"
done
work="$tmp/elsewhere"
mkdir -p "$work"
cp "$src/fixtures/tiny-chat/chat.jsonl" "$work/chat.jsonl"
# The config as shipped, pointed at the tiny model; the run shortened for a CPU test.
sed -e "s#^base_model: .*#base_model: $src/fixtures/tiny-qwen3-moe#" "$prefix/share/eo-ddp/configs/qwen3-moe.yaml" >"$work/qwen3-moe.yaml"
check "the config's dataset path is ./chat.jsonl" grep -q "path: ./chat.jsonl" "$work/qwen3-moe.yaml"
cd "$work" || exit 1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export PATH="$prefix/bin:$PATH"
unset EO_DDP_TOOLS_DIR
timeout 600 mpirun --oversubscribe --bind-to none -np 2 eo-ddp --config qwen3-moe.yaml --set max_steps=4 \
  --set sequence_len=256 --set gradient_accumulation_steps=1 --set micro_batch_size=2 --set evals_per_epoch=null \
  --set eval_steps=2 --set saves_per_epoch=null --set save_steps=2 >"$tmp/run.log" 2>&1
rc=$?
check "mpirun -np 2 eo-ddp --config qwen3-moe.yaml exits 0 ($rc)" test $rc = 0
check "the installed prepare_data.py tokenised the chat data" grep -q "running .* $prefix/share/eo-ddp/tools/prepare_data.py" "$tmp/run.log"
check "the cache is in ./last_run_prepared" sh -c "ls last_run_prepared/*/data.jsonl >/dev/null"
check "two ranks, identical LoRA" grep -q "LoRA identical on all 2 ranks" "$tmp/run.log"
check "eval loss in the progress line" grep -q "eval loss" "$tmp/run.log"
check "adapter written" test -s qwen3-moe-out/adapter_model.safetensors -a -s qwen3-moe-out/adapter_config.json
check "tokenizer beside the adapter" test -s qwen3-moe-out/tokenizer.json -a -s qwen3-moe-out/tokenizer_config.json
check "a checkpoint at step 2" test -d qwen3-moe-out/checkpoint-2
check "eval_loss in metrics.jsonl" grep -q eval_loss qwen3-moe-out/metrics.jsonl
check "eo-ddp score on the eval rows" eo-ddp score --model "$src/fixtures/tiny-qwen3-moe" --adapter qwen3-moe-out --data qwen3-moe-out/eval.jsonl
check "the installed plot tool" "$py" "$prefix/share/eo-ddp/tools/plot_metrics.py" qwen3-moe-out/metrics.jsonl
[ $fail = 0 ] && echo "install_mission: all checks passed" || { echo "install_mission: FAILED"; tail -30 "$tmp/run.log"; }
exit $fail
