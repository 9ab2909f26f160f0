#!/usr/bin/env bash
# The framework tests against PyPI's current torch and transformers (not run
# by CI: torch from PyPI brings several GiB of CUDA wheels). Makes a venv
# without system site packages in DIR (kept for the next run), installs
# torch, transformers, numpy, pytest and this checkout's package
# (pip install ./client/python) there, then runs tests/python/frameworks,
# tests/python/test_torch_load.py and the dtype tests of test_client.py (the
# dtypes only a current torch has: float8, F8_E8M0, F4, uint16-64) against
# the daemon of BUILD (default: build).
#   scripts/test-current-torch.sh /tmp/weightd-current-torch [BUILD]
set -euo pipefail
dir=${1:?usage: scripts/test-current-torch.sh DIR [BUILD]}
root=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${2:-$root/build}" && pwd)
python=${WEIGHTD_PIP_PYTHON:-/usr/bin/python3}
if command -v ccache >/dev/null; then
  export CMAKE_ARGS="-DCMAKE_CXX_COMPILER_LAUNCHER=ccache ${CMAKE_ARGS:-}"
fi

[ -x "$dir/bin/python" ] || "$python" -m venv "$dir"
"$dir/bin/python" -m pip install --quiet --disable-pip-version-check torch transformers numpy pytest
"$dir/bin/python" -m pip uninstall --quiet --yes weightd 2>/dev/null || true
"$dir/bin/python" -m pip install --quiet --disable-pip-version-check "$root/client/python"
"$dir/bin/python" -c 'import sys, torch, transformers, weightd; print("python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__, "weightd", weightd.__file__)'
cd "$root"
WEIGHTD_BINARY=$build/server/weightd WEIGHTCTL_BINARY=$build/client/weightctl PYTHONDONTWRITEBYTECODE=1 \
  "$dir/bin/python" -m pytest -q -rs -p no:cacheprovider tests/python/frameworks tests/python/test_torch_load.py \
  tests/python/test_client.py::test_hand_made_dtypes_export_or_name_the_dtype \
  tests/python/test_client.py::test_weights_iterator_yields_e8m0_scales_and_f4_where_torch_has_them \
  tests/python/test_client.py::test_real_checkpoint_tensors_equal_the_files
