#!/bin/bash
# Configures and builds tandem (library, CLI, examples, tests, benchmarks) in build/ with ccache.
# Extra arguments go to cmake's configure step; TANDEM_BUILD_TARGETS limits what is built.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${TANDEM_BUILD_DIR:-$root/build}
mkdir -p "$build"
# The configure log belongs in the build directory, never in the source tree.
# -g1 (line tables: file:line in stacks and profiles) instead of -g: full debug information of
# LibTorch's templates more than doubles the compile time of every file that includes it.
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG" "$@" > "$build/configure.log" 2>&1 \
  || { cat "$build/configure.log"; exit 1; }
# shellcheck disable=SC2086
cmake --build "$build" -j "$(nproc)" ${TANDEM_BUILD_TARGETS:+--target $TANDEM_BUILD_TARGETS}
