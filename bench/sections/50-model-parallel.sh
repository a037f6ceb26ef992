#!/bin/bash
# bench/run section: model parallel on 2 processes, one small GPT (8 blocks of examples/common/
# gpt.h in a Sequential) and one global batch: plain LibTorch on 1 process, data parallel, tensor
# parallel, pipeline parallel (GPipe and 1F1B at 2, 4 and 8 micro-batches) and data parallel with
# activation checkpointing; samples/s, per-rank peak tensor memory, and the pipelines' measured
# bubble beside the schedule's (p - 1) / (m + p - 1).
# Runs alone too: bench/sections/50-model-parallel.sh BUILD_DIR CLI (env REPS, default 3;
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
# The OpenBLAS kernels tandem launch gives its ranks, for the plain process too (Note [OpenBLAS
# kernels] in bench/run).
use_launch_blas_kernels "$cli"
bench=$build/bench/model_parallel_bench
batch=8
args=(--batch $batch --steps "$steps" --warmup 2)
L2=("$cli" launch -q --num_processes 2 --cpu --num_cpu_threads_per_process 1)
# one NAME CMD...: the values of CMD's RESULT line in $work/NAME.<key> (lib/common.sh's record).
one() {
  local name=$1
  shift
  record "$name" "samples_per_s step_s parameters loss" "$@"
}
configs=(plain plain_m2 plain_m4 plain_m8 ddp tp pp_gpipe_m2 pp_gpipe_m4 pp_gpipe_m8 pp_1f1b_m2 pp_1f1b_m4 pp_1f1b_m8 ckpt)
for ((r = 1; r <= reps; ++r)); do
  echo "bench/run: model-parallel repetition $r/$reps" >&2
  for c in "${configs[@]}"; do
    case $c in
      plain) one $c "$bench" plain "${args[@]}" ;;
      plain_m*) one $c "$bench" plain --microbatches "${c#plain_m}" "${args[@]}" ;;
      ddp) one $c "${L2[@]}" "$bench" ddp "${args[@]}" ;;
      ckpt) one $c "${L2[@]}" --activation_checkpointing "$bench" ddp "${args[@]}" ;;
      tp) one $c "${L2[@]}" --tp_size 2 "$bench" tp "${args[@]}" ;;
      pp_*)
        IFS=_ read -r _ sched m <<< "$c"
        one $c "${L2[@]}" --pp_size 2 "$bench" pp --schedule "$sched" --microbatches "${m#m}" "${args[@]}" ;;
    esac
  done
