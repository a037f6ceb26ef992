#!/bin/bash
# bench/run section: checkpoint throughput beside plain file I/O (same bytes, same run).
set -euo pipefail
build=$1
log=$(mktemp)
"$build/bench/checkpoint_bench" 16 > "$log" 2>&1
get() { grep -o "$1=[0-9.]*" "$log" | head -1 | cut -d= -f2; }
echo
echo "## Checkpoint throughput (GB/s)"
echo
echo "Command: \`checkpoint_bench 16\` (16 x Linear(4096, 4096), $(get model_gb) GB of fp32; save = save_model to one safetensors file with fsync; load = load_model after dropping the file from the page cache)."
echo
echo "| operation | tandem | plain file I/O | tandem / plain |"
echo "|---|---|---|---|"
printf "| save | %s | %s | %s |\n" "$(get save_gbps)" "$(get plain_write_gbps)" "$(awk -v a="$(get save_gbps)" -v b="$(get plain_write_gbps)" 'BEGIN{printf "%.2f", a/b}')"
printf "| load | %s | %s | %s |\n" "$(get load_gbps)" "$(get plain_read_gbps)" "$(awk -v a="$(get load_gbps)" -v b="$(get plain_read_gbps)" 'BEGIN{printf "%.2f", a/b}')"
echo
echo "Sharded load (200 MB shards): resident memory $(get rss_before_sharded_load_mb) MB before, peak $(get peak_rss_mb) MB (the peak includes the earlier single-file save and load of this process). Target: >= 0.8x plain I/O."
rm -f "$log"
