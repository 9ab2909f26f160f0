#!/usr/bin/env bash
# Builds weightd with the CUDA backends and runs the GPU checks on this
# machine's GPU 0, in a few minutes; prints one Markdown table on stdout (also
# saved as gpu_checks.md in the build or bundle folder). Progress goes to stderr.
#
#   tests/gpu/run_gpu_checks.sh [BUILD_DIR]        build (default <repo>/build-gpu), then check
#   tests/gpu/run_gpu_checks.sh --build-only [BUILD_DIR]
#   tests/gpu/run_gpu_checks.sh --bin-dir DIR      check with prebuilt weightd, weightctl, gpu_checks
#   BUNDLE/run_gpu_checks.sh                       the same, from a bundle made by make_gpu_bundle.sh
#
# Building needs the Debian -dev packages of scripts/install-deps.sh; a GPU
# machine without them (or without network) runs a bundle instead: built on
# a build machine by tests/gpu/make_gpu_bundle.sh, it carries the three
# programs and every shared library they need beyond glibc, and this script,
# copied into it, finds its programs in BUNDLE/bin and its libraries in
# BUNDLE/lib without building anything (see docs/devices.md, "GPU checks").
#
# Steps: configure + build weightd, weightctl and gpu_checks (CUDA headers
# from $CUDA_HOME or /usr/local/cuda; nothing from CUDA is linked); write a
# `weightctl make-demo --preset llama-1b` checkpoint (~2.4 GiB) and read it
# once into the page cache; start weightd --device-backend cuda, load it onto
# GPU 0 (`weightctl load --devices 0 --json`) and attach rank 0 with
# --verify; load it again as demo-host with every tensor on the host (no
# --devices); then gpu_checks runs the cross-process VMM and legacy IPC
# checks, the read-only write check, open+map times, the pinned
# cuMemcpyHtoD baseline of the same checkpoint bytes, cuMemHostRegister, and
# pins demo-host through the client library (AttachOptions::pin: register
# s/GB, GPU reads through the device pointers) and publishes a runtime layout
# with a 1 GiB device tensor on demo's rank 0 (GPU 0) and reads it back, while
# the daemon still runs;
# the daemon stops last. It prints the table with weightd's own numbers in it.
#
# Exit status: 0 all checks passed, 1 a check failed, 77 no NVIDIA driver or
# GPU here (the reason is printed), 2 the build failed or a program is
# missing.
# Environment: CUDA_HOME, WEIGHTD_GPU_PRESET (default llama-1b),
# WEIGHTD_GPU_FAKE_DRIVER=1 (runs against tests/gpu/fake_libcuda.cc, to test
# this script on a machine without a GPU), TMPDIR.
set -euo pipefail

say() { echo "[run_gpu_checks $(date +%H:%M:%S)] $*" >&2; }
usage() { sed -n '6,9p' "${BASH_SOURCE[0]}" | sed 's/^# */usage: /' >&2; exit "${1:-2}"; }

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mode=check
bin_dir=""
build=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build-only) mode=build-only; shift ;;
    --bin-dir)
      [[ $# -ge 2 ]] || usage
      bin_dir=$(cd "$2" 2>/dev/null && pwd) || { say "--bin-dir $2: no such folder"; exit 2; }
      shift 2 ;;
    -h|--help) usage 0 ;;
    -*) say "unknown option $1"; usage ;;
    *) build=$1; shift ;;
  esac
done
if [[ -x "$here/bin/gpu_checks" ]]; then  # this copy of the script lives in a bundle
  if [[ -n "$build" || "$mode" == build-only ]]; then
    say "this copy of run_gpu_checks.sh is in a bundle, which cannot build; run tests/gpu/run_gpu_checks.sh from a checkout"
    exit 2
  fi
  bin_dir=${bin_dir:-$here/bin}
fi
if [[ -n "$bin_dir" && "$mode" == build-only ]]; then say "--build-only and --bin-dir exclude each other"; usage; fi

preset=${WEIGHTD_GPU_PRESET:-llama-1b}
cuda_home=${CUDA_HOME:-/usr/local/cuda}
jobs=$(nproc 2>/dev/null || echo 4)
program_libs=${LD_LIBRARY_PATH:-}
work=$(mktemp -d "${TMPDIR:-/tmp}/weightd-gpu.XXXXXX")
daemon_pid=""

