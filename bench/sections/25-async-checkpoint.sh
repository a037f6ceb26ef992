#!/bin/bash
# bench/run section: asynchronous checkpoints (Note [Asynchronous checkpoints]). A model whose
# checkpoint takes several steps to write, trained with no save, synchronous saves,
# asynchronous saves and a plain LibTorch loop saving with torch::save, beside PyTorch's
# torch.distributed.checkpoint save and async_save on the same model; medians of REPS runs.
# Runs alone too: bench/sections/25-async-checkpoint.sh BUILD_DIR CLI (env REPS, default 3).
set -euo pipefail
build=$1
root=$(cd "$(dirname "$0")/../.." && pwd)
reps=${REPS:-3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1
py2=$("$root/scripts/install-torch2.sh")/bin/python
shape=(--layers 8 --width 2048 --batch 16 --steps 40 --every 10 --dir "$work/ckpt")
keys=(step_s step_in_flight_s blocked_first_s blocked_s to_disk_s total_s checkpoint_mb)
one() {
  local name=$1; shift
  local line
  line=$("$@" 2>&1 | grep "RESULT async_save" | tail -1) || true
  for key in "${keys[@]}"; do
    v=$(echo "$line" | grep -o " $key=[0-9.e+-]*" | cut -d= -f2 || true)
    echo "${v:-nan}" >> "$work/$name.$key"
  done
}
median() {
  [ -f "$work/$1" ] || { echo nan; return; }
  sort -g "$work/$1" | awk '{v[NR]=$1} END { m = (NR % 2) ? v[(NR+1)/2] : (v[NR/2] + v[NR/2+1]) / 2; printf "%.3f", m }'
}
modes=(none sync async plain dcp-sync dcp-async)
for ((r = 1; r <= reps; ++r)); do
  echo "bench/run: async-checkpoint repetition $r/$reps" >&2
  for m in none sync async plain; do one "$m" "$build/bench/async_save_bench" "$m" "${shape[@]}"; done
  for m in sync async; do
    one "dcp-$m" env PYTHONNOUSERSITE=1 MASTER_PORT=$((29800 + RANDOM % 100)) "$py2" "$root/bench/async_save_peer.py" "$m" "${shape[@]}"
  done
done
echo
echo "## Asynchronous checkpoints (8 x Linear 2048x2048 + ReLU, AdamW, batch 16, 40 steps, a save every 10)"
echo
echo "Command: \`bench/sections/25-async-checkpoint.sh BUILD CLI\`: \`async_save_bench none|sync|async|plain\` (one process, 1 thread; tandem's \`save_state()\`, \`save_state(SaveOptions().async(true))\`, and a plain LibTorch loop with \`torch::save\` of the model and the optimizer) and \`bench/async_save_peer.py sync|async\` (PyTorch $("$py2" -c 'import torch; print(torch.__version__)' 2>/dev/null): \`torch.distributed.checkpoint.save\` / \`async_save\` of the model's and the optimizer's state dicts on a one-process Gloo group), $reps repetitions, medians. Step: the median optimizer step with no save in flight; in flight: the median step that began while a save was being written; blocked: how long the training thread waited in the first save, and in each later one (median; an asynchronous tandem save copies into the host buffers of the one before); to disk: from the save's start until its checkpoint was complete (asynchronous modes: seen at the end of a step, or at the wait before the next save); total: the 40 steps, saves included. 2 cores: the background write competes with the step for them."
echo
echo "| mode | checkpoint MB | step s | step s, save in flight | blocked, first save s | blocked, later saves s | save to disk s | total s (40 steps, 3 saves) |"
echo "|---|---|---|---|---|---|---|---|"
label() {
  case $1 in
    none) echo "tandem, no save" ;; sync) echo "tandem save_state" ;;
    async) echo "tandem save_state, async" ;; plain) echo "plain LibTorch, torch::save" ;;
    dcp-sync) echo "PyTorch dcp.save" ;; dcp-async) echo "PyTorch dcp.async_save" ;;
  esac
}
for m in "${modes[@]}"; do
  printf "| %s | %s | %s | %s | %s | %s | %s | %s |\n" "$(label "$m")" "$(median "$m.checkpoint_mb")" \
    "$(median "$m.step_s")" "$(median "$m.step_in_flight_s")" "$(median "$m.blocked_first_s")" "$(median "$m.blocked_s")" \
    "$(median "$m.to_disk_s")" "$(median "$m.total_s")"
done
