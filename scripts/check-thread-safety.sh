#!/usr/bin/env bash
# Builds the libraries and executables with clang's thread-safety analysis
# as errors (-Wthread-safety -Werror=thread-safety) into ./build-clang: every
# member marked ABSL_GUARDED_BY is touched only under its absl::Mutex, and
# every ABSL_EXCLUSIVE_LOCKS_REQUIRED function is called with it held. The
# tests are not built here (gcc builds them in ./build). No optimisation and
# no debug info: the analysis is what counts, and it keeps this to a few
# minutes on 2 cores (ccache makes reruns quick).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=build-clang
command -v clang++ >/dev/null || { echo "check-thread-safety: clang++ not found (apt-get install clang)" >&2; exit 2; }
launcher=()
if command -v ccache >/dev/null; then
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache)
fi
# build-clang belongs to this script: start it afresh if it was configured
# with another compiler (CMake cannot switch compilers in place).
if [ -f "$dir/CMakeCache.txt" ] && ! grep -q "^CMAKE_CXX_COMPILER:.*clang" "$dir/CMakeCache.txt"; then
  rm -rf "$dir/CMakeCache.txt" "$dir/CMakeFiles"
fi
CC=clang CXX=clang++ cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Debug -DCMAKE_C_FLAGS_DEBUG=-O0 \
  -DCMAKE_CXX_FLAGS_DEBUG=-O0 -DCMAKE_CXX_FLAGS="-Wthread-safety -Werror=thread-safety" \
  -DWEIGHTD_BUILD_TESTS=OFF "${launcher[@]}" >/dev/null
cmake --build "$dir" --parallel "$(nproc)" --target weightd_base weightd_io weightd_format weightd_transport weightd_memory weightd_peer \
  weightd_server_daemon weightd-peer-helper weightd_client weightd weightctl
echo "check-thread-safety: clang -Wthread-safety build of the libraries and executables passed"
