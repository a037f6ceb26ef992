#!/bin/bash
# Installs the Debian 12 packages tandem needs. Quiet and quick when they are already there.
# OpenBLAS (OpenMP build) is what LibTorch runs its matrix products on; libblas3, the reference
# BLAS, stays installed only so that the tests can check that a run on it is reported. clang and
# its sanitizer runtimes (libclang-rt-dev): scripts/test.sh compiles the sanitizer build with clang,
# and the fuzz test needs its libFuzzer.
set -euo pipefail
pkgs=(build-essential cmake ninja-build ccache pkg-config
      libtorch-dev libgloo-dev libyaml-cpp-dev nlohmann-json3-dev libcli11-dev libxxhash-dev
      libgtest-dev libgmock-dev libbenchmark-dev iproute2 procps
      libopenblas0-openmp libblas3 clang libclang-rt-dev)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO=sudo
echo "installing: ${missing[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" > /dev/null
