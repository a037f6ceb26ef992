#!/bin/bash
# Builds tandem against LibTorch 2.x with CUDA (PyPI's torch wheel, installed by
# scripts/install-torch2.sh) in build-torch2/. CUDA code compiles and links with the CUDA
# toolkit found (CUDAToolkit_ROOT, default /usr/local/cuda); no GPU is needed to build.
# Extra arguments and TANDEM_BUILD_TARGETS are handed to scripts/build.sh.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=$("$root/scripts/install-torch2.sh")
# The wheel's folder, found without importing torch (2 s of CPU, loading its CUDA libraries):
# torch.utils.cmake_prefix_path is its share/cmake.
torch_dir=$("$venv/bin/python" -c \
  'import importlib.util, os; print(os.path.dirname(importlib.util.find_spec("torch").origin))')
torch_prefix=$torch_dir/share/cmake
cuda=${CUDAToolkit_ROOT:-/usr/local/cuda}
export TANDEM_BUILD_DIR=${TANDEM_BUILD_DIR:-$root/build-torch2}
# No GPU to detect the architecture from: Hopper (sm_90) unless the caller says otherwise.
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
# Python_EXECUTABLE: the wheel's Caffe2 config looks for a Python interpreter (1.5 s of searching);
# it gets the environment's.
"$root/scripts/build.sh" -DCMAKE_PREFIX_PATH="$torch_prefix" -DCUDAToolkit_ROOT="$cuda" \
  -DCMAKE_CUDA_COMPILER="$cuda/bin/nvcc" -DTANDEM_PYTHON="$venv/bin/python" \
  -DPython_EXECUTABLE="$venv/bin/python" "$@"
# Note [Two LibTorch installations]: the library must load one LibTorch, the wheel's, and none of
# a system LibTorch (Debian's libtorch-dev) beside it.
lib=$TANDEM_BUILD_DIR/src/libtandem.so
if [ -f "$lib" ]; then
  torch_lib=$(realpath "$torch_dir/lib")
  linked=$(ldd "$lib" | awk '$1 ~ /^lib(torch|c10)/ {print $1 " " $3}')
  outside=$(echo "$linked" | while read -r name path; do
    [ "$(dirname "$(realpath -m "$path")")" = "$torch_lib" ] || echo "  $name => $path"
  done)
  if [ -z "$linked" ] || [ -n "$outside" ]; then
    echo "build-torch2: $lib links LibTorch libraries outside $torch_lib:${outside:- none found}" >&2
    ldd "$lib" >&2
    exit 1
  fi
  echo "build-torch2: $lib links one LibTorch ($torch_lib): $(echo "$linked" | awk '{print $1}' | paste -sd ' ')"
fi
