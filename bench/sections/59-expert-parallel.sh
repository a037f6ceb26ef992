#!/bin/bash
# bench/run section: expert parallel (Note [Expert parallel]) on a Qwen3-MoE shape: tokens/s and
# peak resident memory per rank of train_llm on 4 ranks under data parallel, ep 2 and ep 4, and
# under FSDP (ZeRO-3) with ep 4, beside PyTorch 2.12's DistributedDataParallel on the
# same config.json and token ids (bench/llm_peer.py: eager PyTorch has no expert parallel of its
# own), in one run. Runs alone too: bench/sections/59-expert-parallel.sh BUILD_DIR CLI (env REPS,
# default 3).
set -euo pipefail
build=$1
cli=$2
root=$(cd "$(dirname "$0")/../.." && pwd)
reps=${REPS:-3}
steps=${EP_STEPS:-5}
work=$(mktemp -d)
# shellcheck source=lib/common.sh
source "$(dirname "$0")/lib/common.sh"
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1
use_launch_blas_kernels "$cli"
py2=$("$root/scripts/install-torch2.sh")/bin/python
seq=128
batch=2
mkdir -p "$work/moe"
cat > "$work/moe/config.json" <<EOF
{"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 8192,
 "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 256,
 "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
 "num_experts": 16, "num_experts_per_tok": 2, "norm_topk_prob": true, "decoder_sparse_step": 1,
 "mlp_only_layers": [], "max_position_embeddings": 512, "rms_norm_eps": 1e-06,
 "rope_theta": 1000000.0, "tie_word_embeddings": false, "hidden_act": "silu",
 "attention_bias": false, "output_router_logits": false}
EOF
"$py2" -c "
import numpy as np
np.random.default_rng(0).integers(0, 8192, size=512 * ($seq + 1), dtype=np.uint16).tofile('$work/ids.bin')"
train=("$build/examples/train_llm" --config "$work/moe/config.json" --data "$work/ids.bin"
       --seq_len $seq --batch_size $batch --steps $((steps + 1)) --log_every 1 --lr 3e-4
       --warmup_steps 0 --clip 0)
L4=("$cli" launch -q --num_processes 4 --cpu --num_cpu_threads_per_process 1)
# tandem NAME FLAGS...: train_llm on 4 ranks; its median tokens/s over the steps after the first,
# its largest rank's peak resident memory (GB, VmHWM over the whole run) and its last loss.
tandem_run() {
  local name=$1 log
  shift
  log=$("${L4[@]}" "$@" "${train[@]}" 2>&1) || { echo "bench/run: $name failed: $(echo "$log" | tail -3)" >&2; }
  echo "$log" | sed -n 's/^\(.* \)\{0,1\}step \([0-9]*\) loss .* \([0-9]*\) tokens\/s MFU.*/\2 \3/p' |
    awk '$1 > 1 {print $2}' > "$work/$name.run_tps"
  if [ -s "$work/$name.run_tps" ]; then median "$name.run_tps"; else echo nan; fi >> "$work/$name.tps"
  echo "$log" | sed -n 's/.*peak resident memory per rank: //p' | head -1 |
    grep -o '[0-9.]* GB' | awk 'BEGIN {m = 0} {if ($1 > m) m = $1} END {print (NR ? m : "nan")}' >> "$work/$name.rss"
  echo "$log" | sed -n 's/.*loss \(fell\|rose\) from [0-9.e+-]* to \([0-9.e+-]*\).*/\2/p' | head -1 > "$work/$name.loss"
  echo "$log" | sed -n 's/.*with \([0-9]*\) parameters,.*/\1/p' | head -1 > "$work/params"
}
# FSDP without ep is not in the table: ZeRO-3 over a mixture whose experts get no token on some
# ranks hangs (a unit's reduction waits for the end of backward there and not elsewhere).
names=(dp4 ep2 ep4 fsdp_ep4)
labels=("data parallel 4" "ep 2 x dp 2 (experts over 2 ranks)" "ep 4 (experts over 4 ranks)"
        "FSDP on 4, experts over ep 4")
flags=("" "--ep_size 2" "--ep_size 4" "--use_fsdp --ep_size 4")
for ((r = 1; r <= reps; ++r)); do
  echo "bench/run: expert-parallel repetition $r/$reps" >&2
  for i in "${!names[@]}"; do
    # shellcheck disable=SC2086
    tandem_run "${names[$i]}" ${flags[$i]}
  done
  record peer "tokens_per_s rss_peak_kb" "${L4[@]}" "$py2" "$root/bench/llm_peer.py" \
    --config "$work/moe" --data "$work/ids.bin" --seq_len $seq --batch_size $batch --steps "$steps"
done
params=$(cat "$work/params" 2>/dev/null || echo nan)
echo
echo "## Expert parallel (Qwen3-MoE shape: 4 layers of 16 experts, top 2, width 256, expert MLP 256, vocab 8192, untied; sequences of $seq tokens, batch $batch per rank; 4 processes x 1 thread)"
echo
echo "Command: \`bench/sections/59-expert-parallel.sh\`: \`tandem launch --num_processes 4 --cpu --num_cpu_threads_per_process 1 [--ep_size N] [--use_fsdp] train_llm --config config.json --data ids.bin --seq_len $seq --batch_size $batch --log_every 1 --clip 0\`; \`bench/llm_peer.py\`: transformers $("$py2" -c 'import transformers; print(transformers.__version__)') \`Qwen3MoeForCausalLM\` from the same config.json on the same token ids, PyTorch $("$py2" -c 'import torch; print(torch.__version__)') eager as DistributedDataParallel over Gloo under the same launcher (eager PyTorch has no expert parallel: torchtitan's needs DTensor). $params parameters. tokens/s over all ranks, the median over $steps steps after a first one, then the median of $reps runs; peak resident memory: the largest rank's VmHWM over the whole run (loading and prepare included), the median of $reps runs."
echo
echo "| layout | tokens/s | peak resident GB per rank | loss, last step |"
echo "|---|---|---|---|"
for i in "${!names[@]}"; do
  n=${names[$i]}
  echo "| ${labels[$i]} | $(median "$n.tps") (spread $(spread "$n.tps")%) | $(median "$n.rss") | $(cat "$work/$n.loss" 2>/dev/null || echo -) |"
done
peer_gb=$(awk -v k="$(median peer.rss_peak_kb)" 'BEGIN { if (k == "nan") print "nan"; else printf "%.2f", k * 1024 / 1e9 }')
echo "| PyTorch DistributedDataParallel 4 | $(median peer.tokens_per_s) (spread $(spread peer.tokens_per_s)%) | $peer_gb | - |"
