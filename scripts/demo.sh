#!/usr/bin/env bash
# The main job on the built-in demo checkpoint: build, start weightd, load the
# demo checkpoint once, attach it from two client processes at once (each
# verifying every byte against the files), show what happened, stop weightd.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== 0. installing dependencies and building the daemon, the CLI, the peer helper and the Python package"
echo "   (several minutes on a fresh machine, seconds after; ./scripts/test.sh builds the tests)"
./scripts/build.sh weightd weightctl weightd-peer-helper weightd_python

preset="${WEIGHTD_DEMO_PRESET:-small}"
work="$(mktemp -d /tmp/weightd-demo.XXXXXX)"
daemon_pid=""
cleanup() {
  [ -n "$daemon_pid" ] && kill -TERM "$daemon_pid" 2>/dev/null && wait "$daemon_pid" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

weightd=build/server/weightd
weightctl="build/client/weightctl --socket $work/weightd.sock"
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.3f s", b - a }'; }

echo "== 1. writing the demo checkpoint (preset $preset) to $work/models/demo"
mkdir -p "$work/models"
build/client/weightctl make-demo "$work/models/demo" --preset "$preset"

echo "== 2. starting weightd on $work/weightd.sock"
"$weightd" --socket "$work/weightd.sock" --model-root "$work/models" --metrics-address "" \
  2> >(sed -u 's/^/   weightd: /' >&2) &
daemon_pid=$!
for _ in $(seq 100); do $weightctl ls >/dev/null 2>&1 && break; sleep 0.05; done

echo "== 3. loading it once"
$weightctl load demo demo

echo "== 4. two client processes attach at once and verify every byte against the files"
t=$(now)
$weightctl attach demo --verify "$work/models/demo" > "$work/a.out" &
a=$!
$weightctl attach demo --verify "$work/models/demo" > "$work/b.out" &
b=$!
wait $a && wait $b
sed 's/^/   client A: /' "$work/a.out"
sed 's/^/   client B: /' "$work/b.out"
echo "   both clients done in $(since "$t") (including reading the files again to compare)"

echo "== 5. what the daemon holds"
$weightctl ls

echo "== 6. stopping weightd (SIGTERM)"
kill -TERM "$daemon_pid"
wait "$daemon_pid"
daemon_pid=""
echo "   weightd exited cleanly"
