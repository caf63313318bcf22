#!/usr/bin/env bash
# Issue #31's acceptance on axolotl's own example configs (tests/axolotl_examples/upstream, copied
# unchanged from axolotl 0.19.0 by tools/axolotl_corpus.py select): each is run with only base_model
# and the dataset paths replaced (tools/axolotl_corpus.py prepare: a tiny checkpoint of its
# architecture and a local file in its dataset's shape) and must do what expect.tsv says: ok (passes
# --check as written, then trains 3 steps of one micro-batch on the CPU), or refused / unsupported (exit 2, every listed text among
# the problems and every problem one of the listed texts).
# usage: axolotl_upstream.sh BUILD_DIR SOURCE_DIR PYTHON
#   (EO_UPSTREAM_ONLY="llama-4/ gpt-oss/": the rows under those paths only; CTest splits the corpus so)
source "$(dirname "$0")/testlib.sh"
eo_test_setup "$@"
corpus=$src/tests/axolotl_examples/upstream
declare -A count
while IFS=$'\t' read -r rel arch outcome texts; do
  [[ -z $rel || $rel == \#* ]] && continue
  if [ -n "${EO_UPSTREAM_ONLY:-}" ]; then
    mine=0
    for only in $EO_UPSTREAM_ONLY; do [[ $rel == "$only"* ]] && mine=1; done
    [ $mine = 1 ] || continue
  fi
  name=$(echo "${rel%.*}" | tr '/' '_')
  model=$tmp/models/$arch
  if [ ! -d "$model" ]; then
    "$py" tools/axolotl_corpus.py model "$arch" "$model" >/dev/null 2>&1 || { echo "FAILED: $rel: tiny $arch"; fail=1; continue; }
  fi
  # Each config lies and runs in a folder of its own: the relative output_dir / dataset_prepared_path
  # the configs share (./outputs/out, relative to the config's folder) land there, never in another's.
  run=$tmp/run/$name
  mkdir -p "$run"
  "$py" tools/axolotl_corpus.py prepare "$corpus/$rel" "$model" "$tmp/data" "$run/$name.yaml" ||
    { echo "FAILED: $rel: prepare"; fail=1; continue; }
  t0=$SECONDS
  (cd "$run" && "$bin" --config "$run/$name.yaml" --check > "$tmp/$name.check" 2>&1)
  rc=$?
  count[$outcome]=$(( ${count[$outcome]:-0} + 1 ))
  if [ "$outcome" = ok ]; then
    if [ $rc -ne 0 ]; then echo "FAILED: $rel: --check exit $rc"; sed 's/^/    /' "$tmp/$name.check" | head -20; fail=1; continue; fi
    # 3 optimizer steps of one micro-batch each (the CI's CPU time: the configs accumulate up to 8
    # packed sequences of 4096 tokens a step); --check above read the config as written.
    if (cd "$run" && "$bin" --config "$run/$name.yaml" --set max_steps=3 --set gradient_accumulation_steps=1 \
          > "$tmp/$name.train" 2>&1) &&
       grep -q "step 3/3" "$tmp/$name.train"; then
      echo "ok: $rel passes --check and trains 3 steps ($(( SECONDS - t0 )) s)"
    else
      echo "FAILED: $rel: training"; tail -15 "$tmp/$name.train" | sed 's/^/    /'; fail=1
    fi
    continue
  fi
  if [ $rc -ne 2 ]; then echo "FAILED: $rel: expected exit 2, got $rc"; sed 's/^/    /' "$tmp/$name.check" | head -20; fail=1; continue; fi
  IFS='|' read -ra want <<< "$texts"
  bad=0
  for w in "${want[@]}"; do
    w=$(echo "$w" | sed 's/^ *//; s/ *$//')
    grep -qF -- "$w" "$tmp/$name.check" || { echo "FAILED: $rel: '$w' not among the problems"; bad=1; }
  done
  # Every problem is one of the listed ones: nothing else stands between the config and a run.
  while IFS= read -r problem; do
    hit=0
    for w in "${want[@]}"; do
      w=$(echo "$w" | sed 's/^ *//; s/ *$//')
      [[ $problem == *"$w"* ]] && hit=1
    done
    [ $hit -eq 1 ] || { echo "FAILED: $rel: unexpected problem: $problem"; bad=1; }
  done < <(grep '^  - ' "$tmp/$name.check")
  if [ $bad -eq 0 ]; then echo "ok: $rel is $outcome: $texts"; else fail=1; fi
done < "$corpus/expect.tsv"
echo "axolotl_upstream: ${count[ok]:-0} pass and train, ${count[refused]:-0} refused, ${count[unsupported]:-0} unsupported architectures"
[ $fail -eq 0 ] && echo "axolotl_upstream: all checks passed"
exit $fail
