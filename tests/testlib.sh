# Sourced by the shell-driven tests: check LABEL COMMAND... prints ok/FAILED and records failure.
fail=0
check() {
  local label=$1
  shift
  if "$@" >/dev/null 2>&1; then echo "ok: $label"; else echo "FAILED: $label ($*)"; fail=1; fi
}
