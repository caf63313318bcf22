#!/usr/bin/env bash
# Issue #31: the axolotl-style configs of tests/axolotl_examples, with only BASE_MODEL and DATA
# replaced (a tiny checkpoint of the file's architecture, made by tools/make_tiny_model.py with the
# tiny tokenizer, and the tiny chat data). Each must do what its `# expect:` line says under
# --check: ok (then it trains 3 steps on the CPU) or refused with exactly that reason (exit 2).
# usage: axolotl_examples.sh BUILD_DIR SOURCE_DIR PYTHON
source "$(dirname "$0")/testlib.sh"
eo_test_setup "$@"
for cfg in "$src"/tests/axolotl_examples/*.yaml; do
  name=$(basename "$cfg" .yaml)
  arch=${name%%-*}
  model=$tmp/models/$arch
  if [ ! -d "$model" ]; then
    "$py" tests/ref/tiny_model.py --arch "$arch" --out "$model" >/dev/null 2>&1 || { echo "FAILED: $name: tiny $arch"; fail=1; continue; }
    cp fixtures/tiny-qwen3-moe/tokenizer.json fixtures/tiny-qwen3-moe/tokenizer_config.json "$model/"
  fi
  sed -e "s#BASE_MODEL#$model#" -e "s#DATA#$src/fixtures/tiny-chat/chat.jsonl#" "$cfg" > "$tmp/$name.yaml"
  expect=$(sed -n 's/^# expect: //p' "$cfg")
  sets=(--set "output_dir=$tmp/out-$name" --set "dataset_prepared_path=$tmp/prepared")
  "$bin" --config "$tmp/$name.yaml" --check "${sets[@]}" > "$tmp/$name.check" 2>&1
  rc=$?
  if [ "$expect" = ok ]; then
    if [ $rc -ne 0 ]; then echo "FAILED: $name: --check exit $rc"; sed 's/^/    /' "$tmp/$name.check" | head -20; fail=1; continue; fi
    echo "ok: $name passes --check"
    if "$bin" --config "$tmp/$name.yaml" "${sets[@]}" --set max_steps=3 > "$tmp/$name.train" 2>&1 &&
       grep -q "step 3/3" "$tmp/$name.train"; then
      echo "ok: $name trains 3 steps"
    else
      echo "FAILED: $name: training"; tail -15 "$tmp/$name.train" | sed 's/^/    /'; fail=1
    fi
  else
    reason=${expect#refused: }
    if [ $rc -eq 2 ] && grep -qF -- "$reason" "$tmp/$name.check"; then
      echo "ok: $name is refused: $reason"
    else
      echo "FAILED: $name: expected exit 2 with '$reason', got $rc"; sed 's/^/    /' "$tmp/$name.check" | head -20; fail=1
    fi
  fi
done
[ $fail -eq 0 ] && echo "axolotl_examples: all checks passed"
exit $fail
