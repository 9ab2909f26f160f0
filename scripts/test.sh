#!/usr/bin/env bash
# Builds weightd and runs every test that this machine can run (tests
# labelled `gpu` skip with a reason when no GPU is present), then, when
# clang++ is installed, the thread-safety build and the bounded fuzz runs.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/build.sh
(cd build && ctest --output-on-failure --timeout 600 -j "$(nproc)")
if command -v clang++ >/dev/null; then
  ./scripts/check-thread-safety.sh
  ./scripts/install-deps.sh libclang-rt-14-dev  # clang's libFuzzer runtime
  ./scripts/fuzz.sh
else
  echo "test: thread-safety build and fuzz runs skipped: clang++ not installed" >&2
fi
