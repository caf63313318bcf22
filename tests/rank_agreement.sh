#!/usr/bin/env bash
# Ranks given different runs stop before anything is loaded (issue: ranks that disagree). Two
# ranks (mpirun's MPMD form: one argument list per rank) with one key different, for each kind of
# key: the adapter's shape (lora_r, targets), the data shards (seed, micro_batch_size, sequence_len,
# the dataset's contents), the optimisation (learning_rate, max_steps, max_grad_norm, lora_dropout),
# the schedule of saves, the output folder and the base model's contents (one byte of one tensor). Each must exit 2, name the key with both ranks'
# values, write nothing into output_dir, and load no weight. A control with equal arguments trains.
# usage: rank_agreement.sh BUILD_DIR SOURCE_DIR PYTHON
set -uo pipefail
source "$2/tests/testlib.sh"
eo_test_setup "$@"
export XDG_CACHE_HOME="$tmp/cache"  # the base model's content hashes (runtime/model_identity.h)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
mpirun="mpirun --oversubscribe --bind-to none"
cp fixtures/tiny-data/train.jsonl "$tmp/other.jsonl"
echo '{"input_ids": [1, 5, 6, 7, 2]}' >>"$tmp/other.jsonl"
common=(--config configs/tiny-qwen3-moe.yaml --set max_steps=2 --set save_steps=0)

differ() {  # name key-regex --set-for-rank-1
  local name=$1 key=$2 set=$3
  local out="$tmp/$name"
  timeout 120 $mpirun -np 1 "$bin" "${common[@]}" --set output_dir="$out" : \
    -np 1 "$bin" "${common[@]}" --set output_dir="$out" --set "$set" >"$tmp/$name.log" 2>&1
  local rc=$?
  check "$name: exit 2 (got $rc)" test "$rc" = 2
  check "$name: names $key with both ranks" grep -qE "^ *$key: rank 0 has .*, rank 1 has " "$tmp/$name.log"
  check "$name: no weight loaded" bash -c "! grep -q '^.*loading ' '$tmp/$name.log'"
  check "$name: nothing written to output_dir" bash -c "[ ! -e '$out' ] || [ -z \"\$(ls -A '$out')\" ]"
  [ "$rc" = 2 ] || tail -5 "$tmp/$name.log"
}

differ lora_r "lora_r" lora_r=4
differ targets "lora_target_modules.3" "lora_target_modules=[q_proj, k_proj, v_proj]"
differ seed "seed" seed=7
differ micro_batch "micro_batch_size" micro_batch_size=2
differ sequence_len "sequence_len" sequence_len=64
differ dataset "datasets.0 contents" "datasets.0.path=$tmp/other.jsonl"  # compared by contents, not path
differ lr "learning_rate" learning_rate=1e-4
differ max_steps "max_steps" max_steps=3
differ clip "max_grad_norm" max_grad_norm=0.5
differ dropout "lora_dropout" lora_dropout=0.1
differ save_steps "save_steps" save_steps=1
differ output_dir "output_dir" "output_dir=$tmp/elsewhere"
# The base model: a copy with one byte of one tensor changed where the sampled fingerprint of
# earlier versions (16 windows of 4 KiB) never looked.
cp -r fixtures/tiny-qwen3-moe "$tmp/model2"
"$py" - "$tmp/model2/model.safetensors" <<'PY'
import struct, sys
path = sys.argv[1]
data = bytearray(open(path, "rb").read())
size, start = len(data), 8 + struct.unpack("<Q", data[:8])[0]
windows = [((size - 4096) // 15 * w, (size - 4096) // 15 * w + 4096) for w in range(16)]
pos = next(p for p in range(start, size) if not any(a <= p < b for a, b in windows))
data[pos] ^= 0x01
open(path, "wb").write(data)
PY
differ base_model "base model contents" "base_model=$tmp/model2"

# Control: the same arguments on both ranks train.
timeout 300 $mpirun -np 1 "$bin" "${common[@]}" --set output_dir="$tmp/same" : \
  -np 1 "$bin" "${common[@]}" --set output_dir="$tmp/same" >"$tmp/same.log" 2>&1
check "equal ranks train (rc $?)" test -f "$tmp/same/adapter_model.safetensors"

[ $fail = 0 ] && echo "rank_agreement: all checks passed"
exit $fail
