#!/bin/bash
# bench/run section: context parallel against the context length, on one small Llama
# (bench/context_parallel_bench.cpp: 2 layers, width 128, 4 heads over 2 key/value heads):
# tokens/s, peak tensor memory and peak resident memory (VmHWM) per rank for plain LibTorch on
# one process, plain data parallel on 4 (each rank whole sequences) and context parallel on 4
# (cp 4 by the ring, cp 4 by Ulysses' all-to-all of heads, and dp 2 x cp 2: every sequence
# split), and the longest context each fits under a per-rank budget of resident memory.
# Runs alone too: bench/sections/58-context-parallel.sh BUILD_DIR CLI (env REPS, default 2;
# STEPS, default 2 timed steps after 1 warm-up step; LENGTHS, default "1024 2048 4096 8192";
# DP_MAX, the longest context data parallel runs at, default 4096: at 8192 its four ranks
# would need more than this machine's memory; BUDGET_MB, default 1024).
set -euo pipefail
build=$1
cli=$2
reps=${REPS:-2}
steps=${STEPS:-2}
lengths=${LENGTHS:-1024 2048 4096 8192}
dp_max=${DP_MAX:-4096}
budget_mb=${BUDGET_MB:-1024}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# shellcheck source=lib/common.sh
source "$(dirname "$0")/lib/common.sh"
export OMP_NUM_THREADS=1
use_launch_blas_kernels "$cli"
bench=$build/bench/context_parallel_bench
keys="tokens_per_s step_s peak_tensor_bytes peak_rss_bytes loss"
L4=("$cli" launch -q --num_processes 4 --cpu --num_cpu_threads_per_process 1)
configs=()
for len in $lengths; do
  [ "$len" -le "$dp_max" ] && configs+=("plain:$len" "dp4:$len")
  configs+=("cp4:$len" "cp4u:$len" "dp2cp2:$len")
done
for ((r = 1; r <= reps; ++r)); do
  echo "bench/run: context-parallel repetition $r/$reps" >&2
  for c in "${configs[@]}"; do
    kind=${c%%:*}; len=${c##*:}
    args=(--seq_len "$len" --steps "$steps" --warmup 1)
    case $kind in
      plain) record "$c" "$keys" "$bench" plain --batch 1 "${args[@]}" ;;
      dp4) record "$c" "$keys" "${L4[@]}" "$bench" acc --batch 4 "${args[@]}" ;;
      cp4) record "$c" "$keys" "${L4[@]}" --cp_size 4 "$bench" acc --batch 1 "${args[@]}" ;;
      cp4u) record "$c" "$keys" "${L4[@]}" --cp_size 4 --cp_comm_strategy ulysses "$bench" acc \
              --batch 1 "${args[@]}" ;;
      dp2cp2) record "$c" "$keys" "${L4[@]}" --cp_size 2 "$bench" acc --batch 2 "${args[@]}" ;;
    esac
  done
done
mb() { awk -v b="$1" 'BEGIN { if (b == "nan") print "-"; else printf "%.0f", b / 1048576 }'; }
echo
echo "## Context parallel (Llama 2 layers, width 128, 4 heads over 2 key/value heads, vocab 256; 4 processes x 1 thread)"
echo
echo "Command: \`bench/sections/58-context-parallel.sh\`: \`context_parallel_bench plain --batch 1\` (one process, plain LibTorch), \`tandem launch --num_processes 4 --cpu --num_cpu_threads_per_process 1 [--cp_size c] context_parallel_bench acc --batch B\` with B = 4 (dp 4: one whole sequence per rank), 1 (cp 4: one sequence split over the 4 ranks; \`--cp_comm_strategy ulysses\` for Ulysses) or 2 (dp 2 x cp 2), \`--seq_len L --steps $steps --warmup 1\`. AdamW; tokens/s over all ranks; peak tensor MB from tandem's counting allocator over the timed steps and peak RSS (VmHWM, the whole process) per rank, the largest rank's; every figure the median of $reps runs (±: (max - min) / median). Data parallel stops at $dp_max tokens: its 4 ranks at twice that would need more than this machine's memory."
echo "- $("$cli" env | grep '^BLAS: ')"
echo "- $("$cli" env | grep '^BLAS kernels: ')"
echo
echo "| context | layout | tokens/s | step s | peak tensor MB per rank | peak RSS MB per rank | loss, last step |"
echo "|---|---|---|---|---|---|---|"
for c in "${configs[@]}"; do
  kind=${c%%:*}; len=${c##*:}
  case $kind in
    plain) label="plain LibTorch, 1 process" ;;
    dp4) label="data parallel 4" ;;
    cp4) label="context parallel 4 (ring)" ;;
    cp4u) label="context parallel 4 (Ulysses)" ;;
    dp2cp2) label="dp 2 x cp 2" ;;
  esac
  printf "| %s | %s | %s ±%s%% | %s | %s | %s | %s |\n" "$len" "$label" \
    "$(awk -v v="$(median "$c.tokens_per_s")" 'BEGIN { printf "%.0f", v }')" "$(spread "$c.tokens_per_s")" \
    "$(awk -v v="$(median "$c.step_s")" 'BEGIN { printf "%.2f", v }')" \
    "$(mb "$(median "$c.peak_tensor_bytes")")" "$(mb "$(median "$c.peak_rss_bytes")")" \
    "$(median "$c.loss")"
done
echo
# The longest context of each layout whose peak RSS per rank stayed within the budget.
for kind in dp4 cp4 cp4u dp2cp2; do
  best=-
  for len in $lengths; do
    [ -f "$work/$kind:$len.peak_rss_bytes" ] || continue
    rss=$(median "$kind:$len.peak_rss_bytes")
    awk -v r="$rss" -v b="$budget_mb" 'BEGIN { exit !(r != "nan" && r / 1048576 <= b) }' && best=$len
  done
  echo "- longest context within $budget_mb MB of resident memory per rank, $kind: $best tokens"
done
