#!/usr/bin/env bash
# Builds weightd and runs every test that this machine can run (tests
# labelled `gpu` skip with a reason when no GPU is present), then the clang
# thread-safety build (scripts/check-thread-safety.sh) and the bounded fuzz runs.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/build.sh
(cd build && ctest --output-on-failure --timeout 600 -j "$(nproc)")
./scripts/install-deps.sh clang libclang-rt-14-dev  # the thread-safety analysis and clang's libFuzzer runtime
./scripts/check-thread-safety.sh
./scripts/fuzz.sh
