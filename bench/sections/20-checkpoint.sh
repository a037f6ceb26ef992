#!/bin/bash
# bench/run section: checkpoint throughput beside plain file I/O (same bytes, same run), medians
# of alternating repetitions, and the peak memory of a sharded load in a fresh process.
set -euo pipefail
build=$1
log=$(mktemp)
"$build/bench/checkpoint_bench" 16 /tmp/tandem-ckpt-bench "${REPS:-3}" > "$log" 2>&1
get() { grep -o "$1=[0-9.]*" "$log" | head -1 | cut -d= -f2; }
echo
echo "## Checkpoint throughput (GB/s)"
echo
echo "Command: \`checkpoint_bench 16 DIR ${REPS:-3}\` (16 x Linear(4096, 4096), $(get model_gb) GB of fp32; save = save_model to one safetensors file with fsync, beside one fwrite + fsync of the same bytes; load = load_model after dropping the file from the page cache, beside fread into the same parameters; medians of $(get reps) repetitions, ±spread)."
echo
echo "| operation | tandem | plain file I/O | tandem / plain |"
echo "|---|---|---|---|"
printf "| save | %s ±%s%% | %s ±%s%% | %s |\n" "$(get save_gbps)" "$(get save_spread)" "$(get plain_write_gbps)" "$(get plain_write_spread)" "$(awk -v a="$(get save_gbps)" -v b="$(get plain_write_gbps)" 'BEGIN{printf "%.2f", a/b}')"
printf "| load | %s ±%s%% | %s ±%s%% | %s |\n" "$(get load_gbps)" "$(get load_spread)" "$(get plain_read_gbps)" "$(get plain_read_spread)" "$(awk -v a="$(get load_gbps)" -v b="$(get plain_read_gbps)" 'BEGIN{printf "%.2f", a/b}')"
echo
limit=$(awk -v m="$(get rss_model_mb)" -v s="$(get largest_shard_mb)" 'BEGIN{printf "%.1f", (m + s) * 1.1}')
echo "Sharded load (200 MB shards) in a fresh process: resident $(get rss_model_mb) MB with the model built, peak $(get peak_rss_mb) MB during the load; the target (model + largest shard of $(get largest_shard_mb) MB, + 10%) is $limit MB. Targets: save and load >= 0.9x plain I/O."
rm -f "$log"
