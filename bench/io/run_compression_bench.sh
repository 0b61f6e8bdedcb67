#!/usr/bin/env bash
# ingest.compression side by side on Fashion-MNIST train (60000 x 784), every variant in the
# same run, variants alternated inside each repetition so load spikes on a shared machine hit
# each alike:
#  - size of the published file and locus-ingest's write phase (create, collective write,
#    close, publish; "write X s" in its summary), as MB/s of values (188 MB);
#  - collective read throughput of the whole dataset (locus_dataset_read, warm cache);
#  - locus-train samples/s (MLP 784-256-128-10, batch 128): in memory (the dataset is read
#    once, then batches come from memory) and out of core (loader.memory_budget_mb = 16, global
#    shuffle: every batch's rows read from the file, each compressed chunk they touch
#    decompressed whole), plus the wall time of the whole run (start-up and load included).
# Variants: none, deflate:1, deflate:4 (the default level) and deflate:4 with 1 MiB chunks
# (ingest.chunk_rows = 334, the uncompressed default) to show what the 256 KiB default buys.
# Medians over repetitions; min..max beside them.
#   bench/io/run_compression_bench.sh [build-dir]
#   (env: DIR=/tmp/locus-compress-bench REPS=5 TRAIN_REPS=3 RANKS=2 STEPS=300 OOC_STEPS=60;
#    PARTS="ingest read train" picks the parts; read and train reuse the files in DIR)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
build=${1:-$here/../../build}
for bin in apps/locus-ingest apps/locus-train bench/io/locus_dataset_read; do
  if [[ ! -x $build/$bin ]]; then
    echo "run_compression_bench.sh: $build/$bin not found: build locus-ingest, locus-train and" \
         "locus_dataset_read, or pass the build dir" >&2
    exit 2
  fi
done
dir=${DIR:-/tmp/locus-compress-bench}
reps=${REPS:-5}
train_reps=${TRAIN_REPS:-3}
ranks=${RANKS:-2}
steps=${STEPS:-300}
ooc_steps=${OOC_STEPS:-60}
fm=/usr/share/datasets/fashion-mnist
mkdir -p "$dir"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OPENBLAS_NUM_THREADS=1
mpirun=(mpirun --oversubscribe --bind-to none -n "$ranks")
names=(none deflate1 deflate4 deflate4-1MiB)
declare -A args=([none]="--ingest.compression=none" [deflate1]="--ingest.compression=deflate:1"
                 [deflate4]="--ingest.compression=deflate:4"
                 [deflate4-1MiB]="--ingest.compression=deflate:4 --ingest.chunk_rows=334")
stats() {  # median and min..max of numbers on stdin
  sort -g | awk '{v[NR] = $1} END {m = int((NR + 1) / 2); med = (NR % 2) ? v[m] : (v[m] + v[m + 1]) / 2;
                                    printf "%.1f (%.1f..%.1f)", med, v[1], v[NR]}'
}
echo "machine: $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg); $ranks ranks; $(date -u)"

parts=${PARTS:-ingest read train}
declare -A write_mbs
[[ $parts == *ingest* ]] || reps_ingest=0
for ((r = 1; r <= ${reps_ingest:-$reps}; r++)); do
  for n in "${names[@]}"; do
    # shellcheck disable=SC2086
    out=$("${mpirun[@]}" "$build/apps/locus-ingest" --ingest.images=$fm/train-images-idx3-ubyte.gz \
          --ingest.labels=$fm/train-labels-idx1-ubyte.gz --ingest.output="$dir/$n.h5" \
          --overwrite ${args[$n]})
    s=$(sed -n 's/.*write \([0-9.]*\) s.*/\1/p' <<< "$out")
    write_mbs[$n]+="$(awk -v s="$s" 'BEGIN {printf "%.1f", 60000 * 785 * 4 / 1e6 / s}') "
  done
done
if [[ $parts == *ingest* ]]; then
echo
echo "== size and ingest write phase (MB/s of values; $reps reps) =="
printf '%-15s %10s %8s %26s\n' variant "file MB" ratio "write MB/s median (min..max)"
base=$(stat -c %s "$dir/none.h5")
for n in "${names[@]}"; do
  size=$(stat -c %s "$dir/$n.h5")
  printf '%-15s %10.1f %8.2f %26s\n' "$n" "$(awk -v b="$size" 'BEGIN {print b / 1e6}')" \
         "$(awk -v a="$base" -v b="$size" 'BEGIN {print a / b}')" \
         "$(tr ' ' '\n' <<< "${write_mbs[$n]}" | grep . | stats)"
done
fi

if [[ $parts == *read* ]]; then
echo
echo "== collective read of the whole dataset ($reps reps) =="
files=()
for n in "${names[@]}"; do files+=("$dir/$n.h5"); done
"${mpirun[@]}" "$build/bench/io/locus_dataset_read" --reps "$reps" "${files[@]}"
fi
[[ $parts == *train* ]] || exit 0

train() {  # variant, tag, extra args; prints "samples/s wall_s"
  local n=$1 tag=$2
  shift 2
  local t0 t1
  t0=$(date +%s.%N)
  "${mpirun[@]}" "$build/apps/locus-train" --data.train="$dir/$n.h5" --data.test="$dir/none.h5" \
    --eval.every=0 --train.epochs=1 --train.log_every=5 --optim.warmup_steps=10 \
    --train.output="$dir/model-$n-$tag.h5" --train.metrics="$dir/metrics-$n-$tag.jsonl" \
    "$@" > /dev/null
  t1=$(date +%s.%N)
  # Steady state: the step lines after the first (which holds start-up).
  /usr/bin/python3 - "$dir/metrics-$n-$tag.jsonl" "$(awk -v a="$t0" -v b="$t1" 'BEGIN {print b - a}')" <<'PY'
import json, sys
steps = [json.loads(l) for l in open(sys.argv[1])]
steps = [s for s in steps if s.get("type") == "step"][1:]
print(f"{sum(s['samples'] for s in steps) / sum(s['seconds'] for s in steps):.0f} {float(sys.argv[2]):.2f}")
PY
}
declare -A sps wall
for ((r = 1; r <= train_reps; r++)); do
  for n in "${names[@]}"; do
    read -r a b < <(train "$n" mem --train.max_steps="$steps")
    sps[$n-mem]+="$a "; wall[$n-mem]+="$b "
    read -r a b < <(train "$n" ooc --train.max_steps="$ooc_steps" --loader.memory_budget_mb=16)
    sps[$n-ooc]+="$a "; wall[$n-ooc]+="$b "
  done
done
echo
echo "== locus-train, $ranks ranks ($train_reps reps): samples/s after the first log line; wall s of the run =="
printf '%-15s %22s %18s %22s %18s\n' variant "in memory samples/s" "wall s ($steps st)" \
       "out of core samples/s" "wall s ($ooc_steps st)"
for n in "${names[@]}"; do
  printf '%-15s %22s %18s %22s %18s\n' "$n" \
    "$(tr ' ' '\n' <<< "${sps[$n-mem]}" | grep . | stats)" \
    "$(tr ' ' '\n' <<< "${wall[$n-mem]}" | grep . | stats)" \
    "$(tr ' ' '\n' <<< "${sps[$n-ooc]}" | grep . | stats)" \
    "$(tr ' ' '\n' <<< "${wall[$n-ooc]}" | grep . | stats)"
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
