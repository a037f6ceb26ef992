#!/bin/bash
# bench/run section: data parallel and ZeRO-1/2/3 at 2 and 4 ranks on a 25.2M-parameter model:
# samples/s, per-rank peak memory (tandem's counting allocator and RSS) beside the formula that
# `tandem estimate-memory` prints, and PyTorch's own DDP, ZeroRedundancyOptimizer and FSDP2.
# Runs alone too: bench/sections/40-sharding.sh BUILD_DIR CLI (env REPS, default 3).
set -euo pipefail
build=$1
cli=$2
root=$(cd "$(dirname "$0")/../.." && pwd)
reps=${REPS:-3}
work=$(mktemp -d)
# shellcheck source=lib/common.sh
source "$(dirname "$0")/lib/common.sh"
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1
py2=$("$root/scripts/install-torch2.sh")/bin/python
# one NAME KEY CMD...: appends KEY's value from the RESULT line of CMD to $work/NAME.KEY
one() {
  local name=$1; shift
  local line
  line=$("$@" 2>&1 | grep "RESULT sharding" | tail -1) || true
  for key in samples_per_s peak_bytes rss_peak_kb; do
    v=$(echo "$line" | grep -o "$key=[0-9.e+]*" | cut -d= -f2 || true)
    echo "${v:-nan}" >> "$work/$name.$key"
  done
}
# median: lib/common.sh
mb() { awk -v b="$1" -v d="$2" 'BEGIN { if (b == "nan" || b == "") print "-"; else printf "%.1f", b / d }'; }
"$build/bench/sharding_bench" plain --steps 1 --warmup 0 --save_model "$work/model" > /dev/null
for ((r = 1; r <= reps; ++r)); do
  echo "bench/run: sharding repetition $r/$reps" >&2
  one plain "$build/bench/sharding_bench" plain
  for n in 2 4; do
    L=("$cli" launch -q --num_processes $n --cpu --num_cpu_threads_per_process 1)
    one ddp$n "${L[@]}" "$build/bench/sharding_bench" tandem
    for s in 1 2 3; do
      one z$s$n "${L[@]}" --use_deepspeed --zero_stage $s "$build/bench/sharding_bench" tandem
    done
    # ZeRO-3 with FSDP's prefetching (Note [Prefetching units]).
    one z3p$n "${L[@]}" --use_fsdp --fsdp_forward_prefetch true --fsdp_backward_prefetch BACKWARD_PRE \
      "$build/bench/sharding_bench" tandem
    one pddp$n "${L[@]}" "$py2" "$root/bench/zero_peer.py" ddp
    one pz1$n "${L[@]}" "$py2" "$root/bench/zero_peer.py" zero1
    one pfsdp$n "${L[@]}" "$py2" "$root/bench/zero_peer.py" fsdp
  done
done
echo
echo "## Sharded data parallel (25.2M parameters: 24 x Linear 1024x1024 + ReLU, AdamW, batch 16 per rank, 1 thread)"
echo
echo "Command: \`bench/sections/40-sharding.sh\`: \`sharding_bench tandem\` under \`tandem launch --num_processes N --cpu --num_cpu_threads_per_process 1\` (plus \`--use_deepspeed --zero_stage S\`), buckets of 8 MiB; \`bench/zero_peer.py ddp|zero1|fsdp\` (PyTorch $("$py2" -c 'import torch; print(torch.__version__)'): DistributedDataParallel, ZeroRedundancyOptimizer over DDP, FSDP2 \`fully_shard\` on every Linear), launched the same way. 10 timed steps after 2 warm-up steps."
echo "Peak tensor memory: tandem's counting CPU allocator (\`track/cpu_memory.h\`) over the timed steps (the optimizer state exists by then), the largest rank; RSS: the largest rank's VmHWM over the whole process (libraries, allocator caches and the full model built before prepare included; PyTorch has no CPU allocator statistics, so its column is RSS only). Formula: \`tandem estimate-memory model.safetensors --num_processes N\` (tandem's fp32 table; ZeRO-2's in-flight buckets not included)."
echo
echo "Plain LibTorch, 1 process: $(median plain.samples_per_s) samples/s, peak tensor memory $(mb "$(median plain.peak_bytes)" 1e6) MB."
echo
echo "| ranks | strategy | tandem samples/s | peak tensor MB / rank (timed steps) | estimate-memory MB | tandem RSS MB | PyTorch peer | peer samples/s | peer RSS MB |"
echo "|---|---|---|---|---|---|---|---|---|"
for n in 2 4; do
  json=$("$cli" estimate-memory "$work/model/model.safetensors" --num_processes $n --json)
  est() { echo "$json" | "$py2" -c "import json,sys; d=json.load(sys.stdin); print([z['bytes_per_device'] for z in d['tandem_fp32'] if z['id']=='$1'][0])"; }
  for row in "ddp ddp DDP pddp DistributedDataParallel" "z1 zero1 ZeRO-1 pz1 ZeroRedundancyOptimizer" "z2 zero2 ZeRO-2 - -" "z3 zero3 ZeRO-3 pfsdp FSDP2_fully_shard" "z3p zero3 ZeRO-3_prefetch_(forward,_BACKWARD_PRE) - -"; do
    set -- $row
    k=$1; id=$2; label=${3//_/ }; peer=$4; peer_label=${5//_/ }
    if [ "$peer" = - ]; then ps="-"; pr="-"; else ps=$(median $peer$n.samples_per_s); pr=$(mb "$(median $peer$n.rss_peak_kb)" 1e3); fi
    echo "| $n | $label | $(median $k$n.samples_per_s) | $(mb "$(median $k$n.peak_bytes)" 1e6) | $(mb "$(est $id)" 1e6) | $(mb "$(median $k$n.rss_peak_kb)" 1e3) | $peer_label | $ps | $pr |"
  done
done
