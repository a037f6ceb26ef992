#!/bin/bash
# The GPU check: for a machine with one NVIDIA GPU, CUDA and a Python torch 2.x, but no network
# and no apt. It builds tandem against that torch, runs the tests that use the GPU (every
# precision mode, fp8 where the GPU has it, NCCL with a world of 1, resume with the CUDA RNG) and
# trains a GPT-2-small-shaped model (12 layers, 12 heads, width 768, context 1024, byte
# vocabulary) with tandem and with PyTorch eager on the same GPU. Everything it prints also goes
# to OUT_DIR/gpu-check.txt, the figures to OUT_DIR/gpu-figures.txt. Meant to finish in 8 minutes.
#
# Prepare on a machine with apt, in the repository (the .deb files travel with the tree):
#   ../shared/gpu/fetch-debs.sh .gpu-debs libgloo-dev && echo /.gpu-debs/ >> .git/info/exclude
# Then on the GPU machine, from the repository root:
#   scripts/gpu-check.sh OUT_DIR
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-${OUT:-$root/gpu-check-out}}
mkdir -p "$out"
exec > >(tee "$out/gpu-check.txt") 2>&1
figures=$out/gpu-figures.txt
: > "$figures"
start=$(date +%s)
stamp() { echo "== $(( $(date +%s) - start )) s: $*"; }
py=${TANDEM_PYTHON:-python3}

stamp "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader || true
"$py" - <<'PY'
import os, torch
inc = os.path.join(os.path.dirname(torch.__file__), "include")
print("torch", torch.__version__, "CUDA", torch.version.cuda, "cxx11 ABI", torch.compiled_with_cxx11_abi())
print("GPU", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
print("c10d headers:", os.path.isdir(os.path.join(inc, "torch/csrc/distributed/c10d")),
      "gloo headers:", os.path.isdir(os.path.join(inc, "gloo")))
PY
cap=$("$py" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability(0))')
torch_prefix=$("$py" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')

stamp "unpack the Debian packages that travelled in .gpu-debs"
deps=/opt/tandem-deps
mkdir -p "$deps"
for f in "$root"/.gpu-debs/*.deb; do dpkg-deb -x "$f" "$deps"; done
export LD_LIBRARY_PATH=$deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}

stamp "configure and build (CUDA arch $cap)"
build=$root/build-gpu
TORCH_CUDA_ARCH_LIST=$cap cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$deps/usr;$torch_prefix" -DTANDEM_USE_CCACHE=OFF -DTANDEM_BUILD_BENCH=OFF \
  -DCMAKE_CXX_FLAGS="-I$deps/usr/include" > "$out/configure.log" 2>&1 || { tail -40 "$out/configure.log"; exit 1; }
grep "tandem:" "$out/configure.log"
targets="tandem_cli train_gpt unit_tests precision_tests precision_dist_tests precision_worker
         checkpoint_dist_tests resume_worker dist_tests collectives_worker ddp_tests ddp_worker"
# shellcheck disable=SC2086
ninja -C "$build" -j "$(nproc)" $targets > "$out/build.log" 2>&1 || { grep -B2 -A10 "error" "$out/build.log" | head -80; exit 1; }
"$build/bin/tandem" env | tee -a "$figures"

stamp "tests that use the GPU"
cd "$build"
ctest --output-on-failure -j 4 --timeout 300 -R "Precision|GpuModes|Cuda|CUDA|Nccl|NCCL|Resume|Collectives|DataParallel" \
  2>&1 | tail -60
cd "$root"

stamp "GPT-2-small-shaped training, tandem vs PyTorch eager, bf16"
gpt_args=(--context 1024 --layers 12 --heads 12 --width 768)
t=$("$build/bin/tandem" launch --num_processes 1 "$build/examples/train_gpt" "${gpt_args[@]}" \
      --batch-size 8 --steps 40 --eval-every 1000 --mixed_precision bf16 2>&1 | tee /dev/stderr | grep -o "[0-9]* tokens/s" | tail -1)
p=$("$py" "$root/bench/gpt_eager.py" --device cuda "${gpt_args[@]}" --batch 8 --steps 30 --bf16 2>&1 | tee /dev/stderr | grep RESULT)
echo "tandem train_gpt bf16: $t" | tee -a "$figures"
echo "PyTorch eager bf16: $p" | tee -a "$figures"
stamp "done"
