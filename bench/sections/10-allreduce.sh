#!/bin/bash
# bench/run section: bucketed gradient reduction vs a raw c10d Gloo allreduce of the same bytes.
set -euo pipefail
build=$1
cli=$2
log=$(mktemp)
"$cli" launch -q --num_processes 2 --cpu --num_cpu_threads_per_process 1 "$build/bench/allreduce_bench" 50 > "$log" 2>&1
get() { grep -o "$1=[0-9.e+-]*" "$log" | head -1 | cut -d= -f2; }
echo
echo "## Gradient reduction bandwidth (2 processes, Gloo on loopback)"
echo
echo "Command: \`tandem launch --num_processes 2 --cpu allreduce_bench 50\`: the MLP's gradients ($(get bytes) bytes, $(get buckets) buckets), reduced by tandem during a backward whose own work is subtracted ($(get backward_local_ms) ms), beside one raw c10d allreduce of the same bytes. Bus bandwidth = 2(n-1)/n x bytes / time."
echo
echo "| path | time per reduction (ms) | bus bandwidth (GB/s) |"
echo "|---|---|---|"
printf "| raw c10d Gloo allreduce, one tensor | %.2f | %.2f |\n" "$(get raw_ms)" "$(get raw_busbw_gbps)"
printf "| tandem buckets during backward | %.2f | %.2f |\n" "$(get tandem_ms)" "$(get tandem_busbw_gbps)"
rm -f "$log"
