#!/bin/bash
# bench/run section: GPT step throughput per precision mode beside plain LibTorch fp32.
set -euo pipefail
build=$1
log=$(mktemp)
"$build/bench/precision_bench" --steps 10 --warmup 2 --modes plain,no,bf16,bf16-true > "$log" 2>&1
echo
echo "## Mixed precision on CPU (GPT ctx 128, 4 layers, 4 heads, width 128, batch 8, 1 thread)"
echo
echo "Command: \`precision_bench --steps 10 --warmup 2 --modes plain,no,bf16,bf16-true\`."
echo
echo "| mode | tokens/s | vs plain LibTorch fp32 |"
echo "|---|---|---|"
plain=$(grep "^RESULT precision plain" "$log" | grep -o "tokens_per_s=[0-9.]*" | cut -d= -f2)
grep "^RESULT precision" "$log" | while read -r _ _ mode kv; do
  v=${kv#tokens_per_s=}
  printf "| %s | %.0f | %s |\n" "$mode" "$v" "$(awk -v a="$v" -v b="$plain" 'BEGIN{printf "%.2f", a/b}')"
done
rm -f "$log"
