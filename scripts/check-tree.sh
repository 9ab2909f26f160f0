#!/usr/bin/env bash
# Fails when git tracks a build output: an executable binary (ELF, or any
# file whose content is not text and whose mode is executable), or any file
# larger than 1 MiB. Files listed in scripts/large-files.allow (one path a
# line, '#' comments) are exempt from the size rule only, each with its
# reason beside it. Run from .ci/run; `scripts/check-tree.sh [REPO]`.
set -euo pipefail
repo="${1:-$(cd "$(dirname "$0")/.." && pwd)}"
cd "$repo"
limit=$((1024 * 1024))
allow=()
if [ -f scripts/large-files.allow ]; then
  while IFS= read -r line; do
    line="${line%%#*}"; line="${line%"${line##*[![:space:]]}"}"
    [ -n "$line" ] && allow+=("$line")
  done < scripts/large-files.allow
fi
files="$(mktemp)"
trap 'rm -f "$files"' EXIT
if ! git ls-files -z >"$files"; then
  echo "check-tree: git ls-files failed in $repo: cannot tell what is tracked" >&2
  exit 2
fi
bad=0
while IFS= read -r -d '' path; do
  [ -L "$path" ] && continue  # a symlink's target is checked where it is tracked
  [ -f "$path" ] || continue
  head4="$(head -c 4 -- "$path" | od -An -tx1 | tr -d ' \n')"
  if [ "$head4" = "7f454c46" ]; then
    echo "check-tree: $path: an ELF binary is tracked in git (build outputs belong in build/, never in the tree)" >&2
    bad=1
    continue
  fi
  if [ -x "$path" ] && [ -s "$path" ] && ! grep -qI '' -- "$path"; then
    echo "check-tree: $path: an executable binary file is tracked in git" >&2
    bad=1
    continue
  fi
  size=$(stat -c %s -- "$path")
  if [ "$size" -gt "$limit" ]; then
    allowed=0
    for a in "${allow[@]}"; do [ "$a" = "$path" ] && allowed=1; done
    if [ "$allowed" -eq 0 ]; then
      echo "check-tree: $path: $size bytes, over the 1 MiB limit for tracked files (add it to scripts/large-files.allow with a reason if it must be here)" >&2
      bad=1
    fi
  fi
done <"$files"
if [ "$bad" -ne 0 ]; then exit 1; fi
echo "check-tree: $(tr -cd '\0' <"$files" | wc -c) tracked files: no binaries, none over 1 MiB"
