#!/bin/bash
# Installs what is needed, builds, and runs every test, against both LibTorch builds:
#  1. Debian's LibTorch 1.13 (CPU), instrumented with AddressSanitizer + UndefinedBehaviorSanitizer
#     (TANDEM_SANITIZE=address, in build-asan/), so that every unit and multi-process test also
#     checks tandem's memory and arithmetic; TANDEM_SANITIZE= (empty) for a plain build in
#     build/, or thread for ThreadSanitizer (build-tsan/).
#  2. LibTorch 2.12 with CUDA from PyPI's torch wheel (scripts/build-torch2.sh, build-torch2/):
#     the whole tree compiles and links with CUDA and NCCL, and every test runs on the CPU.
#     TANDEM_TORCH2=0 leaves this part out.
# Both run the tests against the Python tools (tests/oracle), with the Python environment of
# scripts/install-torch2.sh. Extra arguments go to ctest (e.g. -L unit, -R Resume).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
sanitize=${TANDEM_SANITIZE-address}
case "$sanitize" in
  address) default_dir=$root/build-asan ;;
  thread) default_dir=$root/build-tsan ;;
  "") default_dir=$root/build ;;
  *) echo "TANDEM_SANITIZE=$sanitize: expected address, thread or empty" >&2; exit 2 ;;
esac
build=${TANDEM_BUILD_DIR:-$default_dir}
started=$(date +%s)
"$root/scripts/install-deps.sh"
timings=$(mktemp /tmp/tandem-timings-XXXXXX)
# A background phase still running when the script stops (an error, ^C) stops with it.
trap 'kill $(jobs -p) 2> /dev/null || true; rm -f "$timings" "$timings".*' EXIT

# Note [Overlapped phases]: the run is CPU-bound on two cores, but not every phase is. The Python
# environment (several GB of wheels on a fresh machine: download and unpacking) installs while the
# first build compiles, which needs only its path; and the second build compiles at the lowest
# priority while the first build's tests run, taking the cycles their processes leave when they
# wait on each other (a few percent of the two cores; a build from a warm cache needs little
# more), so the tests keep most of their speed. Its output follows the first tests'.
venv=$("$root/scripts/install-torch2.sh" --path)
venv_started=$(date +%s)
(
  rc=0
  "$root/scripts/install-torch2.sh" > /dev/null 2> "$timings.venv.log" || rc=$?
  date +%s > "$timings.venv.end"
  exit $rc
) &
venv_pid=$!
venv_s=""
wait_venv() {
  [ -n "$venv_s" ] && return 0
  local rc=0
  wait "$venv_pid" || rc=$?
  venv_s=$(($(cat "$timings.venv.end" 2> /dev/null || date +%s) - venv_started))
  cat "$timings.venv.log" >&2
  if [ $rc -ne 0 ]; then
    echo "test.sh: scripts/install-torch2.sh failed (exit $rc); its output is above" >&2
    exit 1
  fi
}
status=0

# Builds with `build_cmd` in `dir` and notes what scripts/timings.py needs; returns the build's
# status.
build_tree() {
  local label=$1 dir=$2 skip=0 t0 rc=0
  [ -f "$dir/.ninja_log" ] && skip=$(wc -l < "$dir/.ninja_log")
  t0=$(date +%s)
  "${build_cmd[@]}" || rc=1
  echo "$skip $(($(date +%s) - t0))" > "$timings.$label.build"
  return $rc
}

# Runs the tests of `dir` when its build passed (`built` 1), then appends where the time went to
# $timings (scripts/timings.py: configure, compile, link and test times, the slowest of each).
test_tree() {
  local label=$1 dir=$2 built=$3
  shift 3
  local skip build_s t0 rc=0
  read -r skip build_s < "$timings.$label.build"
  t0=$(date +%s)
  if [ "$built" = 1 ]; then
    # Three tests per two cores: at one per core the cores were idle 15.6% of the ASan suite's
    # time (a system-wide profile), while a test's ranks wait on each other, on a rendezvous or on
    # a timeout it checks; a third test fills that (ASan suite 605 -> 527 s, 2.12 400 -> 364 s on
    # 2 cores, docs/test_times.md).
    (cd "$dir" && ctest --output-on-failure -j "$(($(nproc) * 3 / 2))" \
      --output-junit "$timings.$label.xml" "$@") \
      || rc=1
  else
    rc=1
  fi
  python3 "$root/scripts/timings.py" "$label" "$dir" "$skip" "$build_s" $(($(date +%s) - t0)) \
    "$timings.$label.xml" >> "$timings" 2>&1 || true
  return $rc
}

