#!/usr/bin/env bash
# `mypy --strict` as CTest python_mypy runs it, on a scratch copy of
# client/python with two errors planted in weightd/_client.py: a call with
# attach()'s former private keyword `_packed`, and a function without
# annotations. It must exit 1 and name exactly those two, so a config that
# stops checking (strict off, errors ignored) fails here.
# Usage: mypy_planted_test.sh PYTHON REPO CACHE_DIR
set -uo pipefail
python="$1" repo="$2" cache="$3"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
cp -r "$repo/client/python/pyproject.toml" "$repo/client/python/weightd" "$scratch/"
cat >> "$scratch/weightd/_client.py" <<'PLANTED'


def _planted_call() -> Model:
    return connect().attach("m", _packed=False)


def _planted_untyped(x):
    return x
PLANTED
out="$(cd "$scratch" && "$python" -m mypy --strict --config-file pyproject.toml --cache-dir "$cache" weightd 2>&1)"
rc=$?
passed=0 failed=0
check() {  # check NAME CONDITION...
  local name="$1"; shift
  if "$@"; then passed=$((passed + 1)); echo "ok: $name"; else failed=$((failed + 1)); echo "FAILED: $name"; fi
}
check "exit status 1 (got $rc)" test "$rc" -eq 1
check "the keyword is named" grep -qF 'Unexpected keyword argument "_packed" for "attach" of "Client"' <<<"$out"
check "the untyped def is named" grep -qF 'error: Function is missing a type annotation' <<<"$out"
check "exactly two errors" grep -qE '^Found 2 errors in 1 file' <<<"$out"
[ "$failed" -eq 0 ] || printf '%s\n' "mypy printed:" "$out"
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
