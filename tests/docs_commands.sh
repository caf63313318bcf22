#!/usr/bin/env bash
# Every command README.md and docs/*.md show in a sh / bash block, and every python block, is run
# here as shown, on the bundled tiny model (CPU), or listed with the test that covers it (a GPU, a
# real model, MPI, a fresh machine). tests/docs_check.py then fails on a shown command that is
# neither, and checks the pages' lengths, widths, links and the generated config reference.
# Commands run in a scratch folder that looks like the source folder (configs/, fixtures/, tools/,
# build/ linked), so what they write stays there; `python3` is the build's Python. A command may get
# extra arguments that shorten it (max_steps, output_dir); it is otherwise run as the page shows it.
# Beside them: the checks of what the commands leave (adapter, metrics, plots, score's defaults).
# usage: docs_commands.sh BUILD_DIR SOURCE_DIR PYTHON
set -uo pipefail
source "$2/tests/testlib.sh"
eo_test_setup "$@"
build=$(cd "$1" && pwd)
work="$tmp/work"
mkdir -p "$work/docs" "$tmp/bin"
for d in configs fixtures tools scripts launch; do ln -s "$src/$d" "$work/$d"; done
ln -s "$build" "$work/build"
for name in python3 python; do printf '#!/bin/sh\nexec "%s" "$@"\n' "$py" >"$tmp/bin/$name"; chmod +x "$tmp/bin/$name"; done
export PATH="$tmp/bin:$PATH"
# my.yaml, as the README's "your config on your card" uses it: the tiny default under another name,
# moved beside the fixtures folder (its relative paths are relative to its own folder).
sed -e 's#^output_dir: .*#output_dir: ./model-out/my-run#' -e 's#\.\./fixtures/#fixtures/#' \
  configs/tiny-qwen3-moe.yaml >"$work/my.yaml"
accounted="$tmp/accounted.tsv"
: >"$accounted"

