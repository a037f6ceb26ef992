#!/bin/bash
# bench/run section: `tandem plan` on the example GPT, every layout that fits run with the real
# program (--measure_all): the planner's predicted per-rank peak (resident memory and the
# counting allocator's tensor peak) beside the measured one, with the step time.
# Runs alone too: bench/sections/80-plan.sh BUILD_DIR CLI
#   MODELS="L:W:H:CTX:N[:ckpt|:offload] ..." chooses the GPTs: layers, width, heads, context,
#   processes; ckpt adds activation checkpointing to the search, offload ZeRO's optimizer state
#   on disk (--offload_dir).
set -euo pipefail
build=$1
cli=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The model-parallel section's GPT (8 x 256) and one whose model states dominate (4 x 512), on
# 4 processes; the second again with activation checkpointing in the search, and on 2 processes
# with the optimizer state on disk.
models=${MODELS:-"8:256:4:64:4 4:512:4:64:4 4:512:4:64:4:ckpt 4:512:4:64:2:offload"}
echo "## Layout planner: predicted against measured peak memory per rank (tandem plan --measure_all)"
echo
echo "Command: \`bench/sections/80-plan.sh BUILD CLI\`: \`tandem plan --layers L --hidden W --heads H --vocab 256 --seq_len CTX --num_processes N --global_batch_size 8 --max_micro_batch 2 [--no_activation_checkpointing] [--offload_dir DIR] --measure_all -- train_gpt ... --batch-size {batch_size} --microbatches {microbatches} --steps {steps} --eval-every 0\` (probes 3 steps, timed runs 6). Memory is the rank with the largest VmHWM over the whole run (baseline, loading and \`prepare\` included) and that rank's tensor peak; error = (predicted - measured) / measured. Step: median optimizer step after the first, all processes on this machine's 2 cores."
for m in $models; do
  IFS=: read -r layers width heads ctx n extra <<< "$m"
  name=$layers-$width-$n-${extra:-plain}
  dir=$work/$name
  search=(--no_activation_checkpointing)
  case "${extra:-}" in
    ckpt) search=() ;;
    offload) search+=(--offload_dir "$work/offload-$name") ;;
  esac
  "$cli" plan --layers "$layers" --hidden "$width" --heads "$heads" --vocab 256 --seq_len "$ctx" \
    --num_processes "$n" --global_batch_size 8 --max_micro_batch 2 "${search[@]}" \
    --measure_all --work_dir "$dir" -- "$build/examples/train_gpt" --layers "$layers" \
    --width "$width" --heads "$heads" --context "$ctx" --batch-size '{batch_size}' \
    --microbatches '{microbatches}' --steps '{steps}' --eval-every 0 > "$work/out-$name.txt" 2>&1 \
    || { echo; echo "tandem plan failed for $m:"; tail -20 "$work/out-$name.txt"; continue; }
  python3 - "$dir/plan.json" "$layers" "$width" "$n" "${extra:-}" << 'PY'
import json, sys
j = json.load(open(sys.argv[1]))
p = j["probe"]
print()
extra = {"ckpt": ", activation checkpointing searched", "offload": ", optimizer state on disk searched"}.get(sys.argv[5], "")
print(f"GPT {sys.argv[2]} x {sys.argv[3]}, {j['model']['parameters']/1e6:.2f}M parameters, {sys.argv[4]} processes{extra}; "
      f"probe: baseline {p['baseline_rss']/1e6:.0f} MB resident, activations {p['activations_per_sample']/1e6:.1f} MB per sequence, "
      f"({p['checkpointed_per_sample']/1e6:.1f} MB checkpointed), workspace {p['workspace']/1e6:.1f} MB, tp splits {100*p['tp_split_fraction']:.0f}% of activations")
print()
print("| layout | predicted RSS MB | measured RSS MB | error | predicted tensors MB | measured tensors MB | error | step s | tokens/s |")
print("|---|---|---|---|---|---|---|---|---|")
errs_r, errs_t = [], []
for l in j["layouts"]:
    m = l.get("measured")
    if not m or not m["ok"]:
        continue
    pr, mr = l["predicted"]["rss_peak"], m["rss_peak"]
    pt, mt = l["predicted"]["tensor_peak"], m["tensor_peak"]
    er, et = (pr - mr) / mr, (pt - mt) / mt
    errs_r.append(abs(er)); errs_t.append(abs(et))
    star = " (winner)" if l["winner"] else ""
    print(f"| {l['name']}{star} | {pr/1e6:.0f} | {mr/1e6:.0f} | {100*er:+.1f}% | {pt/1e6:.0f} | {mt/1e6:.0f} | {100*et:+.1f}% | {m['step_seconds']:.3f} | {m['tokens_per_s']:.0f} |")
if errs_r:
    print()
    print(f"{len(errs_r)} layouts run; largest error {100*max(errs_r):.1f}% (resident), {100*max(errs_t):.1f}% (tensors); "
          f"within 10%: {sum(e <= 0.10 for e in errs_r)}/{len(errs_r)} resident, {sum(e <= 0.10 for e in errs_t)}/{len(errs_t)} tensors")
PY
done
