#!/bin/bash
# bench/run section: one process of examples/train_gpt on an idle machine and beside a competing
# process, started by hand and under `tandem launch --num_processes 1 --cpu` (its defaults now,
# and its former ones: OMP_NUM_THREADS = TANDEM_NUM_CPU_THREADS = the cores, OpenMP's default
# wait policy), plus the thread counts and OpenMP wait policies that explain the difference
# (Note [Threads per rank], Note [OpenMP wait policy]). Figures: train_gpt's own it/s.
# Runs alone too: bench/sections/60-busy-machine.sh BUILD_DIR CLI
#   REPS (default 5), STEPS (default 20: the command of issue 21), BEFORE_CLI (a tandem CLI built
#   before the change, for the "launcher before" column; without it that column runs the
#   program with the environment the former launcher gave), IDLE_WAIT (seconds to wait for the
#   machine to go quiet before each idle repetition, default 60).
set -euo pipefail
build=$1
cli=$2
reps=${REPS:-5}
steps=${STEPS:-20}
idle_wait=${IDLE_WAIT:-60}
work=$(mktemp -d)
# shellcheck source=lib/common.sh
source "$(dirname "$0")/lib/common.sh"
competitor=""
cleanup() {
  if [ -n "$competitor" ]; then kill -- "-$competitor" 2> /dev/null || kill "$competitor" 2> /dev/null; fi
  rm -rf "$work"
}
trap cleanup EXIT
# What a user's shell has: no thread settings (bench/run exports OMP_NUM_THREADS=1).
unset OMP_NUM_THREADS OMP_WAIT_POLICY GOMP_SPINCOUNT TANDEM_NUM_CPU_THREADS MKL_NUM_THREADS
# The OpenBLAS kernels tandem launch gives its ranks, for the programs started by hand too.
use_launch_blas_kernels "$cli"
cores=$(nproc)
prog=$build/examples/train_gpt
args=(--steps "$steps" --layers 2 --width 64 --context 32)
# Busy share of all cores over the last interval, from /proc/stat (0-100).
cpu_sample() { awk '/^cpu / { print $2 + $3 + $4 + $7 + $8, $5 + $6 }' /proc/stat; }
busy_since() {  # busy_since "BUSY IDLE" -> percent busy since that sample
  local now
  now=$(cpu_sample)
  awk -v a="$1" -v b="$now" 'BEGIN { split(a, x, " "); split(b, y, " "); t = (y[1] - x[1]) + (y[2] - x[2]);
    printf "%.0f\n", (t > 0 ? 100 * (y[1] - x[1]) / t : 0) }'
}
# Waits up to IDLE_WAIT seconds for a second with under 10% of the cores busy (other users of a
# shared machine); prints the busy share of the last second waited.
wait_quiet() {
  local t s b=0
  for ((t = 0; t < idle_wait; ++t)); do
    s=$(cpu_sample); sleep 1
    b=$(busy_since "$s")
    [ "$b" -lt 10 ] && break
  done
  echo "$b"
}
start_competitor() {
  case $1 in
    idle) competitor="" ;;
    yes) yes > /dev/null & competitor=$! ;;
    gpt) # its own process group, to stop the loop and the run in progress together
      setsid bash -c 'while :; do "$@" > /dev/null 2>&1; done' _ "$prog" --steps 200 "${args[@]:2}" &
      competitor=$! ;;
  esac
  sleep 0.5
}
stop_competitor() {
  if [ -n "$competitor" ]; then
    kill -- "-$competitor" 2> /dev/null || kill "$competitor" 2> /dev/null || true
    wait "$competitor" 2> /dev/null || true
    competitor=""
  fi
}
# one LOAD CONFIG: appends CONFIG's it/s under LOAD to $work/LOAD.CONFIG
one() {
  local load=$1 c=$2 cmd v
  case $c in
    hand) cmd=("$prog") ;;
    before)
      if [ -n "${BEFORE_CLI:-}" ]; then
        cmd=("$BEFORE_CLI" launch -q --num_processes 1 --cpu "$prog")
      else
        cmd=(env OMP_NUM_THREADS="$cores" TANDEM_NUM_CPU_THREADS="$cores" "$prog")
      fi ;;
    after) cmd=("$cli" launch -q --num_processes 1 --cpu "$prog") ;;
    t1) cmd=(env OMP_NUM_THREADS=1 "$prog") ;;
    tn_spin) cmd=(env OMP_NUM_THREADS="$cores" "$prog") ;;
    tn_passive) cmd=(env OMP_NUM_THREADS="$cores" OMP_WAIT_POLICY=PASSIVE "$prog") ;;
  esac
  v=$("${cmd[@]}" "${args[@]}" 2>&1 | grep -o "[0-9.]* it/s" | tail -1 | cut -d' ' -f1) || true
  echo "${v:-nan}" >> "$work/$load.$c"
}
# median: lib/common.sh
cell() {
  [ -f "$work/$1" ] || { echo "-"; return; }
  sort -g "$work/$1" | awk '{v[NR]=$1} END { m = (NR % 2) ? v[(NR+1)/2] : (v[NR/2] + v[NR/2+1]) / 2;
    if (m > 0) printf "%.1f (%s-%s)", m, v[1], v[NR]; else printf "nan" }'
}
ratio() { awk -v a="$(median "$1")" -v b="$(median "$2")" 'BEGIN { if (b > 0 && a != "nan") printf "%.2f", a / b; else print "-" }'; }
loads=(idle yes gpt)
configs=(hand before after t1 tn_spin tn_passive)
for ((r = 1; r <= reps; ++r)); do
  echo "bench/run: busy-machine repetition $r/$reps" >&2
  for load in "${loads[@]}"; do
    start_competitor "$load"
    for c in "${configs[@]}"; do
      # The idle runs each start after a quiet second; its load is recorded.
      [ "$load" = idle ] && wait_quiet >> "$work/background"
      one "$load" "$c"
    done
    stop_competitor
  done
