#!/usr/bin/env bash
# Builds the libFuzzer targets with clang++ into ./build-fuzz and runs their
# bounded CTest runs (label `fuzz`, well under a minute on 2 cores). Crash
# inputs are left in build-fuzz/tests/fuzz/ (crash-*, leak-*, timeout-*).
# Needs clang++ and its libFuzzer runtime (Debian: clang, libclang-rt-14-dev).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=build-fuzz
cxx=${WEIGHTD_FUZZ_CXX:-clang++}
command -v "$cxx" >/dev/null || { echo "fuzz: $cxx not found" >&2; exit 2; }

# build-fuzz belongs to this script: start it afresh if it was configured
# with another compiler (CMake cannot switch compilers in place).
if [ -f "$dir/CMakeCache.txt" ] && ! grep -q "^CMAKE_CXX_COMPILER:.*clang" "$dir/CMakeCache.txt"; then
  rm -rf "$dir/CMakeCache.txt" "$dir/CMakeFiles"
fi
cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER="$cxx" \
  -DCMAKE_C_COMPILER="${WEIGHTD_FUZZ_CC:-clang}" -DWEIGHTD_WITH_CUDA=OFF >/dev/null
if ! grep -q "^WEIGHTD_HAVE_LIBFUZZER:INTERNAL=1" "$dir/CMakeCache.txt"; then
  echo "fuzz: $cxx cannot link -fsanitize=fuzzer (install libclang-rt-14-dev)" >&2
  exit 2
fi
cmake --build "$dir" --target safetensors_fuzz packed_manifest_fuzz --parallel "$(nproc)"
cd "$dir"
ctest -L fuzz --output-on-failure
