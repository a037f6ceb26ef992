#!/bin/bash
# bench/run section: bucketed gradient reduction vs raw c10d Gloo allreduces of the same bytes.
set -euo pipefail
build=$1
cli=$2
log=$(mktemp)
"$cli" launch -q --num_processes 2 --cpu --num_cpu_threads_per_process 1 "$build/bench/allreduce_bench" 50 7 > "$log" 2>&1
get() { grep "RESULT allreduce name=$1 " "$log" | grep -o "$2=[0-9.e+-]*" | head -1 | cut -d= -f2; }
setup() { grep "RESULT allreduce_setup" "$log" | grep -o "$1=[0-9.e+-]*" | head -1 | cut -d= -f2; }
echo
echo "## Gradient reduction (2 processes, Gloo on loopback)"
echo
echo "Command: \`tandem launch --num_processes 2 --cpu allreduce_bench 50 7\`: the MLP's gradients ($(setup bytes) bytes), reduced by tandem's reducer during a backward whose own work (measured right after without communication, $(setup backward_local_ms) ms) is subtracted, beside raw c10d allreduces of the same bytes. 50 reductions per measurement, 7 alternating rounds, medians and spread. Bus bandwidth = 2(n-1)/n x bytes / time."
echo
echo "| path | time per reduction (ms) | spread | bus bandwidth (GB/s) | / raw sum |"
echo "|---|---|---|---|---|"
raw=$(get raw_one_tensor ms)
for v in "raw_one_tensor raw c10d allreduce (sum), one tensor" \
         "raw_one_tensor_mean raw c10d allreduce + division by the world size (a mean)" \
         "raw_per_bucket raw c10d allreduce (sum), one tensor per bucket" \
         "tandem_default tandem, default (2 buckets, gradients copied in and out)" \
         "tandem_bucket_view tandem, gradient_as_bucket_view (2 buckets)" \
         "tandem_one_bucket tandem, one bucket (first_bucket_cap_mb 25)" \
         "tandem_one_bucket_view tandem, one bucket + gradient_as_bucket_view"; do
  k=${v%% *}; label=${v#* }
  printf "| %s | %.2f | ±%.0f%% | %.2f | %.2f |\n" "$label" "$(get "$k" ms)" "$(get "$k" spread_pct)" \
    "$(get "$k" busbw_gbps)" "$(awk -v a="$raw" -v b="$(get "$k" ms)" 'BEGIN { print a / b }')"
done
rm -f "$log"
