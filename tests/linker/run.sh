#!/bin/bash
# TANDEM_LINKER (CMakeLists.txt): the build's programs were linked by the linker it resolved to
# (gold under "auto" where the compiler has it, its version note in every program), and the
# configure refuses a name it does not know and a linker the compiler cannot run, naming it.
set -uo pipefail
src=${1:?usage: run.sh SOURCE_DIR BUILD_DIR}
build=${2:?usage: run.sh SOURCE_DIR BUILD_DIR}
work=$(mktemp -d /tmp/tandem-linker-XXXXXX)
trap 'rm -rf "$work"' EXIT
failed=0
cache() { sed -n "s|^$1:[A-Z]*=||p" "$build/CMakeCache.txt"; }
linker=$(cache TANDEM_LINKER)
program=$build/bin/tandem
if [ "$linker" = auto ] && [ "$(cache TANDEM_LINKER_gold_WORKS)" = 1 ] || [ "$linker" = gold ]; then
  if readelf -n "$program" | grep -q "NT_GNU_GOLD_VERSION"; then
    echo "ok   TANDEM_LINKER=$linker: $program linked by gold"
  else
    echo "FAIL TANDEM_LINKER=$linker: $program has no gold version note"; failed=1
  fi
elif [ "$linker" = default ] || [ "$linker" = bfd ]; then
  if readelf -n "$program" | grep -q "NT_GNU_GOLD_VERSION"; then
    echo "FAIL TANDEM_LINKER=$linker: $program linked by gold"; failed=1
  else
    echo "ok   TANDEM_LINKER=$linker: $program not linked by gold"
  fi
else
  echo "ok   TANDEM_LINKER=$linker: not checked against the program"
fi
# refused NAME VALUE PATTERN: a configure with -DTANDEM_LINKER=VALUE fails naming PATTERN.
refused() {
  if cmake -S "$src" -B "$work/$1" -DTANDEM_LINKER="$2" > "$work/$1.log" 2>&1; then
    echo "FAIL TANDEM_LINKER=$2: configured"; failed=1
  elif grep -q "$3" "$work/$1.log"; then
    echo "ok   TANDEM_LINKER=$2: refused ($3)"
  else
    echo "FAIL TANDEM_LINKER=$2: failed without naming it:"; tail -20 "$work/$1.log"; failed=1
  fi
}
refused unknown nope "TANDEM_LINKER is 'nope'; expected auto, default, gold, lld, mold or bfd"
# A linker the compiler cannot run: the first of these this machine lacks.
cxx=$(cache CMAKE_CXX_COMPILER)
for l in mold lld gold; do
  if ! echo 'int main(){}' | "$cxx" -x c++ - -fuse-ld="$l" -o "$work/a.out" > /dev/null 2>&1; then
    refused missing "$l" "cannot link with -fuse-ld=$l"
    break
  fi
done
exit $failed
