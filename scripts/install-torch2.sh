#!/bin/bash
# Installs LibTorch 2.x (PyPI's CUDA torch wheel) and the Python tools tandem's tests use as
# oracles (safetensors, tensorboard, accelerate, transformers) into a virtual environment in the
# cache directory, every version pinned by scripts/requirements-torch2.txt. Quick when it is
# already there. Prints the environment's folder on stdout; with --path, prints it and installs
# nothing (scripts/test.sh configures its first build with it while the environment installs).
#   TANDEM_CACHE   where the environment lives (default: ${XDG_CACHE_HOME:-~/.cache}/tandem)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
req=$root/scripts/requirements-torch2.txt
cache=${TANDEM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tandem}
venv=$cache/venv-torch2
stamp=$venv/.tandem-requirements
if [ "${1:-}" = --path ]; then
  echo "$venv"
  exit 0
elif [ $# -gt 0 ]; then
  echo "install-torch2: unknown argument '$1'; the only one is --path (print the folder)" >&2
  exit 2
fi
if [ -f "$stamp" ] && cmp -s "$stamp" "$req"; then
  echo "$venv"
  exit 0
fi
mkdir -p "$cache"
py=${TANDEM_PYTHON:-python3}
if ! "$py" -m venv --help > /dev/null 2>&1 || ! "$py" -c 'import ensurepip' 2> /dev/null; then
  echo "install-torch2: installing python3-venv" >&2
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends python3-venv python3-pip > /dev/null
fi
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv" >&2
echo "install-torch2: installing $(grep -c '==' "$req") pinned packages into $venv (torch: several GB on a fresh machine)" >&2
"$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$req" >&2
cp "$req" "$stamp"
echo "$venv"
