#!/bin/bash
# The main job: installs what is needed, builds, and trains on 2 processes through tandem launch.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/install-deps.sh"
# Only what the job runs: the CLI and the example (the tests and benchmarks are built by test.sh).
TANDEM_BUILD_TARGETS="tandem_cli train_gpt" "$root/scripts/build.sh"
cd "$root"
exec build/bin/tandem launch --num_processes 2 --cpu build/examples/train_gpt --steps 120 --eval-every 40 "$@"
