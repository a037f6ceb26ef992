#!/bin/bash
# bench/run section: the pipeline schedules side by side on 2 processes, one small GPT (6 blocks
# of examples/common/gpt.h in a Sequential): GPipe, 1F1B, interleaved 1F1B (2 stages per rank)
# and zero bubble at 4 and 8 micro-batches; each schedule's bubble by its formula beside the one
# measured inside the pipeline (each rank's idle share of its schedule: 1 - compute / schedule
# time, Pipeline::last_step_times), step time and per-rank peak tensor memory.
# Runs alone too: bench/sections/55-pipeline-schedules.sh BUILD_DIR CLI (env REPS, default 3;
# STEPS, default 10 timed steps after 2 warm-up steps).
set -euo pipefail
build=$1
cli=$2
reps=${REPS:-3}
steps=${STEPS:-10}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# shellcheck source=lib/common.sh
source "$(dirname "$0")/lib/common.sh"
export OMP_NUM_THREADS=1
# The OpenBLAS kernels tandem launch gives its ranks (Note [OpenBLAS kernels] in bench/run).
use_launch_blas_kernels "$cli"
bench=$build/bench/model_parallel_bench
batch=32
args=(--batch $batch --steps "$steps" --warmup 2 --layers 6)
L2=("$cli" launch -q --num_processes 2 --cpu --num_cpu_threads_per_process 1 --pp_size 2)
# one NAME CMD...: the values of CMD's RESULT line in $work/NAME.<key> (lib/common.sh's record).
one() {
  local name=$1
  shift
  record "$name" "samples_per_s step_s loss schedule_bubble measured_idle" "$@"
}
configs=()
for m in 4 8; do
  for s in gpipe 1f1b interleaved_1f1b zero_bubble; do configs+=("$s:$m"); done
done
for ((r = 1; r <= reps; ++r)); do
  echo "bench/run: pipeline-schedules repetition $r/$reps" >&2
  for c in "${configs[@]}"; do
    s=${c%%:*}; m=${c##*:}
    v=1; [ "$s" = interleaved_1f1b ] && v=2
    one "$s-$m" "${L2[@]}" "$bench" pp --schedule "$s" --virtual_stages $v --microbatches "$m" "${args[@]}"
  done
done
echo
echo "## Pipeline schedules (GPT 6 blocks, width 256, 4 heads, context 64, vocab 256; global batch $batch; pp 2, 2 processes x 1 thread)"
echo
echo "Command: \`bench/sections/55-pipeline-schedules.sh\`: \`tandem launch --num_processes 2 --cpu --num_cpu_threads_per_process 1 --pp_size 2 model_parallel_bench pp --schedule S --virtual_stages v --microbatches m --batch $batch --steps $steps --warmup 2 --layers 6\`; the model of the model-parallel section with 6 blocks (8 entries: embeddings, 6 blocks, head), cut by entries into 2 stages (embeddings + 3 blocks, 3 blocks + head) or, for interleaved 1F1B, 4 (rank 0 holds entries 0-1 and 4-5, rank 1 entries 2-3 and 6-7: 3 blocks each). AdamW; every figure the median of $reps runs (±: (max - min) / median)."
echo "Schedule bubble: the formula of each schedule's idle share with a backward twice a forward (Note [Pipeline schedules]): GPipe and 1F1B (p-1)/(m+p-1), interleaved (p-1)/(vm+p-1), zero bubble 2(p-1)/(3m+2(p-1)). Measured: each rank's share of its schedule's time spent outside forwards, losses and backwards (waiting for a neighbour, and the transfers themselves), averaged over the ranks and the timed steps."
echo "- $("$cli" env | grep '^BLAS: ')"
echo "- $("$cli" env | grep '^BLAS kernels: ')"
echo
echo "| schedule | m | schedule bubble | measured bubble | step s | samples/s | peak tensor MB rank 0 | peak tensor MB rank 1 | loss, last step |"
echo "|---|---|---|---|---|---|---|---|---|"
for c in "${configs[@]}"; do
  s=${c%%:*}; m=${c##*:}
  case $s in
    gpipe) label=GPipe ;;
    1f1b) label=1F1B ;;
    interleaved_1f1b) label="interleaved 1F1B, 2 stages per rank" ;;
    zero_bubble) label="zero bubble" ;;
  esac
  n="$s-$m"
  printf "| %s | %s | %s | %s ±%s%% | %s | %s ±%s%% | %s | %s | %s |\n" "$label" "$m" \
    "$(awk -v v="$(median $n.schedule_bubble)" 'BEGIN { printf "%.3f", v }')" \
    "$(awk -v v="$(median $n.measured_idle)" 'BEGIN { printf "%.3f", v }')" "$(spread $n.measured_idle)" \
    "$(awk -v v="$(median $n.step_s)" 'BEGIN { printf "%.3f", v }')" \
    "$(awk -v v="$(median $n.samples_per_s)" 'BEGIN { printf "%.1f", v }')" "$(spread $n.samples_per_s)" \
    "$(awk -v b="$(median $n.peak0)" 'BEGIN { if (b == "nan") print "-"; else printf "%.1f", b / 1e6 }')" \
    "$(awk -v b="$(median $n.peak1)" 'BEGIN { if (b == "nan" || b == "") print "-"; else printf "%.1f", b / 1e6 }')" \
    "$(median $n.loss)"
done
