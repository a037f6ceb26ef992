#!/bin/bash
# bench/run section: the Llama family in training (examples/train_llm): tokens/s and the model
# FLOPs utilisation of a 0.1B Llama shape on 1 and 2 processes beside PyTorch 2.12 eager and
# PyTorch's DistributedDataParallel on the same config.json and the same token ids
# (bench/llm_peer.py), in one run; then the largest Llama shapes that train on 4 ranks here under
# ZeRO-3 (FSDP), with the optimizer state in memory and on disk (LLM_LARGEST=0 leaves them out:
# minutes each). Runs alone too: bench/sections/48-llm.sh BUILD_DIR CLI (env REPS, default 3).
set -euo pipefail
build=$1
cli=$2
root=$(cd "$(dirname "$0")/../.." && pwd)
reps=${REPS:-3}
steps=${LLM_STEPS:-5}
work=$(mktemp -d)
# shellcheck source=lib/common.sh
source "$(dirname "$0")/lib/common.sh"
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1
use_launch_blas_kernels "$cli"
py2=$("$root/scripts/install-torch2.sh")/bin/python
seq=256
# config NAME HIDDEN INTERMEDIATE LAYERS HEADS KV_HEADS: a Llama config.json in $work/NAME.
config() {
  mkdir -p "$work/$1"
  cat > "$work/$1/config.json" <<EOF
{"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": $2,
 "intermediate_size": $3, "num_hidden_layers": $4, "num_attention_heads": $5,
 "num_key_value_heads": $6, "vocab_size": 32000, "max_position_embeddings": 2048,
 "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "tie_word_embeddings": true, "hidden_act": "silu",
 "attention_bias": false, "mlp_bias": false}
EOF
}
config small 768 2048 12 12 4
"$py2" -c "
import numpy as np
np.random.default_rng(0).integers(0, 32000, size=96 * ($seq + 1), dtype=np.uint16).tofile('$work/ids.bin')"
train=("$build/examples/train_llm" --config "$work/small/config.json" --data "$work/ids.bin"
       --seq_len $seq --batch_size 1 --steps $((steps + 1)) --log_every 1 --lr 3e-4
       --warmup_steps 0 --clip 0)
# tandem NAME CMD...: train_llm's median tokens/s and MFU over its steps after the first.
tandem_run() {
  local name=$1 log
  shift
  log=$("$@" 2>&1) || { echo "bench/run: $name failed: $(echo "$log" | tail -3)" >&2; }
  echo "$log" | sed -n 's/^\(.* \)\{0,1\}step \([0-9]*\) loss .* \([0-9]*\) tokens\/s MFU \([0-9.]*\)%.*/\2 \3 \4/p' |
    awk '$1 > 1' > "$work/$name.steps"
  awk '{print $2}' "$work/$name.steps" > "$work/$name.run_tps"
  awk '{print $3}' "$work/$name.steps" > "$work/$name.run_mfu"
  local f
  for f in tps mfu; do
    if [ -s "$work/$name.run_$f" ]; then median "$name.run_$f"; else echo nan; fi >> "$work/$name.$f"
  done
  echo "$log" | sed -n 's/.* \([0-9.]*\) MFLOPs per token; peak \([0-9.]*\) TFLOP\/s.*/\1 \2/p' | head -1 > "$work/flops"
  echo "$log" | sed -n 's/.*with \([0-9]*\) parameters,.*/\1/p' | head -1 > "$work/params"
}
for ((r = 1; r <= reps; ++r)); do
  echo "bench/run: llm repetition $r/$reps" >&2
  tandem_run t1 "${train[@]}"
  tandem_run t2 "$cli" launch -q --num_processes 2 --cpu --num_cpu_threads_per_process 1 "${train[@]}"
  record p1 "tokens_per_s" "$py2" "$root/bench/llm_peer.py" --config "$work/small" \
    --data "$work/ids.bin" --seq_len $seq --steps "$steps"
  record p2 "tokens_per_s" "$cli" launch -q --num_processes 2 --cpu --num_cpu_threads_per_process 1 \
    "$py2" "$root/bench/llm_peer.py" --config "$work/small" --data "$work/ids.bin" --seq_len $seq \
    --steps "$steps"
