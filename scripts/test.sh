#!/usr/bin/env bash
# Builds weightd and runs every test that this machine can run (tests
# labelled `gpu` skip with a reason when no GPU is present).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/build.sh
cd build
ctest --output-on-failure --timeout 600 -j "$(nproc)"
