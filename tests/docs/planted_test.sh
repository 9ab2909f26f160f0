#!/usr/bin/env bash
# scripts/check-docs.py on a scratch copy of README.md and docs/*.md with
# one wrong claim of each kind planted: a repo path, a weightctl flag, a
# metric and a Python signature. It must exit 1 and name each, and nothing
# else. Usage: planted_test.sh PYTHON REPO WEIGHTD WEIGHTCTL PYTHONPATH
set -uo pipefail
python="$1" repo="$2" weightd="$3" weightctl="$4" pythonpath="$5"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
cp "$repo/README.md" "$repo"/docs/*.md "$scratch/"
printf '\nSee `server/no_such_file.h`.\n' >> "$scratch/architecture.md"
printf '\n```sh\nweightctl attach demo --verfy /models/demo\n```\n' >> "$scratch/devices.md"
printf '\nThe gauge `weightd_no_such_metric_bytes` reads 0.\n' >> "$scratch/operations.md"
printf '\nUse `client.manifest(name, rank=1)` to read one.\n' >> "$scratch/integration.md"
out="$("$python" "$repo/scripts/check-docs.py" --repo "$repo" --docs-dir "$scratch" --weightd "$weightd" \
  --weightctl "$weightctl" --pythonpath "$pythonpath" 2>&1)"
rc=$?
passed=0 failed=0
check() {  # check NAME CONDITION...
  local name="$1"; shift
  if "$@"; then passed=$((passed + 1)); echo "ok: $name"; else failed=$((failed + 1)); echo "FAILED: $name"; fi
}
check "exit status 1 (got $rc)" test "$rc" -eq 1
check "the path is named" grep -qF "architecture.md:" <<<"$(grep -F "path 'server/no_such_file.h': no such file or folder" <<<"$out")"
check "the flag is named" grep -qF "flag 'weightctl attach --verfy': not in \`weightctl attach --help\`" <<<"$out"
check "the metric is named" grep -qF "metric 'weightd_no_such_metric_bytes': a fresh daemon does not export it" <<<"$out"
check "the signature is named" grep -qF "python 'client.manifest(name, rank=1)': the package has manifest(name, rank=0)" <<<"$out"
check "exactly four claims fail" grep -qE "^[0-9]+ passed, 4 failed$" <<<"$out"
[ "$failed" -eq 0 ] || printf '%s\n' "check-docs.py printed:" "$out"
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
