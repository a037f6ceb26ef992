#!/bin/bash
# The main job: installs what is needed, builds, and trains on 2 processes through tandem launch.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/install-deps.sh"
"$root/scripts/build.sh"
cd "$root"
exec build/bin/tandem launch --num_processes 2 --cpu build/examples/train_gpt --steps 120 --eval-every 40 "$@"
