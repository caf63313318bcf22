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
