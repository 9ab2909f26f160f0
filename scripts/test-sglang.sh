#!/usr/bin/env bash
# weightd.sglang against the real SGLang 0.5.23 on the CPU
# (tests/python/engines/test_sglang.py; docs/integration.md "SGLang").
# Not part of .ci/run: SGLang's venv is 11 GB and took 13 minutes to install
# on the 2-core CI machine with a warm network (776 s), which with the main
# tests (~13 min) and scripts/test-engines.sh would crowd CI's 45 minutes;
# run it by hand or in a nightly job. The venv is kept under build/ while
# tests/python/engines/sglang.txt is unchanged (pip's cache: ~/.cache/pip).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
venvs=$root/build/python-venvs
start=$(date +%s)
[ -x build/server/weightd ] && [ -x build/client/weightctl ] || ./scripts/build.sh weightd weightctl

./scripts/engine-venvs.sh "$venvs" sglang
python=$venvs/sglang/bin/python
export PIP_DISABLE_PIP_VERSION_CHECK=1
if command -v ccache >/dev/null; then
  export CMAKE_ARGS="-DCMAKE_CXX_COMPILER_LAUNCHER=ccache ${CMAKE_ARGS:-}"
fi
rm -rf "$venvs/sglang-wheels"
"$python" -m pip wheel --quiet --no-deps --wheel-dir "$venvs/sglang-wheels" \
  --config-settings=build-dir="$venvs/engine-wheel-build" "$root/client/python"
"$python" -m pip install --quiet --no-deps --force-reinstall "$venvs"/sglang-wheels/weightd-*.whl
echo "test-sglang: venv and weightd wheel ready in $(( $(date +%s) - start )) s"

export WEIGHTD_BINARY=$root/build/server/weightd WEIGHTCTL_BINARY=$root/build/client/weightctl
export WEIGHTD_REQUIRE_ENGINES=1
"$python" -m pytest -q -rs -p no:cacheprovider tests/python/engines/test_sglang.py
echo "test-sglang: done in $(( $(date +%s) - start )) s"
