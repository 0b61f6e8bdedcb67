#!/usr/bin/env bash
# locus-train end to end against PyTorch on Fashion-MNIST, MLP 784-256-128-10, SGD momentum 0.9
# nesterov, 1 thread per process, batches drawn from the locus HDF5 files:
#   L1  locus-train, 1 rank, batch 128 (the loader feeds batches from the HDF5 dataset)
#   T1  PyTorch training loop on in-memory tensors, 1 process, batch 128
#   L2  locus-train, 2 ranks, 128 samples per rank (global batch 256)
#   T2  PyTorch DistributedDataParallel (gloo), 2 processes x 128 samples
# Samples/s of the training loop (start-up and evaluation excluded), medians over alternating
# rounds (the machine is shared: load spikes then hit every variant), and data wait (the share
# of locus's loop spent waiting for the loader).
#   bench/train/run_train_bench.sh [build-dir]     (ROUNDS=5 EPOCHS=3 to change the effort)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=${1:-$here/../../build}
apps=$build/apps
[[ -x $apps/locus-train ]] || { echo "build $apps/locus-train first" >&2; exit 2; }
rounds=${ROUNDS:-5}
epochs=${EPOCHS:-3}
# shellcheck source=bench/train/fm-data.sh
source "$here/fm-data.sh"

median() { sort -g | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
m() { printf '%s\n' "$@" | median; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.2f", a / b}'; }
locus() {  # ranks global-batch -> "samples/s data-wait-%"
  launch "$1" "$apps/locus-train" --data.train="$out/train.h5" --data.test= --train.output= \
    --train.metrics= --train.epochs="$epochs" --train.batch="$2" |
    sed -n 's/^trained .*: \([0-9.]*\) samples\/s, data wait \([0-9.]*\)%.*/\1 \2/p'
}
torch() {  # procs -> samples/s
  /usr/bin/python3 "$here/torch_train_bench.py" --train "$out/train.h5" --procs "$1" \
    --batch 128 --epochs "$epochs" | sed -n 's/^samples_per_s //p'
}
l1=() w1=() t1=() l2=() w2=() t2=()
for ((r = 0; r < rounds; r++)); do
  read -r s w <<< "$(locus 1 128)"; l1+=("$s"); w1+=("$w")
  t1+=("$(torch 1)")
  read -r s w <<< "$(locus 2 256)"; l2+=("$s"); w2+=("$w")
  t2+=("$(torch 2)")
  echo "round $((r + 1)): L1 ${l1[-1]} (wait ${w1[-1]}%)  T1 ${t1[-1]}  L2 ${l2[-1]} (wait ${w2[-1]}%)  T2 ${t2[-1]}  [load $(cut -d' ' -f1 /proc/loadavg)]"
done
L1=$(m "${l1[@]}") T1=$(m "${t1[@]}") L2=$(m "${l2[@]}") T2=$(m "${t2[@]}")
W1=$(m "${w1[@]}") W2=$(m "${w2[@]}")
echo
printf '%-44s %10s\n' "median samples/s over $rounds rounds, $epochs epochs each" ""
printf '%-44s %10.0f   data wait %s%%\n' "L1 locus-train 1 rank x 1 thread, batch 128" "$L1" "$W1"
printf '%-44s %10.0f\n' "T1 PyTorch 1 process x 1 thread, batch 128" "$T1"
printf '%-44s %10.0f   data wait %s%%\n' "L2 locus-train 2 ranks x 1 thread, 2 x 128" "$L2" "$W2"
printf '%-44s %10.0f\n' "T2 PyTorch DDP gloo 2 procs x 1 thread, 2 x 128" "$T2"
echo "L1/T1 $(ratio "$L1" "$T1")   L2/L1 $(ratio "$L2" "$L1") (target >= 1.7)   L2/T2 $(ratio "$L2" "$T2") (target >= 3.5)"
echo "($(getconf _NPROCESSORS_ONLN) cores; load average now $(cut -d' ' -f1-3 /proc/loadavg))"
