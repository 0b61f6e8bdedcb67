#!/usr/bin/env bash
# Checkpoint benchmarks (bench/RESULTS.md, "Checkpoints"), medians of alternating rounds:
#  1. write bandwidth of a checkpoint (full commit: HDF5 collective write, CRC-32s, fsync,
#     rename, directory fsync, pointer) against `dd conv=fsync` of the same bytes into the same
#     directory; and the resume of that checkpoint: metadata alone, verified load;
#  2. the training stall per checkpoint of locus-train with synchronous vs background saves
#     (the training loop's time with checkpoints minus without, per checkpoint).
#   bench/ckpt/run_ckpt_bench.sh [BUILD_DIR] [OUT_DIR]
# Env: RANKS (2), ROUNDS (3), WIDTH (16384: a 1 GiB single-layer model), STALL_WIDTHS, PARTS.
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
echo "== 1. write and resume: ${width}x${width} float32 model on $ranks ranks, $rounds rounds (dir $out)"
: >"$out/write.jsonl"; : >"$out/dd.txt"
for r in $(seq "$rounds"); do
  launch "$ranks" "$build/bench/ckpt/locus_ckpt_bench" "$out/ck" "$width" | tee -a "$out/write.jsonl"
  bytes=$(tail -n 1 "$out/write.jsonl" | field bytes)
  # dd of the same bytes: the checkpoint just written, still in the page cache, so dd too
  # copies memory that is not in the CPU caches (from /dev/zero it would copy one hot page).
  start=$(date +%s.%N)
  dd if="$out/ck/ckpt-00000001.h5" of="$out/dd.bin" bs=1M conv=fsync status=none
  end=$(date +%s.%N)
  rm -rf "$out/ck"  # outside the timed parts: unlinking 1 GiB is no part of a write
  echo "$bytes $start $end" | awk '{printf "%.4f\n", $1 / 1e9 / ($3 - $2)}' | tee -a "$out/dd.txt"
  rm -f "$out/dd.bin"
done
w=$(field write_GBps <"$out/write.jsonl" | median)
d=$(median <"$out/dd.txt")
echo "median write GB/s: locus $w, dd conv=fsync $d, ratio $(awk -v a="$w" -v b="$d" 'BEGIN{printf "%.2f", a/b}')"
echo "median resume: metadata $(field meta_s <"$out/write.jsonl" | median) s, verified load" \
     "$(field load_s <"$out/write.jsonl" | median) s ($(field load_GBps <"$out/write.jsonl" | median) GB/s)," \
     "CRC-32 $(field crc_GBps_per_rank <"$out/write.jsonl" | median) GB/s per rank," \
     "agreed stop flag $(field flag_us <"$out/write.jsonl" | median) us per step"
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