cleanup() {
  if [[ -n "$daemon_pid" ]] && kill -0 "$daemon_pid" 2>/dev/null; then
    kill -TERM "$daemon_pid" 2>/dev/null || true
    wait "$daemon_pid" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

# --- build (skipped with prebuilt programs) ------------------------------------
if [[ -z "$bin_dir" ]]; then
  root=$(cd "$here/../.." && pwd)
  build=${build:-$root/build-gpu}
  generator=()
  if command -v ninja >/dev/null; then generator=(-G Ninja); fi
  if [[ -f "$build/CMakeCache.txt" ]]; then generator=(); fi  # keep the existing generator
  say "configuring $build (CUDA headers from $cuda_home)"
  build_type=(-DCMAKE_BUILD_TYPE=Release)
  if [[ -f "$build/CMakeCache.txt" ]]; then build_type=(); fi  # keep the folder's own build type
  if ! cmake -S "$root" -B "$build" "${generator[@]}" "${build_type[@]}" -DWEIGHTD_WITH_CUDA=ON \
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
  if [[ "$mode" == build-only ]]; then exit 0; fi
  weightd="$build/server/weightd"
  weightctl="$build/client/weightctl"
  gpu_checks="$build/tests/gpu/gpu_checks"
  fake_driver="$build/tests/gpu/fake-driver"
  table_copy="$build/gpu_checks.md"
else
  weightd="$bin_dir/weightd"
  weightctl="$bin_dir/weightctl"
  gpu_checks="$bin_dir/gpu_checks"
  fake_driver="$bin_dir/../fake-driver"
  table_copy="$(dirname "$bin_dir")/gpu_checks.md"
  if [[ -d "$bin_dir/../lib" ]]; then
    lib=$(cd "$bin_dir/../lib" && pwd)
    program_libs="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    # The bundle's libstdc++ only where this machine's is missing or older.
    if [[ -d "$lib/compat" ]] && command -v ldd >/dev/null &&
       LD_LIBRARY_PATH=$program_libs ldd "$gpu_checks" 2>&1 | grep -q "not found"; then
      program_libs="$program_libs:$lib/compat"
      say "using the bundle's libstdc++/libgcc_s ($lib/compat)"
    fi
  fi
  for program in "$weightd" "$weightctl" "$gpu_checks"; do
    if [[ ! -x "$program" ]]; then say "$program is missing"; exit 2; fi
    if ! command -v ldd >/dev/null; then continue; fi
    if missing=$(LD_LIBRARY_PATH=$program_libs ldd "$program" 2>&1 | grep "not found"); then
      say "$program cannot start here: $(echo "$missing" | tr -s ' \t\n' ' ')"
      exit 2
    fi
  done
  say "using prebuilt programs in $bin_dir ($(cat "$bin_dir/../MANIFEST" 2>/dev/null | head -1 || echo 'no MANIFEST'))"
fi

if [[ "${WEIGHTD_GPU_FAKE_DRIVER:-0}" == 1 ]]; then
  program_libs="$fake_driver${program_libs:+:$program_libs}"
  say "using the fake CUDA driver in $fake_driver (no GPU is used)"
fi
# The three programs run with the bundle's libraries (and the fake driver);
# nvidia-smi and the shell's tools keep the machine's own.
with_libs() { LD_LIBRARY_PATH="$program_libs" "$@"; }
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=index,uuid,name,driver_version,memory.total --format=csv,noheader >&2 || true
fi

# gpu_checks alone says whether there is a driver and a GPU; stop early if not.
set +e
with_libs "$gpu_checks" --probe >"$work/probe.txt" 2>&1
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
with_libs "$weightctl" make-demo "$checkpoint" --preset "$preset" >&2
cat "$checkpoint"/* >/dev/null  # into the page cache: the load and the baseline both read from it
socket="$work/weightd.sock"
say "starting weightd --device-backend cuda"
# Not through with_libs: $! must be weightd itself, not a subshell, for the TERM.
LD_LIBRARY_PATH="$program_libs" "$weightd" --socket "$socket" --model-root "$work/models" --device-backend cuda \
  --metrics-address "" >"$work/weightd.log" 2>&1 &
daemon_pid=$!
for _ in $(seq 1 300); do
  if with_libs "$weightctl" --socket "$socket" ls --json >/dev/null 2>&1; then break; fi
  if ! kill -0 "$daemon_pid" 2>/dev/null; then break; fi
  sleep 0.1
done
ctl=(with_libs "$weightctl" --socket "$socket")
if "${ctl[@]}" ls --json >/dev/null 2>&1; then
  say "loading onto GPU 0"
  "${ctl[@]}" load demo "$checkpoint" --devices 0 --json >"$work/load.json" 2>"$work/load.err" || true
  say "attaching rank 0 with --verify"
  "${ctl[@]}" attach demo --rank 0 --verify "$checkpoint" --json >"$work/attach.json" 2>"$work/attach.err" || true
  say "loading it again as demo-host, every tensor on the host (the table gpu_checks pins)"
  "${ctl[@]}" load demo-host "$checkpoint" --json >"$work/load-host.json" 2>"$work/load-host.err" ||
    say "the host load failed: $(head -1 "$work/load-host.err")"
else
  say "weightd did not start; its log:"
  tail -20 "$work/weightd.log" >&2
  { echo "weightd did not start: $(grep -m1 -iE 'error|fail' "$work/weightd.log" || tail -1 "$work/weightd.log")"; } \
    | tee "$work/load.err" >"$work/attach.err"
fi
grep -m1 "device backend" "$work/weightd.log" >&2 || true

# --- the checks (the daemon still serves demo-host for the pinned-table rows) ---
say "running gpu_checks"
set +e
with_libs "$gpu_checks" --checkpoint "$checkpoint" --load-json "$work/load.json" --load-error "$work/load.err" \
  --attach-json "$work/attach.json" --attach-error "$work/attach.err" \
  --socket "$socket" --pin-model demo-host --layout-model demo >"$work/gpu_checks.md"
code=$?
set -e
kill -TERM "$daemon_pid" 2>/dev/null || true
wait "$daemon_pid" 2>/dev/null || true
daemon_pid=""
cat "$work/gpu_checks.md"
# A copy beside the programs, where that folder is writable (a bundle may not be).
if cp "$work/gpu_checks.md" "$table_copy" 2>/dev/null; then
  say "table saved to $table_copy; exit status $code"
else
  say "table not saved ($(dirname "$table_copy") is not writable); exit status $code"
fi
exit $code
