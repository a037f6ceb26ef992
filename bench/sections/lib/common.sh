# Sourced by the bench sections (bench/sections/*.sh): the helpers they share. Each section sets
# $work (its scratch folder) before calling them.

# use_launch_blas_kernels CLI: the OpenBLAS kernels `tandem launch` gives its ranks, for the
# section's plain processes too (Note [OpenBLAS kernels] in bench/run); a value already set wins.
use_launch_blas_kernels() {
  local core
  core=$("$1" env | sed -n 's/.*narrower than this CPU: OPENBLAS_CORETYPE=\([A-Za-z0-9]*\).*/\1/p')
  if [ -n "$core" ] && [ -z "${OPENBLAS_CORETYPE:-}" ]; then export OPENBLAS_CORETYPE=$core; fi
}

# record NAME "KEY ..." CMD...: runs CMD and appends each KEY's value on its last "RESULT " line
# to $work/NAME.KEY (nan when missing), and each rank's entry of peak_bytes_ranks=<r0,r1,...> to
# $work/NAME.peak<r>.
record() {
  local name=$1 keys=$2
  shift 2
  local line v key peaks rank
  line=$("$@" 2>&1 | grep "RESULT " | tail -1) || true
  for key in $keys; do
    v=$(echo "$line" | grep -o " $key=[0-9.e+-]*" | cut -d= -f2 || true)
    echo "${v:-nan}" >> "$work/$name.$key"
  done
  v=$(echo "$line" | grep -o "peak_bytes_ranks=[0-9,]*" | cut -d= -f2 || true)
  IFS=, read -r -a peaks <<< "${v:-nan,nan}"
  for rank in "${!peaks[@]}"; do echo "${peaks[$rank]}" >> "$work/$name.peak$rank"; done
}

# median FILE: the median of the numbers in $work/FILE (nan when there is none).
median() {
  [ -f "$work/$1" ] || { echo nan; return; }
  sort -g "$work/$1" | awk '{v[NR]=$1} END { m = (NR % 2) ? v[(NR+1)/2] : (v[NR/2] + v[NR/2+1]) / 2; print m }'
}

# spread FILE: (max - min) / median of $work/FILE, in percent.
spread() {
  sort -g "$work/$1" | awk '{v[NR]=$1} END { m = (NR % 2) ? v[(NR+1)/2] : (v[NR/2] + v[NR/2+1]) / 2;
    if (m > 0) printf "%.0f", 100 * (v[NR] - v[1]) / m; else printf "nan" }'
}
