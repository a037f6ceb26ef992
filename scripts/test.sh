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
venv=$("$root/scripts/install-torch2.sh")
installed=$(date +%s)
status=0
timings=$(mktemp /tmp/tandem-timings-XXXXXX)
trap 'rm -f "$timings" "$timings".*' EXIT

# Builds with `build_cmd` in `dir`, runs its tests, and appends where the time went to $timings
# (scripts/timings.py: configure, compile, link and test times, the slowest of each).
build_and_test() {
  local label=$1 dir=$2
  shift 2
  local skip=0 t0 t1 t2 rc=0
  [ -f "$dir/.ninja_log" ] && skip=$(wc -l < "$dir/.ninja_log")
  t0=$(date +%s)
  "${build_cmd[@]}" || rc=1
  t1=$(date +%s)
  if [ $rc -eq 0 ]; then
    # One test per core: the multi-process tests spend most of their time waiting on each other.
    (cd "$dir" && ctest --output-on-failure -j "$(nproc)" --output-junit "$timings.$label.xml" "$@") \
      || rc=1
  fi
  t2=$(date +%s)
  python3 "$root/scripts/timings.py" "$label" "$dir" "$skip" $((t1 - t0)) $((t2 - t1)) \
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

echo "== tandem tests: LibTorch 1.13 (Debian), sanitizers: ${sanitize:-none}, in $build" >&2
(
  if [ -n "$sanitize" ]; then
    # shellcheck source=../tests/sanitizers/env.sh
    source "$root/tests/sanitizers/env.sh"
  fi
  build_cmd=(env TANDEM_BUILD_DIR="$build" "$root/scripts/build.sh" -DTANDEM_SANITIZE="$sanitize"
             -DTANDEM_PYTHON="$venv/bin/python" "${program_flags[@]}")
  build_and_test "libtorch-1.13" "$build" "$@"
) || status=1

if [ "${TANDEM_TORCH2:-1}" != 0 ]; then
  echo "== tandem tests: LibTorch 2.12 with CUDA (PyPI's wheel), in $root/build-torch2" >&2
  (
    build_cmd=(env TANDEM_BUILD_DIR="$root/build-torch2" "$root/scripts/build-torch2.sh"
               "${program_flags[@]}")
    build_and_test "libtorch-2.12" "$root/build-torch2" "$@"
  ) || status=1
fi
echo "== timings: install $((installed - started)) s, in all $(($(date +%s) - started)) s" >&2
cat "$timings" >&2
exit $status