# run SHOWN [EXTRA...]: the command as a page shows it (plus EXTRA arguments), in the scratch folder.
run() {
  local shown=$1
  shift
  printf 'run\t%s\n' "$shown" >>"$accounted"
  local log="$tmp/run-$(wc -l <"$accounted").log"
  local extra=""
  [ $# -gt 0 ] && extra=$(printf ' %q' "$@")
  if (cd "$work" && eval "timeout 600 $shown$extra") >"$log" 2>&1; then
    echo "ok: $shown"
  else
    echo "FAILED: $shown $* (exit $?):"
    tail -n 20 "$log"
    fail=1
  fi
}
# covered SHOWN WHY: not run here; WHY names what runs it.
covered() { printf 'covered\t%s\t%s\n' "$1" "$2" >>"$accounted"; }
# python FILE N: the N-th python block of FILE, run with the build's Python in the scratch folder.
python_block() {
  printf 'python\t%s:%s\n' "$1" "$2" >>"$accounted"
  "$py" tests/docs_check.py block "$1" python "$2" >"$tmp/block.py"
  if (cd "$work" && "$py" "$tmp/block.py") >"$tmp/block.log" 2>&1; then
    echo "ok: python block $2 of $1"
  else
    echo "FAILED: python block $2 of $1:"
    tail -n 20 "$tmp/block.log"
    fail=1
  fi
}
short=(--set max_steps=4 --set save_steps=2)

# What scripts/quickstart trains (then a re-run of it, which replaces its own output).
check "train the bundled tiny model" bash -c "cd '$work' && timeout 300 build/eo-ddp --config configs/tiny-qwen3-moe.yaml ${short[*]}"
out="$work/model-out/tiny-qwen3-moe"
check "the adapter and metrics are there" test -s "$out/adapter_model.safetensors" -a -s "$out/adapter_config.json" -a -s "$out/metrics.jsonl"
check "a quickstart re-run replaces its own output" bash -c "cd '$work' && timeout 300 build/eo-ddp \
  --config configs/tiny-qwen3-moe.yaml ${short[*]} --set overwrite_output_dir=true"

# README.md
covered "scripts/quickstart" "installs Debian packages and a venv on a fresh machine: run by hand; its training command is run above"
covered "scripts/test" "CI (.ci/run runs it)"
run "build/eo-ddp plan --config my.yaml --vram 24GiB"
run "build/eo-ddp --config my.yaml --check"
run "build/eo-ddp --config my.yaml" "${short[@]}"
check "my.yaml's adapter" test -s "$work/model-out/my-run/adapter_model.safetensors"
python_block README.md 1

# docs/install.md: the GPU paths run on a GPU machine (scripts/device-install-check), pip on the CPU in CI
# (scripts/pip-check); the CPU quickstart's training command is run above.
covered "EO_DDP_PYTHON=~/venvs/axolotl/bin/python scripts/quickstart" "a GPU: scripts/device-install-check runs it with python3"
covered "EO_CUDA_ARCHS=default scripts/quickstart" "the default architecture list: scripts/device-install-check's pip build; CI's scripts/cuda-check reads it back"
covered "scripts/bootstrap" "CI: scripts/test runs it first on a fresh machine"
covered "python -m pip install --no-build-isolation ." "scripts/pip-check (fresh venv, CPU; in CI) and scripts/device-install-check (GPU)"
covered "eo-ddp --version" "scripts/pip-check and scripts/device-install-check run the installed one"
covered "CUDAARCHS=native python -m pip install --no-build-isolation ." "CUDAARCHS is CMake's: scripts/device-install-check builds the default list; quickstart builds native"
covered "cmake -S . -B build-cuda -G Ninja -DEO_WITH_CUDA=ON -DEO_DDP_PYTHON=\"\$(command -v python)\" -DCMAKE_CUDA_ARCHITECTURES=86" "scripts/device-install-check (by-hand, for sm_90)"
covered "ninja -C build-cuda eo-ddp" "scripts/device-install-check (by-hand)"

# docs/quickstart.md
run "build/eo-ddp --config configs/tiny-qwen3-moe.yaml --check"
run "build/eo-ddp --config configs/tiny-qwen3-moe-offload.yaml" "${short[@]}"
run "build/eo-ddp preprocess --config configs/tiny-qwen3-moe-chat.yaml"
run "build/eo-ddp --config configs/tiny-qwen3-moe-chat.yaml" --set max_steps=4 --set eval_steps=2
check "the chat run's metrics have the eval loss" grep -q eval_loss "$work/model-out/tiny-qwen3-moe-chat/metrics.jsonl"
run "build/eo-ddp --config configs/tiny-qwen3-moe.yaml --set lora_r=32 --set gradient_checkpointing_kwargs.use_reentrant=false" \
  --set max_steps=2 --set save_steps=0 --set output_dir=model-out/r32
run "python3 tools/plot_metrics.py model-out/tiny-qwen3-moe/metrics.jsonl"
check "the plot is a PNG" sh -c "ls '$out'/*.png >/dev/null 2>&1 || ls '$work'/*.png >/dev/null 2>&1"
run "build/eo-ddp score --model fixtures/tiny-qwen3-moe --adapter model-out/tiny-qwen3-moe --data fixtures/tiny-data/train.jsonl"
python_block docs/quickstart.md 1

covered "cmake --install build --prefix ~/.local" "install_mission installs to a temporary prefix and trains from another folder"

# docs/runs.md
run "build/eo-ddp score --model fixtures/tiny-qwen3-moe --adapter model-out/tiny-qwen3-moe --data fixtures/tiny-data/train.jsonl --json"
# A QLoRA adapter is scored on the NF4 base it was trained on, unless told otherwise.
score() { (cd "$work" && build/eo-ddp score --model fixtures/tiny-qwen3-moe --adapter "$out" --data fixtures/tiny-data/train.jsonl --json "$@"); }
default=$(score 2>"$tmp/score-default.log"); nf4=$(score --load-in-4bit 2>/dev/null); dense=$(score --no-load-in-4bit 2>/dev/null)
check "score --adapter defaults to the NF4 base the adapter was trained on" test -n "$default" -a "$default" = "$nf4"
check "and says so" grep -q "NF4, as the adapter was trained" "$tmp/score-default.log"
check "--no-load-in-4bit scores on the stored weights (a different loss)" test -n "$dense" -a "$default" != "$dense"
# The eval rows written to output_dir score to the eval loss's data (datasets.md: Evaluation).
check "score the chat run's eval rows" bash -c "cd '$work' && timeout 300 build/eo-ddp score --model fixtures/tiny-qwen3-moe \
  --adapter model-out/tiny-qwen3-moe-chat --data model-out/tiny-qwen3-moe-chat/eval.jsonl"
# The base model's tokenizer files (and chat template) are copied beside the adapter.
cp -r fixtures/tiny-qwen3-moe "$tmp/model-with-tokenizer"
printf '{"chat_template": "{{ messages }}", "model_max_length": 512}\n' >"$tmp/model-with-tokenizer/tokenizer_config.json"
printf '{%% for m in messages %%}{{ m.content }}{%% endfor %%}\n' >"$tmp/model-with-tokenizer/chat_template.jinja"
check "train on a model folder with a tokenizer" timeout 300 "$bin" --config configs/tiny-qwen3-moe.yaml --set max_steps=2 \
  --set save_steps=0 --set base_model="$tmp/model-with-tokenizer" --set output_dir="$tmp/with-tok"
for f in tokenizer_config.json chat_template.jinja; do
  check "$f copied beside the adapter" cmp "$tmp/model-with-tokenizer/$f" "$tmp/with-tok/$f"
done

# docs/runs.md: trackers
covered "tensorboard --logdir model-out/tiny-qwen3-moe/runs" "trackers_ref reads the events back with tensorboard's own EventAccumulator"

# docs/after-training.md
run "build/eo-ddp generate --model fixtures/tiny-qwen3-moe --adapter model-out/tiny-qwen3-moe --prompt \"Tell me about the sea.\"" --max-new-tokens 8
run "build/eo-ddp generate --model fixtures/tiny-qwen3-moe --adapter model-out/tiny-qwen3-moe --prompt \"Tell me about the sea.\" --expert-offload" --max-new-tokens 8
check "generate --expert-offload streams the experts" grep -q "experts streamed:" "$tmp/run-$(wc -l <"$accounted").log"
covered "OUT=generate-out scripts/device-generate" "a GPU and Qwen3-30B-A3B shapes; generate_kv_ref checks offloaded experts give the tokens of held ones"
run "build/eo-ddp merge --model fixtures/tiny-qwen3-moe --adapter model-out/tiny-qwen3-moe --output model-out/tiny-merged"
check "the merged folder has config.json and the tokenizer" test -s "$work/model-out/tiny-merged/config.json" \
  -a -s "$work/model-out/tiny-merged/tokenizer.json"
run "build/eo-ddp merge --model fixtures/tiny-qwen3-moe --adapter model-out/tiny-qwen3-moe --output model-out/tiny-merged-as-trained --base as-trained --dtype fp32"
python_block docs/after-training.md 1
python_block docs/after-training.md 2
covered "vllm serve model-out/tiny-merged" "vLLM needs a GPU and is not installed on the test machines; merge_ref_* check the folder loads in transformers with no missing or unexpected key"
covered "python -m sglang.launch_server --model-path model-out/tiny-merged" "SGLang: as vLLM; merge_ref_* check the folder transformers loads"
covered "vllm serve fixtures/tiny-qwen3-moe --enable-lora --lora-modules tiny=model-out/tiny-qwen3-moe" "vLLM: as above; train_peft_check checks the attention adapter is peft's own"

# docs/datasets.md
run "python3 tools/tokenize_data.py --tokenizer fixtures/tiny-qwen3-moe --input fixtures/tiny-chat/chat.jsonl --output chat.tok.jsonl"
check "tokenize_data wrote tokenized rows" grep -q input_ids "$work/chat.tok.jsonl"
covered "hf download Qwen/Qwen3-30B-A3B" "needs the Hub: hub_cache trains from a cache laid out as it fills one, offline"
covered "hf download --repo-type dataset mlabonne/FineTome-100k" "needs the Hub: hub_cache reads a dataset from such a cache"

# docs/memory-and-offload.md
run "build/eo-ddp plan --config configs/bench/qwen3-30b-a3b-offload.yaml --vram 24GiB --host-ram 64GiB"

# docs/step-time.md
run "build/eo-ddp plan --config configs/bench/qwen3-30b-a3b-offload.yaml --card 4090"
run "build/eo-ddp plan --config configs/bench/qwen3-30b-a3b-offload.yaml --card-figures bf16_tflops=165.2,mem_gbps=1008,link_gbps=24,vram_gib=24"

# docs/multi-gpu.md
covered "mpirun -np 8 build/eo-ddp --config my.yaml" "MPI and GPUs: mpi_train and install_mission run mpirun -np 2 / 3 on CPU ranks"
covered "srun -n 16 --mpi=pmix build/eo-ddp --config my.yaml" "Slurm: none on the test machines; ranks start as under mpirun (mpi_train)"
covered "launch/eo-mpirun -np 8 build/eo-ddp --config my.yaml" "MPI: test_faults_mpi stops a 2-rank job launched with launch/eo-mpirun"

# docs/contributing.md
covered "scripts/test -L unit" "CI (.ci/run runs scripts/test, every label)"
covered "scripts/test -L mpi" "CI (.ci/run runs scripts/test, every label)"
covered "scripts/test -L ref" "CI (.ci/run runs scripts/test, every label)"
covered "scripts/sanitize" "CI (.ci/run)"
covered "scripts/fuzz 60" "CI (.ci/run runs scripts/fuzz with its own bound)"
covered "scripts/build -DCMAKE_PREFIX_PATH=\"\$(python -c 'import torch;print(torch.utils.cmake_prefix_path)')\"" \
  "a CUDA torch: scripts/device-check configures the GPU build with this prefix"
run "build/eo-ddp --help-axolotl-keys > docs/axolotl-keys.md"
check "docs/axolotl-keys.md is eo-ddp --help-axolotl-keys as printed" cmp "$work/docs/axolotl-keys.md" docs/axolotl-keys.md

# Every page: each command above is still shown, each shown command is here; lengths, widths,
# links, and docs/configuration.md holding --help-config's output.
"$bin" --help-config --markdown >"$tmp/help-config.md"
if "$py" tests/docs_check.py check "$src" "$accounted" "$tmp/help-config.md"; then echo "ok: docs_check"; else fail=1; fi

[ $fail = 0 ] && echo "docs_commands: all checks passed" || echo "docs_commands: FAILED"
exit $fail
