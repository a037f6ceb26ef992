#!/bin/bash
# Installs what is needed, builds, and runs every test.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/install-deps.sh"
"$root/scripts/build.sh"
cd "${TANDEM_BUILD_DIR:-$root/build}"
ctest --output-on-failure "$@"
