#!/bin/bash
# bench/run section: big-model inference on a GPT-2 of the 124M shape (bench/inference_peer.py):
# transformers' generate() beside generate_gpt2 in memory, under a memory cap with disk offload,
# and int8 / int4 weight-only quantized (tandem quantize), 1 thread each. Once with this build's
# LibTorch and, when build-torch2/ exists, once with LibTorch 2.x, whose int8/int4 weight kernels
# LibTorch 1.13 lacks (it dequantizes, then multiplies).
# Runs alone too: bench/sections/70-inference.sh BUILD_DIR CLI (env REPS, default 3).
set -euo pipefail
build=$1
cli=$2
root=$(cd "$(dirname "$0")/../.." && pwd)
venv=$("$root/scripts/install-torch2.sh")
work=${tmp:-$(mktemp -d)}/inference
# Note [OpenBLAS kernels] (bench/run): the CPU's own kernels, as tandem launch gives its ranks.
blas_core=$("$cli" env | sed -n 's/.*narrower than this CPU: OPENBLAS_CORETYPE=\([A-Za-z0-9]*\).*/\1/p')
if [ -n "$blas_core" ] && [ -z "${OPENBLAS_CORETYPE:-}" ]; then export OPENBLAS_CORETYPE=$blas_core; fi
echo "## Big-model inference (GPT-2 124M shape, random weights; 3-token prompt, 20 greedy tokens; 1 thread)"
echo
echo "Command: \`bench/sections/70-inference.sh BUILD CLI\` (REPS=${REPS:-3}, medians). Peak resident memory is each process's VmHWM over the whole run, loading included (LibTorch alone is about 160 MB of it with 1.13, 390 MB with 2.x); weights in memory is what the cap or the quantized file leaves resident."
echo
for b in "$build" "$root/build-torch2"; do
  [ -x "$b/examples/generate_gpt2" ] || continue
  [ "$b" = "$root/build-torch2" ] && [ "$b" -ef "$build" ] && continue
  echo "LibTorch $("$b/bin/tandem" env | sed -n 's/^LibTorch version: //p'), BLAS $("$b/bin/tandem" env | sed -n 's/^BLAS: \([a-z]*\).*/\1/p') (\`$(basename "$b")\`):"
  echo
  OMP_NUM_THREADS=1 "$venv/bin/python" "$root/bench/inference_peer.py" "$b/examples/generate_gpt2" \
    "$b/bin/tandem" "$work/$(basename "$b")" "${REPS:-3}"
  echo
done
