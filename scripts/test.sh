#!/usr/bin/env bash
# Builds weightd and runs every test that this machine can run (tests
# labelled `gpu` skip with a reason when no GPU is present), then the bounded
# fuzz runs when clang++ is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/build.sh
(cd build && ctest --output-on-failure --timeout 600 -j "$(nproc)")
if command -v clang++ >/dev/null; then
  ./scripts/install-deps.sh libclang-rt-14-dev  # clang's libFuzzer runtime
  ./scripts/fuzz.sh
else
  echo "test: fuzz runs skipped: clang++ not installed" >&2
fi
