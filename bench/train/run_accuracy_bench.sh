#!/usr/bin/env bash
# Fashion-MNIST test accuracy of locus-train against PyTorch with the same hyperparameters:
#   A  the default configs/fashion-mnist.ini on 2 ranks (target: >= 0.89 within a minute),
#      and PyTorch (1 process) with the hyperparameters that config prints (--print-config);
#   B  "PyTorch tutorial" hyperparameters (SGD lr 0.01, momentum 0.9, constant lr, batch 64,
#      10 epochs) in both.
# Each over SEEDS (model init and shuffling seeds); the wall time of locus-train includes
# start-up (reading the dataset) and the per-epoch evaluation.
#   bench/train/run_accuracy_bench.sh [build-dir]       (SEEDS="1 2 3")
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=${1:-$here/../../build}
apps=$build/apps
seeds=${SEEDS:-1 2 3}
# shellcheck source=bench/train/fm-data.sh
source "$here/fm-data.sh"
data=(--data.train="$out/train.h5" --data.test="$out/test.h5" --train.output= --train.metrics=)

# The default config's hyperparameters, as locus-train resolves them.
cfg=$("$apps/locus-train" --print-config)
get() { /usr/bin/python3 -c 'import configparser,sys; c=configparser.ConfigParser(); c.read_string(sys.stdin.read()); print(c[sys.argv[1]][sys.argv[2]])' "$1" "$2" <<< "$cfg"; }
[[ $(get optim optimizer) == sgd && $(get optim schedule) == cosine && $(get optim weight_decay) == 0 ]] ||
  { echo "the PyTorch twin supports only the default's sgd + cosine, no weight decay" >&2; exit 2; }
nesterov=0; [[ $(get optim nesterov) == true ]] && nesterov=1
torch_a=(--lr "$(get optim lr)" --momentum "$(get optim momentum)" --nesterov $nesterov
         --warmup "$(get optim warmup_steps)" --schedule cosine --epochs "$(get train epochs)"
         --batch "$(get train batch)")
tutorial_locus=(--optim.lr=0.01 --optim.momentum=0.9 --optim.nesterov=false
                --optim.schedule=constant --optim.warmup_steps=0 --train.batch=64 --train.epochs=10)
tutorial_torch=(--lr 0.01 --momentum 0.9 --nesterov 0 --schedule constant --warmup 0
                --batch 64 --epochs 10)

stats() { /usr/bin/python3 -c 'import sys,statistics as s; v=[float(x) for x in sys.argv[1:]]; print(f"mean {s.mean(v):.4f} sd {s.stdev(v) if len(v)>1 else 0:.4f} min {min(v):.4f} max {max(v):.4f}")' "$@"; }
acc_locus() { sed -n 's/^test accuracy \([0-9.]*\).*/\1/p'; }
for variant in A B; do
  la=() lw=() ta=()
  for s in $seeds; do
    t0=$(date +%s.%N)
    if [[ $variant == A ]]; then extra=(); else extra=("${tutorial_locus[@]}"); fi
    a=$(launch 2 "$apps/locus-train" "${data[@]}" --model.seed="$s" --loader.seed="$s" "${extra[@]}" | acc_locus)
    w=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f", b - a}')
    la+=("$a"); lw+=("$w")
    if [[ $variant == A ]]; then targs=("${torch_a[@]}"); else targs=("${tutorial_torch[@]}"); fi
    ta+=("$(/usr/bin/python3 "$here/torch_train_bench.py" --train "$out/train.h5" --test "$out/test.h5" \
            --seed "$s" "${targs[@]}" | sed -n 's/^test_accuracy //p')")
    echo "$variant seed $s: locus 2 ranks ${la[-1]} (wall ${lw[-1]} s)   PyTorch ${ta[-1]}   [load $(cut -d' ' -f1 /proc/loadavg)]"
  done
  echo "$variant locus   $(stats "${la[@]}")   wall s: ${lw[*]}"
  echo "$variant PyTorch $(stats "${ta[@]}")"
done
echo "A = configs/fashion-mnist.ini: ${torch_a[*]}"
echo "B = tutorial: ${tutorial_torch[*]}"
