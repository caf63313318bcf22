# Sourced by the shell-driven tests: check LABEL COMMAND... prints ok/FAILED and records failure.
fail=0
check() {
  local label=$1
  shift
  if "$@" >/dev/null 2>&1; then echo "ok: $label"; else echo "FAILED: $label ($*)"; fail=1; fi
}

# The common start of the shell-driven tests, given BUILD_DIR SOURCE_DIR PYTHON: sets bin (the
# eo-ddp binary), src and py, makes a temporary folder $tmp removed on exit, runs from the source
# folder with one intra-op thread.
eo_test_setup() {
  bin=$1/eo-ddp
  src=$2
  py=$3
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  cd "$src" || exit 1
  export OMP_NUM_THREADS=1
}

# The training-equality tests' helpers (expert_lora_offload.sh, expert_groups.sh). They read the caller's
# `common` (the eo-ddp arguments every run shares).
# run NAME RANKS [extra args]: eo-ddp into $tmp/NAME, under mpirun when RANKS > 1; a failure is recorded.
run() {
  local name=$1 ranks=$2
  shift 2
  local launch=()
  [ "$ranks" = 1 ] || launch=(mpirun --oversubscribe --bind-to none -np "$ranks")
  timeout 300 "${launch[@]}" "$bin" "${common[@]}" --set output_dir="$tmp/$name" "$@" >"$tmp/$name.log" 2>&1 ||
    { echo "run $name failed"; tail -5 "$tmp/$name.log"; fail=1; }
}
# same A B: the two runs' adapters are bitwise equal.
same() { "$py" tests/ref/compare_adapters.py "$1" "$2" --exact; }
# same_steps A B MIN_STEPS: every step's loss and gradient norm equal, at least MIN_STEPS of them, and every
# norm above 0.05 (the tests set max_grad_norm below it: clipping active).
same_steps() { "$py" - "$1" "$2" "$3" <<'PY'
import json, sys
rows = [[json.loads(l) for l in open(f"{d}/metrics.jsonl") if l.strip()] for d in sys.argv[1:3]]
a, b = ([(r["step"], r["loss"], r["grad_norm"]) for r in x if "loss" in r] for x in rows)
assert a == b and len(a) >= int(sys.argv[3]), (a, b)
assert all(n > 0.05 for _, _, n in a), a
PY
}
