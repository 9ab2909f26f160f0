#!/usr/bin/env bash
# The main job on the built-in demo checkpoint: build, write the demo
# checkpoint, and catalog it.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/build.sh
work="${WEIGHTD_DEMO_DIR:-$(mktemp -d /tmp/weightd-demo.XXXXXX)}"
bin=build/client
echo "== writing the demo checkpoint (preset small) to $work/demo"
"$bin/weightctl" make-demo "$work/demo" --preset small
echo "== cataloging it (headers only)"
"$bin/weightctl" inspect "$work/demo" | tail -4
