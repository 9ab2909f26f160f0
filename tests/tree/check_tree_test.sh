#!/usr/bin/env bash
# scripts/check-tree.sh in a scratch clone of this repository: it passes on
# the clone as committed, then fails, naming the file, once an ELF binary,
# an executable non-text file or a file over 1 MiB is committed; an allowed
# large file passes. Prints "N passed, M failed".
set -uo pipefail
src="$(cd "$(dirname "$0")/../.." && pwd)"
if ! git -C "$src" rev-parse --git-dir >/dev/null 2>&1; then
  echo "check_tree_test: SKIP: $src is not a git checkout, so there is no tracked tree to check"
  exit 77
fi
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
git clone -q "$src" "$scratch/repo"
cp "$src/scripts/check-tree.sh" "$scratch/repo/scripts/check-tree.sh"  # the script under test, committed or not
cd "$scratch/repo"
git config user.email test@example.invalid
git config user.name check-tree-test
passed=0 failed=0
expect() {  # expect NAME WANT_RC PATTERN
  local out rc
  out="$(scripts/check-tree.sh 2>&1)"; rc=$?
  if [ "$rc" -eq "$2" ] && grep -qF -- "$3" <<<"$out"; then
    passed=$((passed + 1)); echo "ok: $1"
  else
    failed=$((failed + 1)); echo "FAILED: $1: rc $rc (want $2), output: $out"
  fi
}
expect "the committed tree passes" 0 "no binaries, none over 1 MiB"

cp /bin/true server/stray-helper && git add server/stray-helper && git commit -qm elf
expect "a committed ELF fails" 1 "server/stray-helper: an ELF binary is tracked in git"
git rm -q server/stray-helper && git commit -qm rm

printf '\x00\x01\x02binary' > tools.bin && chmod +x tools.bin && git add tools.bin && git commit -qm exe
expect "an executable non-text file fails" 1 "tools.bin: an executable binary file is tracked in git"
git rm -q tools.bin && git commit -qm rm

printf '\n\n' > blank.sh && chmod +x blank.sh && git add blank.sh && git commit -qm blank
expect "an executable text file of blank lines passes" 0 "no binaries, none over 1 MiB"
git rm -q blank.sh && git commit -qm rm

head -c $((1024 * 1024 + 1)) /dev/zero | tr '\0' 'a' > docs/big.txt && git add docs/big.txt && git commit -qm big
expect "a file over 1 MiB fails" 1 "docs/big.txt: 1048577 bytes, over the 1 MiB limit"
echo "docs/big.txt  # a test's allowed large file" >> scripts/large-files.allow
git add scripts/large-files.allow && git commit -qm allow
expect "an allowed large file passes" 0 "no binaries, none over 1 MiB"

mkdir "$scratch/plain"
out="$(scripts/check-tree.sh "$scratch/plain" 2>&1)"; rc=$?
if [ "$rc" -eq 2 ] && grep -qF "git ls-files failed" <<<"$out"; then
  passed=$((passed + 1)); echo "ok: a folder git cannot list fails"
else
  failed=$((failed + 1)); echo "FAILED: a folder git cannot list: rc $rc (want 2), output: $out"
fi

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
