#!/bin/bash
# The main job: installs what is needed, builds, and trains on 2 processes through tandem launch.
# TANDEM_EXAMPLE picks the program: train_gpt (the default: a byte-level GPT on this repository's
# text) or train_llm (the Llama family: a small byte-level Llama on the same text, or
# `--model DIR --data FILE --save OUT` to fine-tune a transformers folder). Arguments go to the
# program in place of the default ones (each program's --steps and reporting below).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
example=${TANDEM_EXAMPLE:-train_gpt}
case "$example" in
  train_gpt) defaults=(--steps 120 --eval-every 40) ;;
  train_llm) defaults=(--steps 120 --log_every 20) ;;
  *)
    echo "scripts/main.sh: TANDEM_EXAMPLE=$example: expected train_gpt or train_llm" >&2
    exit 2
    ;;
esac
"$root/scripts/install-deps.sh"
# Only what the job runs: the CLI and the example (the tests and benchmarks are built by test.sh).
TANDEM_BUILD_TARGETS="tandem_cli $example" "$root/scripts/build.sh"
cd "$root"
[ $# -gt 0 ] && defaults=("$@")
exec build/bin/tandem launch --num_processes 2 --cpu "build/examples/$example" "${defaults[@]}"
