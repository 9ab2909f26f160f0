#!/usr/bin/env bash
# scripts/check-layers.py against this build's layers (LAYERS_JSON, written
# by the CMake configure step) on a scratch copy of common/ and server/: the
# tree as it is passes; each planted break fails with exactly one line naming
# it: an upward include (model -> registry), a sideways one (load -> metrics,
# which load does not link), one from common/ into server/, one spelt
# relative to the file ("../registry/registry.h"), one in <angle brackets>,
# a file in a folder that is no layer's, and links that form a cycle.
# Prints "N passed, M failed".
set -uo pipefail
layers_json="$1"
src="$(cd "$(dirname "$0")/../.." && pwd)"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
mkdir -p "$scratch/repo"
cp -r "$src/common" "$src/server" "$scratch/repo/"
check() { python3 "$src/scripts/check-layers.py" --root "$scratch/repo" --layers "${1:-$layers_json}" 2>&1; }
passed=0 failed=0
ok() { passed=$((passed + 1)); echo "ok: $1"; }
bad() { failed=$((failed + 1)); echo "FAILED: $1"; }

out="$(check)"; rc=$?
[ "$rc" -eq 0 ] && grep -qF "every include is of a layer linked" <<<"$out" && ok "the tree as it is passes" ||
  bad "the tree as it is: rc $rc, output: $out"

# Each plant goes after the file's first line (its own header or a comment).
plant() { sed -i "1a #include $2" "$scratch/repo/$1"; }
plant server/model/model.h '"server/registry/registry.h"'
plant server/load/loader.cc '"server/metrics/metrics.h"'
plant common/base/status.h '"server/model/model.h"'
plant server/update/update.cc '"../registry/registry.h"'
plant server/load/plan.h '<server/api/service.h>'
mkdir -p "$scratch/repo/server/registry_util"
printf '#include "server/api/service.h"\n' > "$scratch/repo/server/registry_util/util.cc"
out="$(check)"; rc=$?
[ "$rc" -eq 1 ] && ok "a planted include fails the check (exit 1)" || bad "exit status $rc, want 1: $out"
expect_line() {
  if grep -qxF -- "$2" <<<"$out"; then ok "$1"; else bad "$1: no line '$2' in: $out"; fi
}
links='a layer includes only its own headers and the layers it links'
model_links='common/base, common/format, common/io, common/memory'
expect_line "upward: model includes registry" \
  "server/model/model.h:2: includes \"server/registry/registry.h\" (layer server/registry), but weightd_server_model links only $model_links publicly (a header is read by every user of its layer): $links (server/CMakeLists.txt)"
expect_line "sideways: load includes metrics, which it does not link" \
  "server/load/loader.cc:2: includes \"server/metrics/metrics.h\" (layer server/metrics), but weightd_server_load links only $model_links, server/model: $links (server/CMakeLists.txt)"
expect_line "common/ never includes server/" \
  "common/base/status.h:2: includes \"server/model/model.h\" (layer server/model), but weightd_base links no other layer publicly (a header is read by every user of its layer): $links (common/CMakeLists.txt)"
expect_line "an include spelt relative to the file" \
  "server/update/update.cc:2: includes \"../registry/registry.h\" (layer server/registry), but weightd_server_update links only $model_links, server/load, server/model: $links (server/CMakeLists.txt)"
expect_line "an include in angle brackets" \
  "server/load/plan.h:2: includes \"server/api/service.h\" (layer server/api), but weightd_server_load links only $model_links, server/model publicly (a header is read by every user of its layer): $links (server/CMakeLists.txt)"
expect_line "a file in no layer's folder" \
  "server/registry_util/util.cc: in no layer's folder; add it to a layer's sources (CMakeLists.txt)"
n="$(grep -c -e ': includes "' -e "in no layer's folder" <<<"$out")"
[ "$n" -eq 6 ] && ok "exactly six problems reported" || bad "$n problems reported, want 6: $out"

# Links that lead back: model made to link registry (which links model).
sed 's/{"target": "weightd_server_model", \("dirs": \[[^]]*\]\), "links": \[/{"target": "weightd_server_model", \1, "links": ["weightd_server_registry", /' \
  "$layers_json" > "$scratch/cycle.json"
rm -rf "$scratch/repo" && mkdir -p "$scratch/repo" && cp -r "$src/common" "$src/server" "$scratch/repo/"
out="$(check "$scratch/cycle.json")"; rc=$?
[ "$rc" -eq 1 ] && grep -qxF "weightd_server_model: its links lead back to it; layers link only the layers below them" <<<"$out" &&
  ok "links that form a cycle fail the check" || bad "cycle: rc $rc, output: $out"
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
