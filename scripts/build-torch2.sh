#!/bin/bash
# Builds tandem against LibTorch 2.x with CUDA (PyPI's torch wheel, installed by
# scripts/install-torch2.sh) in build-torch2/. CUDA code compiles and links with the CUDA
# toolkit found (CUDAToolkit_ROOT, default /usr/local/cuda); no GPU is needed to build.
# Extra arguments and TANDEM_BUILD_TARGETS are handed to scripts/build.sh.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=$("$root/scripts/install-torch2.sh")
torch_prefix=$("$venv/bin/python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')
cuda=${CUDAToolkit_ROOT:-/usr/local/cuda}
export TANDEM_BUILD_DIR=${TANDEM_BUILD_DIR:-$root/build-torch2}
# No GPU to detect the architecture from: Hopper (sm_90) unless the caller says otherwise.
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
exec "$root/scripts/build.sh" -DCMAKE_PREFIX_PATH="$torch_prefix" -DCUDAToolkit_ROOT="$cuda" \
  -DCMAKE_CUDA_COMPILER="$cuda/bin/nvcc" -DTANDEM_PYTHON="$venv/bin/python" "$@"
