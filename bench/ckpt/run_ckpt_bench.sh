#!/usr/bin/env bash
# Checkpoint benchmarks (bench/RESULTS.md, "Checkpoints"), medians of alternating rounds:
#  1. write bandwidth of a checkpoint (full commit: HDF5 file, every rank's rows, CRC-32s,
#     fsync, rename, directory fsync, pointer) against `dd conv=fsync` of the same bytes into
#     the same directory, in one process set, rounds alternating which goes first; and the
#     resume of that checkpoint: metadata alone, verified load cold (evicted from the page
#     cache) and warm;
#  2. the training stall per checkpoint of locus-train with synchronous vs background saves
#     (the training loop's time with checkpoints minus without, per checkpoint).
#   bench/ckpt/run_ckpt_bench.sh [BUILD_DIR] [OUT_DIR]
# Env: RANKS (2), ROUNDS (3), WIDTH (16384: a 1 GiB single-layer model), STALL_WIDTHS, PARTS,
# SETTLE (2: seconds of idle disk before every timed write).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build}
out=${2:-$build/ckpt-bench}
ranks=${RANKS:-2} rounds=${ROUNDS:-3} width=${WIDTH:-16384}
stall_widths=${STALL_WIDTHS:-12,2048,2048,4}
parts=${PARTS:-12}  # which parts to run: 1, 2 or 12
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OPENBLAS_NUM_THREADS=1
export OMPI_MCA_mpi_yield_when_idle=1
launch() { mpirun --oversubscribe --bind-to none -n "$1" "${@:2}"; }
mkdir -p "$out"
median() { sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
field() { sed -n "s/.*\"$1\":\([0-9.e+-]*\).*/\1/p"; }

if [[ $parts == *1* ]]; then
echo "== 1. write and resume: ${width}x${width} float32 model on $ranks ranks, $rounds rounds (dir $out), load average $(cut -d' ' -f1-3 /proc/loadavg)"
# One process set runs every round, dd included (see ckpt_bench.cpp for why).
launch "$ranks" "$build/bench/ckpt/locus_ckpt_bench" "$out" "$width" sgd "$rounds" \
  "${SETTLE:-2}" | tee "$out/write.jsonl"
rounds_only() { grep '"round"' "$out/write.jsonl"; }
w=$(rounds_only | field write_GBps | median)
d=$(rounds_only | field dd_GBps | median)
echo "median write GB/s: locus $w, dd conv=fsync $d, ratio of the medians $(awk -v a="$w" -v b="$d" 'BEGIN{printf "%.2f", a/b}')," \
     "median of the per-round ratios $(rounds_only | field ratio | median)"
echo "median seconds: locus $(rounds_only | field write_s | median), dd $(rounds_only | field dd_s | median)," \
     "dd's loop run by rank 0 itself $(rounds_only | field dd_in_rank_s | median)" \
     "(per-round ratio to locus: $(rounds_only | field ratio_in_rank | median))"
echo "median resume: metadata $(rounds_only | field meta_s | median) s," \
     "verified load cold $(rounds_only | field cold_load_s | median) s" \
     "($(rounds_only | field cold_load_GBps | median) GB/s; page-cache share before: $(rounds_only | field cached_before_cold | median))," \
     "warm $(rounds_only | field load_s | median) s ($(rounds_only | field load_GBps | median) GB/s)," \
     "CRC-32 $(field crc_GBps_per_rank <"$out/write.jsonl") GB/s per rank," \
     "agreed stop flag $(field flag_us <"$out/write.jsonl") us per step"
echo "load average during part 1 (per round): $(rounds_only | field loadavg | tr '\n' ' ')"
fi
[[ $parts == *2* ]] || exit 0

echo "== 2. training stall: locus-train $stall_widths adamw on a 2000-row CSV, every 8 steps"
data="$out/stall"
mkdir -p "$data"
/usr/bin/python3 - "$data" <<'PY'
import sys, numpy as np
rng = np.random.default_rng(1)
y = rng.integers(0, 4, 2000); x = rng.normal(0, 1, (2000, 12)) + y[:, None]
with open(sys.argv[1] + "/train.csv", "w") as f:
    f.write(",".join(f"f{i}" for i in range(12)) + ",label\n")
    for xi, yi in zip(x, y):
        f.write(",".join(f"{v:.5f}" for v in xi) + f",{yi}\n")
PY
launch "$ranks" "$build/apps/locus-ingest" --config "$root/configs/tiny.ini" --overwrite \
  --ingest.csv="$data/train.csv" --ingest.output="$data/train.h5" >/dev/null
train() {  # mode: none | sync | async -> "seconds checkpoints"
  local extra=()
  case $1 in
    none) extra=(--checkpoint.dir=) ;;
    sync) extra=(--checkpoint.dir="$data/ck" --checkpoint.async=false) ;;
    async) extra=(--checkpoint.dir="$data/ck" --checkpoint.async=true) ;;
  esac
  rm -rf "$data/ck"
  launch "$ranks" "$build/apps/locus-train" --config "$root/configs/tiny.ini" \
    --data.train="$data/train.h5" --data.test= --model.widths="$stall_widths" \
    --model.dropout=0 --optim.optimizer=adamw --optim.lr=0.001 --train.epochs=1 \
    --train.output= --train.metrics= --checkpoint.every_steps=8 --checkpoint.at_epoch_end=false \
    --checkpoint.keep_last=1 "${extra[@]}" >"$data/$1.log"
  echo "$(sed -n 's/^trained .* in \([0-9.]*\) s:.*/\1/p' "$data/$1.log") $(grep -c '^checkpoint step' "$data/$1.log" || true)"
}
: >"$out/stall.txt"
for r in $(seq "$rounds"); do
  n=$(train none | cut -d' ' -f1); s=$(train sync); a=$(train async)
  echo "$n $s $a" | awk '{printf "none %.3f s | sync %.3f s (%d ckpts) | async %.3f s (%d ckpts) | stall per ckpt: sync %.4f s, async %.4f s\n",
    $1, $2, $3, $4, $5, ($2-$1)/$3, ($4-$1)/$5}' | tee -a "$out/stall.txt"
done
echo "median stall per checkpoint: sync $(sed 's/.*sync \([-0-9.]*\) s, async.*/\1/' "$out/stall.txt" | median) s," \
     "async $(sed 's/.*async \([-0-9.]*\) s$/\1/' "$out/stall.txt" | median) s;" \
     "checkpoint $(du -k "$(ls "$data"/ck/ckpt-*.h5 2>/dev/null | head -n 1 || echo /dev/null)" | cut -f1) KiB"
