#!/bin/bash
# Configures tests/torch_resolve against each LibTorch installation found (Debian's libtorch-dev,
# the torch wheel of scripts/install-torch2.sh, the one this build uses), chosen in each of the
# three ways a user may (-DTorch_DIR, CMAKE_PREFIX_PATH = its share/cmake/Torch folder or the
# share/cmake folder above it), and checks that Torch, Caffe2 and the libraries all come from
# that installation. With two installations, also checks that a Torch found without
# TandemFindTorch.cmake, with the other's Caffe2, is refused naming both. Configure only.
set -uo pipefail
src=${1:?usage: run.sh SOURCE_DIR [TORCH_DIR...]}
shift
work=$(mktemp -d /tmp/tandem-torch-resolve-XXXXXX)
trap 'rm -rf "$work"' EXIT
dirs=("$@")
[ -f /usr/lib/x86_64-linux-gnu/cmake/Torch/TorchConfig.cmake ] && dirs+=(/usr/lib/x86_64-linux-gnu/cmake/Torch)
py=${TANDEM_PYTHON:-}
[ -n "$py" ] || py=${TANDEM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tandem}/venv-torch2/bin/python
if [ -x "$py" ]; then
  # The wheel's folder, found without importing torch; its share/cmake is
  # torch.utils.cmake_prefix_path.
  wheel_dir=$("$py" -c 'import importlib.util, os; print(os.path.dirname(importlib.util.find_spec("torch").origin))' \
    2> /dev/null) && dirs+=("$wheel_dir/share/cmake/Torch")
fi
# The wheel's Caffe2 config detects the machine's GPUs (a try_run of about 2 s per configure)
# unless it is given the architectures, as scripts/build-torch2.sh gives them; which ones does
# not change what is resolved.
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
cuda=${CUDAToolkit_ROOT:-/usr/local/cuda}
extra=()
[ -x "$cuda/bin/nvcc" ] && extra=(-DCUDAToolkit_ROOT="$cuda" -DCMAKE_CUDA_COMPILER="$cuda/bin/nvcc")
# The wheel's Caffe2 config looks for a Python interpreter (1.5 s of searching per configure): the
# environment's, as scripts/build-torch2.sh gives it; which one does not change what is resolved.
[ -x "$py" ] && extra+=(-DPython_EXECUTABLE="$py")
# One folder per installation, each once.
mapfile -t dirs < <(for d in "${dirs[@]}"; do [ -f "$d/TorchConfig.cmake" ] && realpath "$d"; done | sort -u)
[ "${#dirs[@]}" -ge 1 ] || { echo "no LibTorch installation found"; exit 1; }
failed=0
n=0
configure() {  # configure NAME ARGS...: configures into $work/NAME; output in $work/NAME.log
  local name=$1
  shift
  cmake -S "$src/tests/torch_resolve" -B "$work/$name" -DTANDEM_SOURCE_DIR="$src" "${extra[@]}" \
    "$@" > "$work/$name.log" 2>&1
}
value() { sed -n "s|^$1=||p" "$work/$2/resolved.txt"; }
for dir in "${dirs[@]}"; do
  cmake_dir=$(dirname "$dir")
  want_caffe2=$cmake_dir/Caffe2
  for way in torch_dir prefix_torch prefix_share; do
    n=$((n + 1))
    case $way in
      torch_dir) args=(-DTorch_DIR="$dir") ;;
      prefix_torch) args=(-DCMAKE_PREFIX_PATH="$dir") ;;
      prefix_share) args=(-DCMAKE_PREFIX_PATH="$cmake_dir") ;;
    esac
    if ! configure "$n" "${args[@]}"; then
      echo "FAIL $dir ($way): configure failed:"; tail -20 "$work/$n.log"; failed=1; continue
    fi
    got_torch=$(realpath "$(value Torch_DIR "$n")")
    got_caffe2=$(realpath "$(value Caffe2_DIR "$n")")
    # The folders of the LibTorch libraries linked (TORCH_LIBRARIES, torch_cpu's and c10's files).
    libdir=$(for lib in $(value libraries "$n" | tr ';' ' ') $(value targets "$n" | tr ';' ' '); do
      case $(basename "$lib") in libtorch* | libc10*) dirname "$(realpath "$lib")" ;; esac
    done | sort -u | paste -sd ' ')
    problems=""
    [ "$got_torch" = "$dir" ] || problems+=" Torch_DIR=$got_torch"
    [ "$got_caffe2" = "$want_caffe2" ] || problems+=" Caffe2_DIR=$got_caffe2 (want $want_caffe2)"
    [[ -n "$libdir" && "$libdir" != *" "* ]] || problems+=" libraries from: $libdir"
    if [ -n "$problems" ]; then
      echo "FAIL $dir ($way):$problems"; failed=1
    else
      echo "ok   $dir ($way): Caffe2 $got_caffe2, libraries in $libdir"
    fi
  done
done
# Two installations: a Torch found without TandemFindTorch.cmake takes the system's Caffe2 for
# the other one (TorchConfig's PATHS come last); the check after find_package refuses it.
if [ "${#dirs[@]}" -ge 2 ]; then
  for dir in "${dirs[@]}"; do
    other=""
    for d in "${dirs[@]}"; do [ "$d" != "$dir" ] && other=$d; done
    n=$((n + 1))
    if configure "$n" -DTANDEM_SKIP_FIND_TORCH=ON -DTorch_DIR="$dir" \
        -DCaffe2_DIR="$(dirname "$other")/Caffe2"; then
      echo "FAIL $dir with the Caffe2 of $other: configured"; failed=1
    elif grep -q "two LibTorch installations" "$work/$n.log" && grep -q "$(dirname "$other")" "$work/$n.log"; then
      echo "ok   $dir with the Caffe2 of $other: refused naming both"
    else
      echo "FAIL $dir with the Caffe2 of $other: failed without naming both:"; tail -20 "$work/$n.log"
      failed=1
    fi
  done
else
  echo "(one LibTorch installation: the refusal of a mixed pair is not exercised)"
fi
exit $failed