done
hand_threads=$("$cli" env | sed -n 's/^LibTorch threads: intra-op \([0-9]*\).*/\1/p')
after_env=$("$cli" launch --dry_run --num_processes 1 --cpu "$prog" | grep -E "^ +(OMP_|TANDEM_NUM_CPU)" | sed 's/^ *//' | paste -sd ' ')
echo
echo "## One process on a busy machine (examples/train_gpt, it/s)"
echo
echo "Command: \`bench/sections/60-busy-machine.sh\`: \`train_gpt ${args[*]}\` started by hand and under \`tandem launch --num_processes 1 --cpu\`, on the idle machine and beside a competing process: \`yes > /dev/null\` (one core busy) or a second \`train_gpt\` in a loop (by hand). Each cell: the median of $reps runs (min-max), configurations alternating within each repetition; each idle run started after a second with $(sort -g "$work/background" | awk '{v[NR]=$1} END {printf "%s-%s%%", v[1], v[NR]}') of the $cores cores busy (other users of the machine; up to ${idle_wait} s waited for under 10%)."
echo "- by hand: LibTorch's own choice, intra-op threads $hand_threads (OMP_NUM_THREADS unset; LibTorch $("$cli" env | sed -n "s/^LibTorch version: //p" | head -1))"
echo "- launcher before: OMP_NUM_THREADS=$cores TANDEM_NUM_CPU_THREADS=$cores (cores / processes), OpenMP's default wait policy$([ -n "${BEFORE_CLI:-}" ] && echo ", the former \`tandem launch\`" || echo ", the program started with that environment")"
echo "- launcher now: \`$after_env\`"
echo "- $("$cli" env | grep '^BLAS config: ')"
echo "- $("$cli" env | grep '^OpenMP runtime: ')"
echo
echo "| machine | by hand | launcher before | launcher now | now / by hand | 1 thread | $cores threads, default wait (spin) | $cores threads, OMP_WAIT_POLICY=PASSIVE |"
echo "|---|---|---|---|---|---|---|---|"
for load in "${loads[@]}"; do
  case $load in
    idle) label="idle" ;;
    yes) label="busy: \`yes > /dev/null\`" ;;
    gpt) label="busy: a second train_gpt" ;;
  esac
  echo "| $label | $(cell $load.hand) | $(cell $load.before) | $(cell $load.after) | $(ratio $load.after $load.hand) | $(cell $load.t1) | $(cell $load.tn_spin) | $(cell $load.tn_passive) |"
done
