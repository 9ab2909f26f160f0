#!/usr/bin/env bash
# scripts/check-layers.py against this build's layers (LAYERS_JSON, written
# by the CMake configure step) on a scratch copy of common/ and server/: the
# tree as it is passes; an upward include (model -> registry), a sideways one
# (load -> metrics, which load does not link) and one from common/ into
# server/ each fail with exactly one line naming the file, the line, the
# include and what the layer links. Prints "N passed, M failed".
set -uo pipefail
layers_json="$1"
src="$(cd "$(dirname "$0")/../.." && pwd)"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
mkdir -p "$scratch/repo"
cp -r "$src/common" "$src/server" "$scratch/repo/"
check() { python3 "$src/scripts/check-layers.py" --root "$scratch/repo" --layers "$layers_json" 2>&1; }
passed=0 failed=0
ok() { passed=$((passed + 1)); echo "ok: $1"; }
bad() { failed=$((failed + 1)); echo "FAILED: $1"; }

out="$(check)"; rc=$?
[ "$rc" -eq 0 ] && grep -qF "every include is of a layer linked" <<<"$out" && ok "the tree as it is passes" ||
  bad "the tree as it is: rc $rc, output: $out"

# Each plant goes after the file's first line (its own header or a comment).
plant() { sed -i "1a #include \"$2\"" "$scratch/repo/$1"; }
plant server/model/model.h server/registry/registry.h
plant server/load/loader.cc server/metrics/metrics.h
plant common/base/status.h server/model/model.h
out="$(check)"; rc=$?
[ "$rc" -eq 1 ] && ok "a planted include fails the check (exit 1)" || bad "exit status $rc, want 1: $out"
expect_line() {
  if grep -qxF -- "$2" <<<"$out"; then ok "$1"; else bad "$1: no line '$2' in: $out"; fi
}
expect_line "upward: model includes registry" \
  'server/model/model.h:2: includes "server/registry/registry.h" (layer server/registry), but weightd_server_model links only common/base, common/format, common/io, common/memory: a layer includes only its own headers and the layers it links (server/CMakeLists.txt)'
expect_line "sideways: load includes metrics, which it does not link" \
  'server/load/loader.cc:2: includes "server/metrics/metrics.h" (layer server/metrics), but weightd_server_load links only common/base, common/format, common/io, common/memory, server/model: a layer includes only its own headers and the layers it links (server/CMakeLists.txt)'
expect_line "common/ never includes server/" \
  'common/base/status.h:2: includes "server/model/model.h" (layer server/model), but weightd_base links no other layer: a layer includes only its own headers and the layers it links (common/CMakeLists.txt)'
n="$(grep -c ': includes "' <<<"$out")"
[ "$n" -eq 3 ] && ok "exactly three includes reported" || bad "$n includes reported, want 3: $out"
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
