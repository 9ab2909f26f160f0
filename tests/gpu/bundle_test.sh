#!/usr/bin/env bash
# CTest (label unit): a GPU-check bundle made from this build runs where the
# build dependencies are absent, as on a GPU machine that has only a driver.
#
#   tests/gpu/bundle_test.sh BUILD_DIR
#
# 1. tests/gpu/make_gpu_bundle.sh --no-build packs BUILD_DIR's programs.
# 2. The libraries the build links from Debian's -dev packages (Abseil,
#    gRPC, protobuf, upb, re2, c-ares, prometheus-cpp, civetweb, xxhash) are
#    hidden in a private mount namespace (as root, or in a user namespace
#    otherwise), and the test first shows that weightd from BUILD_DIR cannot
#    start there. Where no namespace can be made it exits 77 (skipped) with
#    the reason, since the run would prove nothing.
# 3. BUNDLE/run_gpu_checks.sh runs against the fake driver with the tiny demo
#    checkpoint, in an empty environment; it must exit 0 and its table must
#    show the load and the verified attach passing, with no FAIL row.
set -euo pipefail

build=$(cd "${1:?usage: bundle_test.sh BUILD_DIR}" && pwd)
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/weightd-bundle-test.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

bundle=$("$here/make_gpu_bundle.sh" --no-build --build-dir "$build" --out "$tmp/bundle" | tail -1)
[[ "$bundle" == "$tmp/bundle" ]] || fail "make_gpu_bundle.sh printed '$bundle', expected $tmp/bundle"
for f in bin/weightd bin/weightctl bin/gpu_checks fake-driver/libcuda.so.1 run_gpu_checks.sh MANIFEST; do
  [[ -e "$bundle/$f" ]] || fail "the bundle has no $f"
done
if find "$bundle/lib" -name 'libcuda.so*' | grep -q .; then fail "the bundle carries a libcuda"; fi
for lib in libabsl_status.so.20220623 libgrpc++.so.1.51 libprotobuf.so.32; do
  [[ -f "$bundle/lib/$lib" ]] || fail "the bundle has no lib/$lib"
done

# The run, in an empty environment: what a GPU machine's root shell gives.
run_bundle='env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/tmp TMPDIR="$0" WEIGHTD_GPU_FAKE_DRIVER=1 \
  WEIGHTD_GPU_PRESET=tiny "$1/run_gpu_checks.sh" >"$0/table.md" 2>"$0/log.txt"'

# Hides the -dev packages' libraries: a folder of links to every other entry
# of the library folder is mounted over it, in a namespace of this command.
hide_and_run='set -e
libdir=$(dirname "$(readlink -f "$(ldd "$2" | awk "/libabsl_base/ {print \$3}")")")
mkdir -p "$0/orig" "$0/masked"
mount --bind "$libdir" "$0/orig" || exit 4
for entry in "$0"/orig/*; do
  name=$(basename "$entry")
  case "$name" in
    libabsl_*|libgrpc*|libgpr.*|libprotobuf*|libupb*|libre2.*|libcares.*|libaddress_sorting.*|libprometheus-cpp*|libcivetweb*|libxxhash.*) ;;
    *) ln -s "$entry" "$0/masked/$name" ;;
  esac
done
mount --bind "$0/masked" "$libdir" || exit 4
if "$2" --version >/dev/null 2>&1; then echo "hiding failed: $2 still starts"; exit 3; fi
ldd "$2" | grep -c "not found" >"$0/missing_count"
'"$run_bundle"

namespace=()
if [[ $(id -u) == 0 ]] && unshare -m true 2>/dev/null; then
  namespace=(unshare -m)
elif unshare -r -m true 2>/dev/null; then
  namespace=(unshare -r -m)  # a user namespace lets a non-root user bind-mount
else
  echo "SKIPPED: cannot create a mount namespace here (unshare -m / unshare -r -m refused), so the build's libraries cannot be hidden"
  exit 77
fi
code=0
"${namespace[@]}" bash -c "$hide_and_run" "$tmp" "$bundle" "$build/server/weightd" || code=$?
[[ $code != 3 ]] || fail "the build's libraries could not be hidden"
if [[ $code == 4 ]]; then
  echo "SKIPPED: ${namespace[*]} works but bind mounts are refused here (seccomp/AppArmor?), so the build's libraries cannot be hidden"
  exit 77
fi
missing=$(cat "$tmp/missing_count" 2>/dev/null || echo 0)
[[ $missing -ge 10 ]] || fail "only $missing libraries of the build's weightd were hidden"
echo "hid the build's libraries (${namespace[*]}): $build/server/weightd misses $missing of them; the bundle must bring its own"
cat "$tmp/table.md"
[[ $code == 0 ]] || { tail -20 "$tmp/log.txt" >&2; fail "run_gpu_checks.sh from the bundle exited $code"; }
grep -q "using prebuilt programs in $bundle/bin" "$tmp/log.txt" || fail "the bundle's script did not use the bundle's programs"
grep -Eq '^\| weightd load, page cache -> GPU \(--device-backend cuda\) \| PASS \|' "$tmp/table.md" \
  || fail "no passing weightd load row"
grep -Eq '^\| weightctl attach --verify [^|]*\| PASS \| attach [0-9.]+ ms \| 21 tensors, 7 MiB; every tensor compared with the checkpoint: equal \|' \
  "$tmp/table.md" || fail "no passing verified attach of the 21 tiny tensors"
grep -Eq '^\| attach --pin: register the host table [^|]*\| PASS \| [0-9.]+ s/GB \| [0-9.]+ GiB of 21 tensors in [0-9]+ cuMemHostRegister calls \(DEVICEMAP\|PORTABLE\|READ_ONLY\)' \
  "$tmp/table.md" || fail "no passing pinned-table registration of the 21 tiny tensors"
grep -Eq '^\| GPU read from the pinned table [^|]*\| PASS \| [0-9.]+ GB/s \| 21 tensors,.* equals the host mapping \|' \
  "$tmp/table.md" || fail "no passing GPU read through the pinned tensors' device pointers"
grep -Eq '^\| runtime layout: publish [^|]*\| PASS \| [0-9.]+ s \([0-9.]+ GB/s\) \| 1024 MiB on the GPU \+ 1 MiB on the host' \
  "$tmp/table.md" || fail "no passing runtime layout publish with a device tensor"
grep -Eq '^\| runtime layout: attach, read the device tensor back [^|]*\| PASS \| attach [0-9.]+ ms \| device tensor on GPU-[^ ]+ equals what the writer wrote; host tensor equals it too \|' \
  "$tmp/table.md" || fail "no passing read-back of the runtime layout's device tensor"
if grep -q '| FAIL |' "$tmp/table.md"; then fail "a check failed"; fi
echo "PASS: the bundle ran the GPU checks (fake driver) without the build's libraries"
