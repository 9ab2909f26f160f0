#!/usr/bin/env bash
# Configures and builds weightd into ./build (Release with debug info):
#   scripts/build.sh              every target, tests included
#   scripts/build.sh TARGET...    only those (scripts/demo.sh: the daemon, the CLI, the peer helper, the Python package)
# WEIGHTD_WERROR=ON makes a warning in weightd's own code an error (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DWEIGHTD_WERROR="${WEIGHTD_WERROR:-OFF}" |
  grep -E '^-- weightd' || true
targets=()
for t in "$@"; do targets+=(--target "$t"); done
cmake --build build --parallel "$(nproc)" "${targets[@]}"