done
plain_step=$(median plain.step_s)
plain_sps=$(median plain.samples_per_s)
echo
echo "## Model parallel (GPT 8 blocks, width 256, 4 heads, context 64, vocab 256, untied head; global batch $batch; 2 processes x 1 thread)"
echo
echo "Command: \`bench/sections/50-model-parallel.sh\`: \`model_parallel_bench plain|ddp|tp|pp --batch $batch --steps $steps --warmup 2\` (plain also with \`--microbatches m\`, accumulated), the parallel modes under \`tandem launch --num_processes 2 --cpu --num_cpu_threads_per_process 1\` plus \`--tp_size 2\` (tp), \`--pp_size 2\` (pp, with \`--schedule gpipe|1f1b --microbatches m\`) or \`--activation_checkpointing\` (ckpt, data parallel)."
echo "The model is one \`torch::nn::Sequential\` (token + position embeddings, 8 \`examples::Block\`s, LayerNorm + Linear head; $(awk -v n="$(median plain.parameters)" 'BEGIN { printf "%.2fM", n / 1e6 }') parameters) for every mode: tp splits every block's q/k/v and MLP input column-wise and their output projections row-wise (\`acc.parallelize\`, plan \`*.attn.qkv\`, \`*.attn.proj\`, \`*.fc\`, \`*.fc_proj\`), every rank running the whole batch; pp cuts the Sequential into stage 0 = embeddings + 4 blocks and stage 1 = 4 blocks + head (\`acc.prepare_pipeline\`), the whole batch in m micro-batches of $batch/m sequences; ddp and ckpt give each rank $((batch / 2)) sequences, ckpt with every entry of the Sequential in \`parallel::Checkpointed\`. AdamW, $steps timed steps after 2 warm-up steps; every figure the median of $reps runs (±: (max - min) / median of samples/s)."
echo "Peak tensor memory: tandem's counting CPU allocator over the timed steps (weights, gradients, AdamW state, activations, communication buffers), per rank. Measured bubble (pp): 1 - (plain step time / p) / pipeline step time, with the plain one-process step on the same global batch ($(printf %.3f "$plain_step") s); it counts everything that keeps the pipeline from p times the plain speed, communication and per-micro-batch overhead included, not only the schedule's idle time; the last column takes the plain process running the same m micro-batches (gradient accumulation) instead, which leaves out the cost of smaller matrix products. Loss: the global batch's loss at the last step, the same in every mode when every mode trains the same model on the same batches."
echo "LibTorch's kernels as it chooses them (oneDNN's GELU included: the counting allocator serves oneDNN's buffers, Note [Counted allocations]); matrix products go to BLAS."
echo "- $("$cli" env | grep '^BLAS: ')"
echo "- $("$cli" env | grep '^BLAS kernels: ')"
echo
echo "| mode | samples/s | step s | / plain 1p | peak tensor MB rank 0 | peak tensor MB rank 1 | schedule bubble (p-1)/(m+p-1) | measured bubble | measured vs plain with m micro-batches | loss, last step |"
echo "|---|---|---|---|---|---|---|---|---|---|"
for c in "${configs[@]}"; do
  case $c in
    plain) label="plain LibTorch, 1 process" ;;
    plain_m*) label="plain LibTorch, 1 process, ${c#plain_m} accumulated micro-batches" ;;
    ddp) label="data parallel (ddp), $((batch / 2)) per rank" ;;
    tp) label="tensor parallel (tp 2)" ;;
    ckpt) label="ddp + activation checkpointing" ;;
    pp_*) IFS=_ read -r _ sched m <<< "$c"; [ "$sched" = gpipe ] && sched=GPipe || sched=1F1B
          label="pipeline (pp 2), $sched, m=${m#m}" ;;
  esac
  sps=$(median $c.samples_per_s)
  step=$(median $c.step_s)
  p0=$(median $c.peak0)
  p1=$(median $c.peak1)
  if [[ $c == pp_* ]]; then
    m=${c##*_m}
    theory=$(awk -v m="$m" 'BEGIN { printf "%.2f", 1 / (m + 1) }')
    measured=$(awk -v a="$plain_step" -v b="$step" 'BEGIN { if (b > 0 && b != "nan") printf "%.2f", 1 - (a / 2) / b; else print "-" }')
    same_m=$(awk -v a="$(median plain_m$m.step_s)" -v b="$step" 'BEGIN { if (b > 0 && b != "nan" && a != "nan") printf "%.2f", 1 - (a / 2) / b; else print "-" }')
  else
    theory="-"; measured="-"; same_m="-"
  fi
  printf "| %s | %s ±%s%% | %s | %s | %s | %s | %s | %s | %s | %s |\n" "$label" \
    "$(awk -v v="$sps" 'BEGIN { printf "%.1f", v }')" "$(spread $c.samples_per_s)" \
    "$(awk -v v="$step" 'BEGIN { printf "%.3f", v }')" \
    "$(awk -v a="$sps" -v b="$plain_sps" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "-" }')" \
    "$(awk -v b="$p0" 'BEGIN { if (b == "nan") print "-"; else printf "%.1f", b / 1e6 }')" \
    "$(awk -v b="$p1" 'BEGIN { if (b == "nan" || b == "") print "-"; else printf "%.1f", b / 1e6 }')" \
    "$theory" "$measured" "$same_m" "$(median $c.loss)"
done
