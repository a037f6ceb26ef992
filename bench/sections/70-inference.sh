#!/bin/bash
# bench/run section: big-model inference on a GPT-2 of the 124M shape (bench/inference_peer.py):
# transformers' generate() beside generate_gpt2 in memory, under a memory cap with disk offload,
# and int8 / int4 weight-only quantized (tandem quantize), 1 thread each.
# Runs alone too: bench/sections/70-inference.sh BUILD_DIR CLI (env REPS, default 3).
set -euo pipefail
build=$1
cli=$2
root=$(cd "$(dirname "$0")/../.." && pwd)
venv=$("$root/scripts/install-torch2.sh")
work=${tmp:-$(mktemp -d)}/inference
echo "## Big-model inference (GPT-2 124M shape, random weights; 3-token prompt, 20 greedy tokens; 1 thread)"
echo
echo "Command: \`bench/sections/70-inference.sh $build $cli\` (LibTorch of this build; REPS=${REPS:-3}, medians)."
echo
OMP_NUM_THREADS=1 "$venv/bin/python" "$root/bench/inference_peer.py" "$build/examples/generate_gpt2" "$cli" \
  "$work" "${REPS:-3}"
echo
