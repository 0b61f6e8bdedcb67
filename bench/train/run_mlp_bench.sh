#!/usr/bin/env bash
# Runs locus_mlp_bench and torch_mlp_bench.py side by side on the two reference configurations
# and prints samples/s, the sgemm-only bound and the locus/PyTorch ratio against its target.
# Rounds alternate locus and PyTorch runs so load spikes on a shared machine hit both; each
# figure is the median over rounds of per-run medians.
#   bench/train/run_mlp_bench.sh [build-dir]      (ROUNDS=5 STEPS=300 to change the effort)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
build=${1:-$here/../../build}
bin=$build/bench/train/locus_mlp_bench
if [[ ! -x $bin ]]; then
  echo "run_mlp_bench.sh: $bin not found: build it with" \
       "cmake --build $build --target locus_mlp_bench, or pass the build dir" >&2
  exit 2
fi
rounds=${ROUNDS:-5}
steps=${STEPS:-200}
threads=1
export OPENBLAS_NUM_THREADS=$threads OMP_NUM_THREADS=$threads MKL_NUM_THREADS=$threads

median() { sort -g | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
field() { awk -v k="$1" '$1 == k {print $2}'; }

# name widths batch optimizer target
configs=(
  "fashion-mnist 784,256,128,10 128 sgd 1.25"
  "simplenet 1024,512,10 64 adam 2.5"
)
ratio() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.2f", a / b}'; }
printf '%-14s %-15s %5s %-4s | %9s %9s %6s | %9s %9s %6s | %9s %6s | %6s\n' config widths batch \
  opt locus torch ratio locus torch ratio sgemm of_bnd target
printf '%-14s %-15s %5s %-4s | %26s | %26s | %16s |\n' "" "" "" "" "wall clock, samples/s" \
  "CPU time, samples/s" "CPU bound, smp/s"
for c in "${configs[@]}"; do
  read -r name widths batch opt target <<< "$c"
  lw=() lc=() bc=() tw=() tc=()
  for ((r = 0; r < rounds; r++)); do
    out=$("$bin" --widths "$widths" --batch "$batch" --optimizer "$opt" --steps "$steps" \
          --threads $threads)
    lw+=("$(field samples_per_s <<< "$out")")
    lc+=("$(field cpu_samples_per_s <<< "$out")")
    bc+=("$(field cpu_sgemm_bound_samples_per_s <<< "$out")")
    out=$(/usr/bin/python3 "$here/torch_mlp_bench.py" --widths "$widths" --batch "$batch" \
          --optimizer "$opt" --steps "$steps" --threads $threads)
    tw+=("$(field samples_per_s <<< "$out")")
    tc+=("$(field cpu_samples_per_s <<< "$out")")
  done
  m() { printf '%s\n' "$@" | median; }
  LW=$(m "${lw[@]}") LC=$(m "${lc[@]}") BC=$(m "${bc[@]}") TW=$(m "${tw[@]}") TC=$(m "${tc[@]}")
  printf '%-14s %-15s %5s %-4s | %9.0f %9.0f %6s | %9.0f %9.0f %6s | %9.0f %6s | %6s\n' \
    "$name" "$widths" "$batch" "$opt" "$LW" "$TW" "$(ratio "$LW" "$TW")" "$LC" "$TC" \
    "$(ratio "$LC" "$TC")" "$BC" "$(ratio "$LC" "$BC")" ">=$target"
done
echo "(1 thread each; medians of $rounds alternating rounds of $steps steps; $(getconf _NPROCESSORS_ONLN) cores;" \
     "load average $(cut -d' ' -f1-3 /proc/loadavg); CPU time leaves out time other jobs held the core)"
