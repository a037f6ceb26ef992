#!/bin/bash
# Installs tandem from BUILD_DIR into a temporary prefix, builds the consumer project against it
# with find_package(tandem), and runs it on 1 and 2 processes.
set -euo pipefail
build=${1:?usage: run.sh BUILD_DIR SOURCE_DIR}
src=${2:?usage: run.sh BUILD_DIR SOURCE_DIR}
work=$(mktemp -d /tmp/tandem-consumer-XXXXXX)
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" > "$work/install.log"
launcher=()
command -v ccache > /dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
cmake -S "$src/tests/consumer" -B "$work/build" -G Ninja -DCMAKE_PREFIX_PATH="$work/prefix" \
  "${launcher[@]}" > "$work/configure.log" || { cat "$work/configure.log"; exit 1; }
cmake --build "$work/build" > "$work/build.log" || { cat "$work/build.log"; exit 1; }
export LD_LIBRARY_PATH="$work/prefix/lib:${LD_LIBRARY_PATH:-}"
"$work/build/consumer"
"$work/prefix/bin/tandem" launch --num_processes 2 --cpu "$work/build/consumer"
