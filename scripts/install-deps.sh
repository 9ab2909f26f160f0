#!/usr/bin/env bash
# Installs the Debian 12 packages weightd builds and tests with, skipping
# those already present. Runs apt-get as root, or through sudo.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev nlohmann-json3-dev prometheus-cpp-dev libcli11-dev
  libssl-dev libgtest-dev libgmock-dev libxxhash-dev libsystemd-dev libdlpack-dev libucx-dev libseccomp-dev
  python3-yaml
  python3-dev pybind11-dev python3-pybind11 python3-grpcio python3-grpc-tools
  python3-pytest python3-numpy python3-torch
  mypy  # `mypy --strict` over the Python package (CTest python_mypy)
  # python_frameworks and python_pip_install make venvs and pip-install into
  # them from PyPI (scripts/python-venvs.sh, scripts/check-pip-install.sh).
  python3-venv ccache
)
# Tests only: promtool checks the /metrics exposition and tests/e2e starts a
# Prometheus server against a test daemon (weightd itself does not need it).
# On a machine running systemd the package also enables its own prometheus
# service on :9090; `systemctl disable --now prometheus` if unwanted.
packages+=(prometheus)
packages+=("$@")

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "install-deps: installing ${missing[*]}" >&2
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
