#!/bin/bash
# bench/run section: the largest example GPT each strategy trains on this machine with 4 ranks
# (train_gpt --context 64 --batch-size 1, AdamW, fp32): its parameters, each rank's peak
# resident memory over the whole run (train_gpt prints VmHWM per rank) and the step time.
# Data parallel holds about 20N bytes per rank (weights, gradients, buckets, Adam), ZeRO-3 about
# 16N/4 (docs/sharding.md); the sizes below are the largest of each that fit in this machine's
# memory with four ranks (24 GiB: DDP 0.25B, ZeRO-3 1.0B). Slow: minutes per run; REPS does not
# apply (one run each). Runs alone too: bench/sections/45-largest-model.sh BUILD_DIR CLI
set -euo pipefail
build=$1
cli=$2
export OMP_NUM_THREADS=1
steps=${LARGEST_STEPS:-4}
lr=${LARGEST_LR:-1e-5}  # the example's 3e-3 (sized for its small default GPT) makes a 1B model's loss climb
# run LABEL LAYERS LAUNCH-FLAGS...: one training run, its summary as a table row.
run() {
  local label=$1 layers=$2; shift 2
  local log
  log=$(mktemp)
  local start end
  start=$(date +%s.%N)
  if ! "$cli" launch -q --num_processes 4 --cpu --num_cpu_threads_per_process 1 "$@" \
       "$build/examples/train_gpt" --layers "$layers" --width 2048 --heads 16 --context 64 \
       --batch-size 1 --steps "$steps" --lr "$lr" --eval-every 1000000 --eval-batches 1 > "$log" 2>&1; then
    echo "| $label | $layers x 2048 | failed: $(grep -m1 -i -E 'error|killed|signal' "$log" | tr '|' ' ' | cut -c1-120) | | | |"
    rm -f "$log"
    return
  fi
  end=$(date +%s.%N)
  local params peaks first last tps
  params=$(sed -n 's/.*GPT with \([0-9]*\) parameters.*/\1/p' "$log" | head -1)
  peaks=$(sed -n 's/.*peak resident memory per rank: //p' "$log" | head -1)
  first=$(sed -n 's/.*loss [a-z]* from \([0-9.e+-]*\) to \([0-9.e+-]*\).*/\1/p' "$log" | head -1)
  last=$(sed -n 's/.*loss [a-z]* from \([0-9.e+-]*\) to \([0-9.e+-]*\).*/\2/p' "$log" | head -1)
  tps=$(sed -n 's/.*, \([0-9]*\) tokens\/s.*/\1/p' "$log" | tail -1)
  awk -v l="$label" -v L="$layers" -v p="$params" -v pk="$peaks" -v f="$first" -v s="$last" \
      -v t="$tps" -v w="$(echo "$end - $start" | bc)" -v n="$steps" \
      'BEGIN { printf "| %s | %s x 2048 | %.2fB | %s | %s -> %s | %.0f tokens/s (%.1f s per step; whole run %.0f s) |\n", l, L, p / 1e9, pk, f, s, t, 4 * 64 / (t > 0 ? t : 1), w }'
  rm -f "$log"
}
echo
echo "## The largest model each strategy trains here (4 ranks, example GPT, fp32 AdamW)"
echo
echo "Command: \`bench/sections/45-largest-model.sh\`: \`tandem launch --num_processes 4 --cpu [--use_fsdp] train_gpt --layers L --width 2048 --heads 16 --context 64 --batch-size 1 --steps $steps --lr $lr\` (ZeRO-3 builds the model with \`acc.build\`: no rank holds it whole). Peak resident memory: each rank's VmHWM over the whole run, as train_gpt prints it. Tokens/s: train_gpt's own figure over the run (the first steps included)."
echo
echo "| strategy | blocks x width | parameters | peak resident memory per rank | loss | speed |"
echo "|---|---|---|---|---|---|"
run "data parallel" 5
run "ZeRO-3 (--use_fsdp)" 20 --use_fsdp
# The optimizer state on disk (docs/sharding.md, "Optimizer state on disk"): 8N/4 bytes less per
# rank, so more blocks fit.
state_dir=$(mktemp -d)
run "ZeRO-3, optimizer state on disk" 28 --use_deepspeed --zero_stage 3 \
  --offload_optimizer_device nvme --offload_optimizer_nvme_path "$state_dir"
rm -rf "$state_dir"
