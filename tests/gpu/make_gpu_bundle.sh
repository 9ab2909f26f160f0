#!/usr/bin/env bash
# Makes a GPU-check bundle: weightd, weightctl and gpu_checks built with the
# CUDA backends, every shared library they load beyond glibc, and
# run_gpu_checks.sh, in one folder that runs on a GPU machine which has an
# NVIDIA driver but none of the build dependencies (no gRPC, protobuf or
# Abseil packages, no network): copy the folder there and run
# BUNDLE/run_gpu_checks.sh. Nothing from CUDA is bundled: the programs
# dlopen the machine's own libcuda.so.1.
#
#   tests/gpu/make_gpu_bundle.sh [--build-dir DIR] [--no-build] [--out DIR]
#
# --build-dir  the CMake build folder (default <repo>/build-gpu, Release, with
#              CUDA); built first with run_gpu_checks.sh --build-only unless
#              --no-build (then it must already hold the three programs).
# --out        the bundle folder (default <repo>/.gpu-bundle, git-ignored);
#              replaced if it holds an earlier bundle, refused if it holds
#              anything else.
#
# Layout: bin/ (the programs, debug info stripped), lib/ (their libraries),
# lib/compat/ (libstdc++ and libgcc_s, used only where the target's are
# missing or older), fake-driver/ (the fake libcuda of the tests, used only
# with WEIGHTD_GPU_FAKE_DRIVER=1), run_gpu_checks.sh, MANIFEST (commit,
# date, files, and the glibc/libstdc++ versions the programs need: built on
# Debian 12, glibc 2.34 and a GCC 11+ libstdc++ (GLIBCXX_3.4.29); lib/compat
# brings that libstdc++ to nodes whose glibc is 2.36 or newer). x86-64 only.
# Exit status: 0 made (the last line on stdout is the bundle folder), 2 an
# error (named on stderr).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
build="$root/build-gpu"
out="$root/.gpu-bundle"
do_build=1

say() { echo "[make_gpu_bundle] $*" >&2; }
die() { say "$*"; exit 2; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build-dir) [[ $# -ge 2 && -n "$2" ]] || die "--build-dir needs a folder"; build=$2; shift 2 ;;
    --out) [[ $# -ge 2 && -n "$2" ]] || die "--out needs a folder"; out=$2; shift 2 ;;
    --no-build) do_build=0; shift ;;
    -h|--help) sed -n '2,24p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
done

# Never delete what is not a bundle. The bundle is made in a staging folder
# beside --out and moved into place only when complete, so a failed run
# leaves --out as it was.
if [[ -e "$out" || -L "$out" ]]; then
  [[ -d "$out" && ! -L "$out" ]] || die "--out $out exists and is not a folder"
  entries=$(ls -A -- "$out") || die "cannot list --out $out"
  if [[ -n "$entries" ]] && ! head -1 "$out/MANIFEST" 2>/dev/null | grep -q "^weightd GPU-check bundle"; then
    die "--out $out is not empty and holds no earlier bundle (no MANIFEST); choose another folder"
  fi
fi
parent=$(mkdir -p "$(dirname "$out")" && cd "$(dirname "$out")" && pwd) || die "cannot create the folder of --out $out"
out="$parent/$(basename "$out")"
stage=$(mktemp -d "$out.partial.XXXXXX") || die "cannot create a staging folder beside $out"
trap 'rm -rf "$stage"' EXIT

if [[ $do_build == 1 ]]; then
  "$here/run_gpu_checks.sh" --build-only "$build" || die "the build in $build failed"
fi
programs=("$build/server/weightd" "$build/client/weightctl" "$build/tests/gpu/gpu_checks")
for program in "${programs[@]}"; do
  [[ -x "$program" ]] || die "$program is missing: build $build with -DWEIGHTD_WITH_CUDA=ON first (or drop --no-build)"
done
[[ -f "$build/tests/gpu/fake-driver/libcuda.so.1" ]] || die "$build/tests/gpu/fake-driver/libcuda.so.1 is missing"

# glibc's own libraries and the loader are the target's; libstdc++ and
# libgcc_s go to lib/compat; everything else is copied.
is_glibc() {
  case "$1" in
    linux-vdso.so.*|ld-linux-*.so.*|libc.so.*|libm.so.*|libpthread.so.*|libdl.so.*|librt.so.*|libresolv.so.*|libutil.so.*|libanl.so.*) return 0 ;;
    *) return 1 ;;
  esac
}