done
read -r mflops peak < "$work/flops" || true
params=$(cat "$work/params" 2>/dev/null || echo nan)
# mfu TOKENS_PER_S PROCESSES: percent of the peak train_llm measured, with its FLOPs per token.
mfu() { awk -v t="$1" -v n="$2" -v f="${mflops:-nan}" -v p="${peak:-nan}" 'BEGIN { if (t == "nan" || p == "nan" || p == 0) print "-"; else printf "%.1f%%", 100 * t * f * 1e6 / (p * 1e12 * n) }'; }
echo
echo "## The Llama family in training (0.1B Llama shape: 12 layers, width 768, 12 heads over 4 key/value heads, MLP 2048, vocab 32000, tied; sequences of $seq tokens, batch 1 per process, 1 thread per process)"
echo
echo "Command: \`bench/sections/48-llm.sh\`: \`train_llm --config config.json --data ids.bin --seq_len $seq --batch_size 1 --log_every 1 --clip 0\` alone and under \`tandem launch --num_processes 2 --cpu --num_cpu_threads_per_process 1\` (data parallel); \`bench/llm_peer.py\`: transformers $("$py2" -c 'import transformers; print(transformers.__version__)') \`LlamaForCausalLM\` from the same config.json on the same token ids, PyTorch $("$py2" -c 'import torch; print(torch.__version__)') eager (no compile), AdamW, alone and as DistributedDataParallel over Gloo under the same launcher. Medians of $reps runs; each run's figure is the median over $steps steps after a first one. $params parameters, $mflops MFLOPs per token (6N outside the embedding + 12 L H Q T); MFU against train_llm's measured float32 matrix-product peak of one core, ${peak:-?} TFLOP/s, times the processes."
echo
echo "| processes | tandem tokens/s | tandem MFU | PyTorch | PyTorch tokens/s | PyTorch MFU | tandem / PyTorch |"
echo "|---|---|---|---|---|---|---|"
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a == "nan" || b == "nan" || b == 0) print "-"; else printf "%.2fx", a / b }'; }
t1=$(median t1.tps); t2=$(median t2.tps); p1=$(median p1.tokens_per_s); p2=$(median p2.tokens_per_s)
pct() { awk -v v="$1" 'BEGIN { if (v == "nan") print "-"; else printf "%.1f%%", v }'; }
echo "| 1 | $t1 (spread $(spread t1.tps)%) | $(pct "$(median t1.mfu)") | eager | $p1 (spread $(spread p1.tokens_per_s)%) | $(mfu "$p1" 1) | $(ratio "$t1" "$p1") |"
echo "| 2 | $t2 (spread $(spread t2.tps)%) | $(pct "$(median t2.mfu)") | DistributedDataParallel | $p2 (spread $(spread p2.tokens_per_s)%) | $(mfu "$p2" 2) | $(ratio "$t2" "$p2") |"

[ "${LLM_LARGEST:-1}" = 0 ] && exit 0
# The largest shapes: width 2048, 16 heads over 8 key/value heads, MLP 5632 (TinyLlama's), L
# layers; ZeRO-3 builds the model with acc.build (no rank holds it whole). One run each.
largest() {
  local label=$1 layers=$2 log start end
  shift 2
  config "large$layers" 2048 5632 "$layers" 16 8
  start=$(date +%s.%N)
  log=$("$cli" launch -q --num_processes 4 --cpu --num_cpu_threads_per_process 1 "$@" \
        "$build/examples/train_llm" --config "$work/large$layers/config.json" --data "$work/ids.bin" \
        --seq_len 64 --batch_size 1 --steps 3 --log_every 1 --lr 1e-5 --warmup_steps 0 2>&1) || {
    echo "| $label | $layers x 2048 | failed: $(echo "$log" | grep -m1 -i -E 'error|killed|signal|refused' | tr '|' ' ' | cut -c1-120) | | | |"
    return
  }
  end=$(date +%s.%N)
  local p pk loss tps
  p=$(echo "$log" | sed -n 's/.*with \([0-9]*\) parameters,.*/\1/p' | head -1)
  pk=$(echo "$log" | sed -n 's/.*peak resident memory per rank: //p' | head -1)
  loss=$(echo "$log" | sed -n 's/.*loss \(fell\|rose\) from \([0-9.e+-]*\) to \([0-9.e+-]*\).*/\2 -> \3/p' | head -1)
  tps=$(echo "$log" | sed -n 's/.* \([0-9]*\) tokens\/s MFU.*/\1/p' | tail -1)
  awk -v l="$label" -v L="$layers" -v p="$p" -v pk="$pk" -v s="$loss" -v t="$tps" -v w="$(echo "$end - $start" | bc)" \
    'BEGIN { printf "| %s | %s x 2048 | %.2fB | %s | %s | %s tokens/s at the last step (whole run %.0f s) |\n", l, L, p / 1e9, pk, s, t, w }'
}
echo
echo "### The largest Llama shapes that train on 4 ranks here (24 GiB, fp32 AdamW)"
echo
echo "Command: \`tandem launch --num_processes 4 --cpu --num_cpu_threads_per_process 1 --use_fsdp train_llm --config config.json --seq_len 64 --batch_size 1 --steps 3\` (width 2048, 16 heads over 8 key/value heads, MLP 5632, vocab 32000, tied; L layers), and with \`--use_deepspeed --zero_stage 3 --offload_optimizer_device nvme\` for the optimizer state on disk (8N/4 bytes less per rank). Peak resident memory: each rank's VmHWM over the whole run, as train_llm prints it."
echo
echo "| layout | layers x width | parameters | peak resident memory per rank | loss | speed |"
echo "|---|---|---|---|---|---|"
largest "ZeRO-3 (--use_fsdp)" "${LLM_LARGEST_LAYERS:-18}" --use_fsdp
state_dir=$(mktemp -d)
largest "ZeRO-3, optimizer state on disk" "${LLM_LARGEST_DISK_LAYERS:-28}" --use_deepspeed --zero_stage 3 \
  --offload_optimizer_device nvme --offload_optimizer_nvme_path "$state_dir"
rm -rf "$state_dir"