# The programs (tests, workers, examples, benchmarks, the CLI) at -O0: they are thin loops around
# the library and LibTorch, which keep the build type's level; code generation for LibTorch's
# templates is most of their compile time (cmake/TandemPrograms.cmake).
program_flags=(-DTANDEM_PROGRAM_OPTIMIZATION=-O0)
# The library's and the test programs' files compiled a batch at a time (TANDEM_UNITY_BUILD in
# cmake/TandemPrograms.cmake): a third less compile time from an empty cache. TANDEM_UNITY_BUILD=OFF
# here for trees where an edit should recompile its one file, not its batch.
program_flags+=(-DTANDEM_UNITY_BUILD="${TANDEM_UNITY_BUILD:-ON}")

sanitizer_env() {
  if [ -n "$sanitize" ]; then
    # shellcheck source=../tests/sanitizers/env.sh
    source "$root/tests/sanitizers/env.sh"
  fi
}

# Both builds compile with clang (TANDEM_TEST_CXX, Debian's clang++ by default; the
# ThreadSanitizer and plain variants of the first keep CMake's default compiler): from an empty
# cache clang compiles the ASan build in 53% of GCC's CPU and the 2.12 build in about half
# (docs/test_times.md, "Two compilers"). GCC, the compiler a user's project gets by default,
# compiles the consumer project against the installed 2.12 build (tests/consumer).
test_cxx=$(command -v "${TANDEM_TEST_CXX:-clang++}") || {
  echo "test.sh: no compiler ${TANDEM_TEST_CXX:-clang++} (TANDEM_TEST_CXX) on the PATH;" \
       "scripts/install-deps.sh installs clang" >&2
  exit 2
}
# A full path: the same value as the build's cache keeps, so that a configure again is no change.
test_cxx=(-DCMAKE_CXX_COMPILER="$test_cxx")
first_cxx=()
[ "$sanitize" = address ] && first_cxx=("${test_cxx[@]}")
# The ASan build's library at -O0 too (the sanitizers otherwise take -O1): its code is under 1% of
# the tests' CPU, and clang compiles a batch of it in 18 s at -O0 against 33 s at -O1. The 2.12
# build keeps -O2, the optimized library users build.
first_flags=()
[ "$sanitize" = address ] && first_flags=(-DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O0 -g1 -DNDEBUG")

echo "== tandem tests: LibTorch 1.13 (Debian), sanitizers: ${sanitize:-none}, in $build" >&2
built=1
(
  sanitizer_env
  # The tests of Debian's LibTorch load a copy of libtorch_cpu without the libraries of Caffe2's
  # image, video and database operators: 44 libraries per worker instead of 291 (Note [A leaner
  # LibTorch for the tests] in tests/CMakeLists.txt).
  build_cmd=(env TANDEM_BUILD_DIR="$build" "$root/scripts/build.sh" -DTANDEM_SANITIZE="$sanitize"
             -DTANDEM_PYTHON="$venv/bin/python" -DTANDEM_TEST_SLIM_LIBTORCH=ON
             "${first_cxx[@]}" "${first_flags[@]}" "${program_flags[@]}")
  build_tree "libtorch-1.13" "$build"
) || built=0
wait_venv

torch2_pid=""
if [ "${TANDEM_TORCH2:-1}" != 0 ]; then
  echo "== LibTorch 2.12 with CUDA (PyPI's wheel): building in $root/build-torch2 beside the" \
       "tests below, at the lowest priority; its output follows them" >&2
  (
    build_cmd=(nice -n 19 env TANDEM_BUILD_DIR="$root/build-torch2"
               "$root/scripts/build-torch2.sh" "${test_cxx[@]}" "${program_flags[@]}")
    build_tree "libtorch-2.12" "$root/build-torch2"
  ) > "$timings.torch2-build.log" 2>&1 &
  torch2_pid=$!
fi

(
  sanitizer_env
  test_tree "libtorch-1.13" "$build" "$built" "$@"
) || status=1

if [ -n "$torch2_pid" ]; then
  built=1
  wait "$torch2_pid" || built=0
  echo "== tandem tests: LibTorch 2.12 with CUDA (PyPI's wheel), in $root/build-torch2;" \
       "its build's output:" >&2
  cat "$timings.torch2-build.log" >&2
  test_tree "libtorch-2.12" "$root/build-torch2" "$built" "$@" || status=1
fi
finished=$(date +%s)
echo "== timings: install $((venv_started - started)) s (packages) + ${venv_s} s (Python" \
     "environment, beside the first build), in all $((finished - started)) s" >&2
cat "$timings" >&2
exit $status
