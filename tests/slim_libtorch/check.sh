#!/bin/bash
# Note [A leaner LibTorch for the tests] (tests/CMakeLists.txt): the copy of libtorch_cpu the tests
# load is its source less the libraries drop_needed.py names, a program loads the copy (and none
# of those libraries) when the copy's folder leads LD_LIBRARY_PATH and the whole library
# otherwise, and one equivalence case trains on the whole library (the copy's folder taken out of
# this test's LD_LIBRARY_PATH, where ctest put it first).
#   check.sh PYTHON ORIGINAL COPY PROGRAM TEST_PROGRAM [ARGS...]
# PROGRAM links LibTorch (the dynamic linker's choices are read off it); TEST_PROGRAM [ARGS...]
# runs one gtest case that trains.
set -euo pipefail
python=$1 original=$2 copy=$3 program=$4
shift 4
here=$(cd "$(dirname "$0")" && pwd)
fail() { echo "slim_libtorch: $*" >&2; exit 1; }

"$python" "$here/drop_needed.py" --check "$original" "$copy"

# This test's own processes load the whole library: the copy's folder out of LD_LIBRARY_PATH.
folder=$(dirname "$copy")
kept=""
IFS=: read -r -a parts <<< "${LD_LIBRARY_PATH:-}"
for p in "${parts[@]}"; do
  [ -n "$p" ] && [ "$p" != "$folder" ] && kept=${kept:+$kept:}$p
done
if [ -n "$kept" ]; then export LD_LIBRARY_PATH=$kept; else unset LD_LIBRARY_PATH; fi
soname=$(basename "$copy")
# What the dynamic linker loads, without running the program (what ldd prints).
loads() { LD_TRACE_LOADED_OBJECTS=1 "$@" 2>&1; }
with_copy=$(LD_LIBRARY_PATH="$folder${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" loads "$program")
whole=$(loads "$program")
echo "$with_copy" | grep -q "$soname => $copy " \
  || fail "with the copy's folder first, $program does not load $copy:"$'\n'"$with_copy"
if echo "$with_copy" | grep -E "lib(opencv_|avcodec|avformat|zmq|lmdb)"; then
  fail "with the copy, $program still loads the libraries above"
fi
echo "$whole" | grep -q "$soname => " || fail "without the copy, $program loads no $soname:"$'\n'"$whole"
if echo "$whole" | grep -q "$copy"; then fail "without the copy's folder, $program still loads $copy"; fi
echo "$whole" | grep -q "libopencv_core" \
  || fail "without the copy, $program does not load OpenCV: is $original Debian's LibTorch?"
echo "$program loads $(echo "$with_copy" | grep -c "=>") libraries with the copy," \
     "$(echo "$whole" | grep -c "=>") with the whole $soname"

# One real training on the whole library: N ranks equal one process.
out=$("$@" 2>&1) || { echo "$out"; fail "$* failed on the whole library"; }
echo "$out" | tail -3
echo "$out" | grep -q "\[  PASSED  \] 1 test" || fail "$* ran no test"
