#!/usr/bin/env bash
# The Python package as a user installs it (CTest: python_pip_install):
# `pip wheel ./client/python` (scikit-build-core compiles the extension from
# this checkout and generates the gRPC stubs), that wheel installed into a
# fresh venv without system site packages (no Debian torch, grpcio or
# protobuf: pip brings grpcio and protobuf), then
# tests/python/pip_install_check.py there, without torch.
# DIR keeps pip's cache and the CMake build folder between runs; the venv is
# made anew each time. WEIGHTD_PIP_PYTHON picks the interpreter (default
# /usr/bin/python3).
set -euo pipefail
dir=${1:?usage: scripts/check-pip-install.sh DIR}
root=$(cd "$(dirname "$0")/.." && pwd)
python=${WEIGHTD_PIP_PYTHON:-/usr/bin/python3}
export PIP_CACHE_DIR=$dir/pip-cache PIP_DISABLE_PIP_VERSION_CHECK=1
if command -v ccache >/dev/null; then
  export CMAKE_ARGS="-DCMAKE_CXX_COMPILER_LAUNCHER=ccache ${CMAKE_ARGS:-}"
fi

rm -rf "$dir/venv" "$dir/wheels"
mkdir -p "$dir"
"$python" -m venv "$dir/venv"
"$dir/venv/bin/python" -m pip wheel --quiet --no-deps --wheel-dir "$dir/wheels" \
  --config-settings=build-dir="$dir/cmake-build" "$root/client/python"
"$dir/venv/bin/python" -m pip install --quiet "$dir"/wheels/weightd-*.whl
"$dir/venv/bin/python" "$root/tests/python/pip_install_check.py"
