#!/usr/bin/env bash
# The venv the framework tests run in (CTest runs this as the fixture test
# python_frameworks_venv; scripts/test.sh runs CTest):
#   DIR/frameworks   Debian's /usr/bin/python3 with --system-site-packages, so
#                    torch 1.13, numpy, grpcio, protobuf and pytest come from apt
#                    (scripts/install-deps.sh), plus the pinned transformers of
#                    tests/python/frameworks/requirements.txt from PyPI.
# Kept while that requirements file is unchanged; pip's downloads are cached
# in DIR/pip-cache. Needs PyPI (or PIP_INDEX_URL / PIP_FIND_LINKS) the first time.
set -euo pipefail
dir=${1:?usage: scripts/python-venvs.sh DIR}
root=$(cd "$(dirname "$0")/.." && pwd)
requirements=$root/tests/python/frameworks/requirements.txt
venv=$dir/frameworks

if [ -x "$venv/bin/python" ] && cmp -s "$requirements" "$venv/requirements.txt"; then
  exit 0
fi
rm -rf "$venv"
/usr/bin/python3 -m venv --system-site-packages "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --cache-dir "$dir/pip-cache" -r "$requirements"
cp "$requirements" "$venv/requirements.txt"
echo "python-venvs: $venv ready ($("$venv/bin/python" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
