#!/bin/bash
# Installs tandem from BUILD_DIR into a temporary prefix, builds the consumer project against it
# with find_package(tandem) (by the compiler CXX when given, CMake's default otherwise), and runs it
# on 1 and 2 processes.
set -euo pipefail
build=${1:?usage: run.sh BUILD_DIR SOURCE_DIR [CXX]}
src=${2:?usage: run.sh BUILD_DIR SOURCE_DIR [CXX]}
compiler=()
[ -n "${3:-}" ] && compiler=(-DCMAKE_CXX_COMPILER="$3")
work=$(mktemp -d /tmp/tandem-consumer-XXXXXX)
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" > "$work/install.log"
# The compiler cache, with paths under the temporary folder written relative to it and the
# freshly installed headers' times not compared (their contents are), so that a run finds what
# the run before compiled (the consumer's one file includes LibTorch's API: 15-20 s of compile).
launcher=()
command -v ccache > /dev/null &&
  launcher=("-DCMAKE_CXX_COMPILER_LAUNCHER=env;CCACHE_BASEDIR=$work;CCACHE_NOHASHDIR=1;CCACHE_SLOPPINESS=include_file_mtime,include_file_ctime;CCACHE_INODECACHE=true;ccache")
cmake -S "$src/tests/consumer" -B "$work/build" -G Ninja -DCMAKE_PREFIX_PATH="$work/prefix" \
  "${compiler[@]}" "${launcher[@]}" > "$work/configure.log" || { cat "$work/configure.log"; exit 1; }
cmake --build "$work/build" > "$work/build.log" || { cat "$work/build.log"; exit 1; }
# A clean environment for the libraries: the installed CLI and the consumer find libtandem and
# LibTorch through their RPATHs, not through LD_LIBRARY_PATH.
unset LD_LIBRARY_PATH
# bin/tandem runs launch itself and hands the other commands to libexec/tandem/tandem.
for f in "$work/prefix/bin/tandem" "$work/prefix/libexec/tandem/tandem" "$work/build/consumer"; do
  if ldd "$f" | grep -q "not found"; then
    echo "run.sh: $f misses libraries without LD_LIBRARY_PATH:" >&2
    ldd "$f" | grep "not found" >&2
    exit 1
  fi
done
"$work/prefix/bin/tandem" --version
"$work/build/consumer"
"$work/prefix/bin/tandem" launch --num_processes 2 --cpu "$work/build/consumer"
