#!/bin/bash
# Installs what is needed, builds, and runs every test. By default the build is instrumented with
# AddressSanitizer + UndefinedBehaviorSanitizer (TANDEM_SANITIZE=address, in build-asan/), so
# that every unit and multi-process test also checks tandem's memory and arithmetic; set
# TANDEM_SANITIZE= (empty) for a plain build in build/, or thread for ThreadSanitizer (build-tsan/).
# Extra arguments go to ctest (e.g. -L unit, -R Resume).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
sanitize=${TANDEM_SANITIZE-address}
case "$sanitize" in
  address) default_dir=$root/build-asan ;;
  thread) default_dir=$root/build-tsan ;;
  "") default_dir=$root/build ;;
  *) echo "TANDEM_SANITIZE=$sanitize: expected address, thread or empty" >&2; exit 2 ;;
esac
export TANDEM_BUILD_DIR=${TANDEM_BUILD_DIR:-$default_dir}
"$root/scripts/install-deps.sh"
if [ -n "$sanitize" ]; then
  # shellcheck source=../tests/sanitizers/env.sh
  source "$root/tests/sanitizers/env.sh"
fi
"$root/scripts/build.sh" -DTANDEM_SANITIZE="$sanitize"
cd "$TANDEM_BUILD_DIR"
# One test per core: the multi-process tests spend most of their time waiting on each other.
ctest --output-on-failure -j "$(nproc)" "$@"
