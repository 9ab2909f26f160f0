#!/usr/bin/env bash
# Builds weightd with the CUDA backends and runs the GPU checks on this
# machine's GPU 0, in a few minutes; prints one Markdown table on stdout (also
# saved as BUILD_DIR/gpu_checks.md). Progress goes to stderr.
#
#   tests/gpu/run_gpu_checks.sh [BUILD_DIR]        (default: <repo>/build-gpu)
#
# Steps: configure + build weightd, weightctl and gpu_checks (CUDA headers
# from $CUDA_HOME or /usr/local/cuda; nothing from CUDA is linked); write a
# `weightctl make-demo --preset llama-1b` checkpoint (~2.4 GiB) and read it
# once into the page cache; start weightd --device-backend cuda, load it onto
# GPU 0 (`weightctl load --devices 0 --json`) and attach rank 0 with
# --verify; stop the daemon; then gpu_checks runs the cross-process VMM and
# legacy IPC checks, the read-only write check, open+map times, the pinned
# cuMemcpyHtoD baseline of the same checkpoint bytes and cuMemHostRegister,
# and prints the table with weightd's own numbers in it.
#
# Exit status: 0 all checks passed, 1 a check failed, 77 no NVIDIA driver or
# GPU here (the reason is printed), 2 the build failed.
# Environment: CUDA_HOME, WEIGHTD_GPU_PRESET (default llama-1b),
# WEIGHTD_GPU_FAKE_DRIVER=1 (runs against tests/gpu/fake_libcuda.cc, to test
# this script on a machine without a GPU), TMPDIR.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=${1:-$root/build-gpu}
preset=${WEIGHTD_GPU_PRESET:-llama-1b}
cuda_home=${CUDA_HOME:-/usr/local/cuda}
jobs=$(nproc 2>/dev/null || echo 4)
work=$(mktemp -d "${TMPDIR:-/tmp}/weightd-gpu.XXXXXX")
daemon_pid=""

say() { echo "[run_gpu_checks $(date +%H:%M:%S)] $*" >&2; }
cleanup() {
  if [[ -n "$daemon_pid" ]] && kill -0 "$daemon_pid" 2>/dev/null; then
    kill -TERM "$daemon_pid" 2>/dev/null || true
    wait "$daemon_pid" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

# --- build ---------------------------------------------------------------------
generator=()
if command -v ninja >/dev/null; then generator=(-G Ninja); fi
if [[ -f "$build/CMakeCache.txt" ]]; then generator=(); fi  # keep the existing generator
say "configuring $build (CUDA headers from $cuda_home)"
if ! cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DWEIGHTD_WITH_CUDA=ON \
    -DCUDAToolkit_ROOT="$cuda_home" >"$work/cmake.log" 2>&1; then
  tail -20 "$work/cmake.log" >&2
  say "cmake failed"
  exit 2
fi
if ! grep -q "weightd: CUDA backends ON" "$work/cmake.log"; then
  say "the CUDA toolkit was not found under $cuda_home (set CUDA_HOME); the CUDA backends would not be built"
  exit 2
fi
say "building weightd, weightctl, gpu_checks with $jobs jobs"
start=$(date +%s)
if ! cmake --build "$build" --target weightd weightctl gpu_checks -j "$jobs" >"$work/build.log" 2>&1; then
  grep -E "error|Error" "$work/build.log" | head -20 >&2 || tail -20 "$work/build.log" >&2
  say "build failed"
  exit 2
fi
say "built in $(($(date +%s) - start)) s"

weightd="$build/server/weightd"
weightctl="$build/client/weightctl"
gpu_checks="$build/tests/gpu/gpu_checks"
if [[ "${WEIGHTD_GPU_FAKE_DRIVER:-0}" == 1 ]]; then
  export LD_LIBRARY_PATH="$build/tests/gpu/fake-driver${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  say "using the fake CUDA driver in $build/tests/gpu/fake-driver (no GPU is used)"
fi
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=index,uuid,name,driver_version,memory.total --format=csv,noheader >&2 || true
fi

# gpu_checks alone says whether there is a driver and a GPU; stop early if not.
set +e
"$gpu_checks" --probe >"$work/probe.txt" 2>&1
code=$?
set -e
cat "$work/probe.txt" >&2
if [[ $code == 77 ]]; then
  cat "$work/probe.txt"
  exit 77
elif [[ $code != 0 ]]; then
  say "gpu_checks --probe failed"
  exit 1
fi

# --- weightd's load, page cache -> GPU 0 --------------------------------------
checkpoint="$work/models/$preset"
say "writing a make-demo --preset $preset checkpoint to $checkpoint"
mkdir -p "$work/models"
"$weightctl" make-demo "$checkpoint" --preset "$preset" >&2
cat "$checkpoint"/* >/dev/null  # into the page cache: the load and the baseline both read from it
socket="$work/weightd.sock"
say "starting weightd --device-backend cuda"
"$weightd" --socket "$socket" --model-root "$work/models" --device-backend cuda --metrics-address "" >"$work/weightd.log" 2>&1 &
daemon_pid=$!
for _ in $(seq 1 300); do
  if "$weightctl" --socket "$socket" ls --json >/dev/null 2>&1; then break; fi
  if ! kill -0 "$daemon_pid" 2>/dev/null; then break; fi
  sleep 0.1
done
ctl=("$weightctl" --socket "$socket")
if "${ctl[@]}" ls --json >/dev/null 2>&1; then
  say "loading onto GPU 0"
  "${ctl[@]}" load demo "$checkpoint" --devices 0 --json >"$work/load.json" 2>"$work/load.err" || true
  say "attaching rank 0 with --verify"
  "${ctl[@]}" attach demo --rank 0 --verify "$checkpoint" --json >"$work/attach.json" 2>"$work/attach.err" || true
else
  say "weightd did not start; its log:"
  tail -20 "$work/weightd.log" >&2
  { echo "weightd did not start: $(grep -m1 -iE 'error|fail' "$work/weightd.log" || tail -1 "$work/weightd.log")"; } \
    | tee "$work/load.err" >"$work/attach.err"
fi
grep -m1 "device backend" "$work/weightd.log" >&2 || true
kill -TERM "$daemon_pid" 2>/dev/null || true
wait "$daemon_pid" 2>/dev/null || true
daemon_pid=""

# --- the checks ----------------------------------------------------------------
say "running gpu_checks"
set +e
"$gpu_checks" --checkpoint "$checkpoint" --load-json "$work/load.json" --load-error "$work/load.err" \
  --attach-json "$work/attach.json" --attach-error "$work/attach.err" >"$build/gpu_checks.md"
code=$?
set -e
cat "$build/gpu_checks.md"
say "table saved to $build/gpu_checks.md; exit status $code"
exit $code
