#!/bin/bash
# bench/run section: OpenBLAS's OpenMP build (what scripts/install-deps.sh installs) against its
# pthread build, under LibTorch's OpenMP threads: the plain LibTorch loop of dp_bench with 1 and 2
# intra-op threads. The pthread build is unpacked into a temporary folder (apt-get download, no
# install) and put first on LD_LIBRARY_PATH; `tandem env` confirms which one a process loads.
# A third column forces OpenBLAS's SSE3 kernels, to show what OPENBLAS_CORETYPE is worth.
set -euo pipefail
build=$1
cli=$2
tmpd=$(mktemp -d)
trap 'rm -rf "$tmpd"' EXIT
if ! (cd "$tmpd" && apt-get download libopenblas0-pthread > /dev/null 2>&1); then
  echo; echo "## OpenBLAS: OpenMP vs pthread build"; echo; echo "(skipped: apt-get download libopenblas0-pthread failed)"; exit 0
fi
dpkg -x "$tmpd"/libopenblas0-pthread_*.deb "$tmpd/root"
pth=$(dirname "$(find "$tmpd/root" -name libblas.so.3 | head -1)")
reps=${REPS:-3}
declare -A vals
for ((r = 1; r <= reps; ++r)); do
  for impl in openmp pthread sse3; do
    for th in 1 2; do
      for m in mlp gpt; do
        steps=300; [ $m = gpt ] && steps=20
        if [ $impl = pthread ]; then lib=$pth; else lib=; fi
        core=${OPENBLAS_CORETYPE:-}; [ $impl = sse3 ] && core=Prescott
        v=$(OPENBLAS_CORETYPE=$core LD_LIBRARY_PATH=$lib TANDEM_NUM_CPU_THREADS=$th OMP_NUM_THREADS=$th "$build/bench/dp_bench" plain --model $m --steps $steps | grep -o "samples_per_s=[0-9.]*" | cut -d= -f2)
        vals[$impl.$th.$m]="${vals[$impl.$th.$m]:-} $v"
      done
    done
  done
done
med() { echo "$1" | tr ' ' '\n' | grep . | sort -g | awk '{v[NR]=$1} END {m=(NR%2)?v[(NR+1)/2]:(v[NR/2]+v[NR/2+1])/2; printf "%.1f ±%.0f%%", m, 100*(v[NR]-v[1])/m}'; }
echo
echo "## OpenBLAS: OpenMP vs pthread build under LibTorch (plain LibTorch loop, samples/s)"
echo
echo "The OpenMP build shares LibTorch's OpenMP pool; the pthread build starts a pool of its own beside it. Loaded BLAS: \`$(LD_LIBRARY_PATH=$pth "$cli" env | grep '^BLAS config' | sed 's/BLAS config: //')\` vs \`$("$cli" env | grep '^BLAS config' | sed 's/BLAS config: //')\`. Medians of $reps."
echo
echo "Kernels: the OpenMP and pthread columns run OpenBLAS's \`${OPENBLAS_CORETYPE:-auto-detected}\` kernels (OPENBLAS_CORETYPE as \`tandem launch\` sets it, Note [OpenBLAS kernels]); the last column forces its SSE3 kernels (\`Prescott\`), what OpenBLAS 0.3.21 picks by itself on a CPU model it does not know."
echo
echo "| model | threads | OpenMP build | pthread build | OpenMP build, SSE3 kernels |"
echo "|---|---|---|---|---|"
for m in mlp gpt; do
  for th in 1 2; do
    echo "| $m | $th | $(med "${vals[openmp.$th.$m]}") | $(med "${vals[pthread.$th.$m]}") | $(med "${vals[sse3.$th.$m]}") |"
  done
done