# "soname<TAB>path" for each library ldd resolves ("name => path (0x...)");
# paths may hold spaces.
resolved_libs() {
  LD_LIBRARY_PATH="${2:-}" ldd "$1" | sed -n 's/^[[:space:]]*\([^[:space:]]*\) => \(.*[^[:space:]]\)[[:space:]]*(0x[0-9a-f]*)$/\1\t\2/p;
                                          s/^[[:space:]]*\([^[:space:]]*\) => not found$/\1\tnot found/p'
}

mkdir -p "$stage/bin" "$stage/lib/compat" "$stage/fake-driver"
for program in "${programs[@]}"; do
  name=$(basename "$program")
  if command -v strip >/dev/null; then
    strip --strip-debug -o "$stage/bin/$name" "$program"
  else
    cp "$program" "$stage/bin/$name"
  fi
  while IFS=$'\t' read -r soname path; do
    [[ -n "$soname" ]] || continue
    is_glibc "$soname" && continue
    [[ "$path" == "not found" ]] && die "$program needs $soname, which is not found on this machine"
    [[ -f "$path" ]] || die "$program: ldd printed '$soname $path', which is not a file"
    case "$soname" in
      libcuda.so*) die "$program links $soname; it must dlopen the driver instead" ;;
      libstdc++.so.*|libgcc_s.so.*) dest="$stage/lib/compat" ;;
      *) dest="$stage/lib" ;;
    esac
    [[ -f "$dest/$soname" ]] || cp -L "$path" "$dest/$soname"
  done < <(resolved_libs "$program")
done
cp "$build/tests/gpu/fake-driver/libcuda.so.1" "$stage/fake-driver/"
cp "$here/run_gpu_checks.sh" "$stage/run_gpu_checks.sh"
chmod +x "$stage/run_gpu_checks.sh"

# Every library the bundle's programs load must come from the bundle or glibc.
for program in "$stage"/bin/*; do
  while IFS=$'\t' read -r soname path; do
    is_glibc "$soname" && continue
    case "$path" in
      "$stage"/lib/*) ;;
      *) die "$(basename "$program") would load $soname from $path, not from the bundle" ;;
    esac
  done < <(resolved_libs "$program" "$stage/lib:$stage/lib/compat")
done

# The newest symbol versions the bundle needs from the node (objdump, where installed).
needs=""
if command -v objdump >/dev/null; then
  shopt -s nullglob
  newest() { sort -t. -k2,2n -k3,3n -u | tail -1; }
  glibc=$(for f in "$stage"/bin/* "$stage"/lib/*.so*; do objdump -T "$f"; done | grep -o 'GLIBC_2\.[0-9]*' | newest || true)
  glibcxx=$(for f in "$stage"/bin/* "$stage"/lib/*.so*; do objdump -T "$f"; done | grep -o 'GLIBCXX_3\.4\.[0-9]*' | newest || true)
  compat=$(for f in "$stage"/lib/compat/*; do objdump -T "$f"; done | grep -o 'GLIBC_2\.[0-9]*' | newest || true)
  shopt -u nullglob
  needs="needs ${glibc:-?} and ${glibcxx:-?} (lib/compat brings libstdc++ where the node has ${compat:-?})"
fi

commit=$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)
dirty=$(git -C "$root" status --porcelain 2>/dev/null | grep -qv '^??' && echo "+changes" || true)
{
  echo "weightd GPU-check bundle, commit $commit$dirty, made $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m) glibc $(ldd --version | head -1 | awk '{print $NF}')"
  [[ -z "$needs" ]] || echo "$needs"
  (cd "$stage" && find . -type f ! -name MANIFEST | sort | while read -r f; do echo "$(du -k "$f" | cut -f1) KiB $f"; done)
} >"$stage/MANIFEST"
chmod 755 "$stage"  # mktemp made it 0700
# Checked above: $out is absent, empty, or an earlier bundle.
rm -rf "$out"
mv "$stage" "$out"
trap - EXIT
say "bundle: $(du -sh "$out" | cut -f1) in $(find "$out" -type f | wc -l) files; run BUNDLE/run_gpu_checks.sh on the GPU machine"
echo "$out"
