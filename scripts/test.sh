#!/usr/bin/env bash
# Builds weightd and runs every test that this machine can run (tests
# labelled `gpu` skip with a reason when no GPU is present; `frameworks` and
# `packaging` pip-install from PyPI into venvs under build/), then the clang
# thread-safety build (scripts/check-thread-safety.sh) and the bounded fuzz runs,
# with the restart table checked under a real systemd (scripts/test-systemd.sh) between.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/build.sh
# The venv of the framework tests (CTest's fixture would make it too; made
# here first so a PyPI failure says so before the tests run).
./scripts/python-venvs.sh build/python-venvs
(cd build && ctest --output-on-failure --timeout 600 -j "$(nproc)")
# The shipped unit under a real systemd 252 booted in systemd-nspawn (root;
# it prints its skip reason elsewhere): docs/operations.md "Checked under a real systemd".
./scripts/test-systemd.sh
./scripts/install-deps.sh clang libclang-rt-14-dev  # the thread-safety analysis and clang's libFuzzer runtime
./scripts/check-thread-safety.sh
./scripts/fuzz.sh
