#!/usr/bin/env bash
# Configures and builds weightd into ./build (Release with debug info).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo | grep -E '^-- weightd' || true
cmake --build build --parallel "$(nproc)"
