#!/bin/bash
# Builds the safetensors header fuzz target with clang (a small CMake project of its own: no
# LibTorch needed) and runs it for a bounded time.
#   tests/fuzz/run_fuzz.sh [BUILD_DIR] [SECONDS]
# CXX picks the compiler (default: the first clang++ found). Exits non-zero on a crash; the
# input that caused it is left in BUILD_DIR/artifacts/.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=${1:-$here/../../build-fuzz}
seconds=${2:-20}

cxx=${CXX:-}
if [[ -z "$cxx" || "$(basename "$cxx")" != clang* ]]; then
  cxx=$(command -v clang++ || command -v clang++-14 || true)
fi
if [[ -z "$cxx" ]]; then
  echo "run_fuzz.sh: no clang++ found (libFuzzer needs clang): install clang" >&2
  exit 1
fi

generator=()
if command -v ninja >/dev/null; then generator=(-G Ninja); fi
cmake -S "$here" -B "$build" "${generator[@]}" -DCMAKE_CXX_COMPILER="$cxx" \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$build" --target safetensors_fuzz

# Seed corpus: a few valid files, so that mutations start from the real structure.
corpus=$build/corpus
mkdir -p "$corpus" "$build/artifacts"
seed() {  # seed NAME JSON DATA(printf format)
  local json=$2 n=${#2}
  {
    printf "$(printf '\\x%02x\\x%02x\\x%02x\\x%02x\\x00\\x00\\x00\\x00' \
      $((n & 255)) $((n >> 8 & 255)) $((n >> 16 & 255)) $((n >> 24 & 255)))"
    printf '%s' "$json"
    printf "$3"
  } >"$corpus/$1"
}
seed empty '{}      ' ''
seed one '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}' '\0\0\x80\x3f\0\0\0\x40'
seed meta '{"__metadata__":{"format":"pt"},"w":{"dtype":"I64","shape":[1,1],"data_offsets":[0,8]},"b":{"dtype":"BF16","shape":[],"data_offsets":[8,10]}}' '\1\0\0\0\0\0\0\0\x80\x3f'
seed zero '{"e":{"dtype":"U8","shape":[0,3],"data_offsets":[0,0]},"f":{"dtype":"BOOL","shape":[1],"data_offsets":[0,1]}}' '\1'
# Note [JSON depth limit]: nesting at the limit (64), just past it, and far past it, in a header
# and in an index; brackets inside a name, which are not nesting.
rep() { printf "%*s" "$2" "" | tr ' ' "$1"; }  # rep CHAR COUNT
seed deep64 "{\"t\":{\"dtype\":\"F32\",\"shape\":$(rep '[' 62)$(rep ']' 62),\"data_offsets\":[0,0]}}" ''
seed deep65 "{\"t\":{\"dtype\":\"F32\",\"shape\":$(rep '[' 63)$(rep ']' 63),\"data_offsets\":[0,0]}}" ''
seed deep_objects "{\"t\":$(rep '{' 1000)" ''
seed deep_index "{\"weight_map\":{\"a\":\"m.safetensors\"},\"metadata\":$(rep '[' 1500)$(rep ']' 1500)}" ''
seed bracket_name "{\"$(rep '[' 100)\\\"$(rep '{' 100)\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}" '\1'

# Inputs longer than -max_len, run once each: headers and an index nested 70,000 and 300,000
# deep, which overflowed the stack inside the JSON library before the depth limit.
big=$build/deep
mkdir -p "$big"
for n in 70000 300000; do
  corpus=$big seed "header_$n" "{\"t\":{\"dtype\":\"F32\",\"shape\":$(rep '[' $n)$(rep ']' $n),\"data_offsets\":[0,0]}}" ''
  corpus=$big seed "index_$n" "{\"weight_map\":{},\"metadata\":$(rep '{' $n)" ''
done
"$build/safetensors_fuzz" -rss_limit_mb=2048 "$big"/*

exec "$build/safetensors_fuzz" "$corpus" -dict="$here/safetensors.dict" \
  -max_total_time="$seconds" -max_len=4096 -timeout=10 -rss_limit_mb=2048 \
  -artifact_prefix="$build/artifacts/" -print_final_stats=1
