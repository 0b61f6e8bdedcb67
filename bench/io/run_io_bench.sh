#!/usr/bin/env bash
# The I/O benchmark of locus in one run, printed as one table:
#  - HDF5 collective write (create -> write -> close -> fsync) and read (open -> read -> close,
#    warm and cold cache; warm also streamed: each rank's rows in collective 2 MiB pieces
#    through one reused buffer, as locus-infer reads) of a float32 [N, 1024] dataset at 1 and
#    2 ranks, beside `dd conv=fsync` and `cat` of the same byte count in the same directory
#    (locus_h5_bandwidth alternates the two sides rep by rep; ratios are hdf5/raw bandwidth,
#    target >= 0.90);
#  - locus-ingest throughput (MB/s of input) on the Fashion-MNIST train set (gzip IDX) and on a
#    generated CSV at 1 and 2 ranks, runs alternating between rank counts.
# Figures are medians over repetitions; the machine is shared, so read the min..max spread too.
#   bench/io/run_io_bench.sh [build-dir]
#   chrt -r 1 bench/io/run_io_bench.sh build-iobench   (shielded from other jobs' CPU use, as
#                                                      bench/RESULTS.md records it)
#   (env: DIR=/tmp/locus-io-bench BYTES=1GiB REPS=7 INGEST_RUNS=5 CSV_MB=300)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
build=${1:-$here/../../build}
bw=$build/bench/io/locus_h5_bandwidth
ingest=$build/apps/locus-ingest
for bin in "$bw" "$ingest"; do
  if [[ ! -x $bin ]]; then
    echo "run_io_bench.sh: $bin not found: build it with cmake --build $build --target" \
         "locus_h5_bandwidth locus-ingest, or pass the build dir" >&2
    exit 2
  fi
done
dir=${DIR:-/tmp/locus-io-bench}
bytes=${BYTES:-1GiB}
reps=${REPS:-7}
ingest_runs=${INGEST_RUNS:-5}
csv_mb=${CSV_MB:-300}
fm_images=/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
fm_labels=/usr/share/datasets/fashion-mnist/train-labels-idx1-ubyte.gz
mkdir -p "$dir"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OPENBLAS_NUM_THREADS=1
# No binding: dd and cat inherit rank 0's mask, and a pinned core may be the busy one.
mpirun=(mpirun --oversubscribe --bind-to none)

median() {
  sort -g | awk '{v[NR] = $1}
                 END {m = int((NR + 1) / 2); print (NR % 2) ? v[m] : (v[m] + v[m + 1]) / 2}'
}
minmax() { sort -g | awk 'NR == 1 {lo = $1} {hi = $1} END {printf "%.1f..%.1f", lo, hi}'; }
kv() { tr ' ' '\n' | awk -F= -v k="$1" '$1 == k {print $2}'; }
now() { date +%s.%N; }

# The share of time some task waited for a CPU: how contended the shared machine was.
psi() {
  awk '$1 == "some" {sub("avg300=", "", $4); print $4}' /proc/pressure/cpu 2>/dev/null || echo '?'
}
# Under `chrt -r 1 run_io_bench.sh` every process here (ranks, dd, cat) inherits SCHED_RR.
sched=$(chrt -p $$ 2>/dev/null | awk -F': ' 'NR == 1 {p = $2} NR == 2 {print p, $2}')
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
psi_before=$(psi)
fs=$(df -T "$dir" | awk 'NR == 2 {print $2 " on " $1}')

# --- HDF5 bandwidth beside dd / cat --------------------------------------------------------
declare -A summary
for np in 1 2; do
  out=$("${mpirun[@]}" -n $np "$bw" --bytes "$bytes" --dir "$dir" --reps "$reps")
  printf "%s\n" "$out" | grep -v "^summary"  # the full report, for the record
  summary[$np]=$(printf '%s\n' "$out" | grep '^summary')
done

# --- ingest throughput ----------------------------------------------------------------------
csv=$dir/ingest-${csv_mb}mb.csv
if [[ ! -s $csv ]]; then
  /usr/bin/python3 "$here/make_csv.py" "$csv" --mb "$csv_mb" --features 32
fi
csv_features=$(head -1 "$csv" | tr ',' '\n' | grep -c '^f')
declare -A ingest_args=(
  [idx]="--ingest.images=$fm_images --ingest.labels=$fm_labels"
  [csv]="--ingest.source=csv --ingest.csv=$csv --ingest.csv_label=y \
         --gates.features=$csv_features --ingest.num_classes=10"
)
declare -A runs in_mb  # runs[field.src.np]: one value per timed run, space-separated
for ((r = 0; r < ingest_runs + 1; r++)); do  # run 0 is an untimed warm-up
  for src in idx csv; do
    for np in 1 2; do
      t0=$(now)
      # shellcheck disable=SC2086  # the argument lists are meant to split
      out=$(/usr/bin/time -f 'cpu %U %S' -o "$dir/time.txt" "${mpirun[@]}" -n $np "$ingest" \
            --overwrite ${ingest_args[$src]} "--ingest.output=$dir/ingest-$src.h5")
      t1=$(now)
      ((r == 0)) && continue
      # "  input 26.5 MB in 2.42 s (10.9 MB/s): parse 1.32 s, gates 0.12 s, write 0.98 s"
      read -r mb rate parse gates write < <(grep -E '^  input ' <<< "$out" | tr -d '(,' |
        awk '{print $2, $7, $10, $13, $16}')
      in_mb[$src]=$mb
      k=$src.$np
      runs[rate.$k]+="$rate " runs[parse.$k]+="$parse " runs[gates.$k]+="$gates "
      runs[write.$k]+="$write "
      runs[wall.$k]+="$(awk -v mb="$mb" -v a="$t0" -v b="$t1" 'BEGIN {print mb / (b - a)}') "
      runs[cpu.$k]+="$(awk '$1 == "cpu" {print $2 + $3}' "$dir/time.txt") "
    done
  done
done
med() { tr ' ' '\n' <<< "${runs[$1]}" | grep . | median; }

# --- the table ------------------------------------------------------------------------------
echo
echo "locus I/O benchmark: $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) cores, dir $dir ($fs)," \
     "git $(git -C "$here" rev-parse --short HEAD 2>/dev/null || echo '?'), scheduling ${sched:-?}"
printf '%-38s %5s %11s %11s %7s %7s %7s\n' "HDF5 ($bytes, median of $reps reps)" ranks \
  "locus MB/s" "raw MB/s" ratio paired target
for np in 1 2; do
  s=${summary[$np]}
  while IFS='|' read -r label h5 raw ratio paired target; do
    printf '%-38s %5s %11.0f %11.0f %7.2f %7.2f %7s\n' "$label" $np "$(kv "$h5" <<< "$s")" \
      "$(kv "$raw" <<< "$s")" "$(kv "$ratio" <<< "$s")" "$(kv "$paired" <<< "$s")" "$target"
  done <<'EOF'
write+fsync vs dd conv=fsync|h5_write|dd_write|write_ratio|write_paired|>=0.90
read warm vs cat warm|h5_read_warm|cat_warm|warm_read_ratio|warm_read_paired|>=0.90
read warm, streamed, vs cat warm|h5_stream_warm|cat_warm|stream_read_ratio|stream_read_paired|>=0.90
read cold vs cat cold|h5_read_cold|cat_cold|cold_read_ratio|cold_read_paired|>=0.90
(warm vs pread into the same buffers)|h5_read_warm|pread_warm|same_buffer_ratio|same_buffer_paired|-
EOF
  echo "  ($np ranks: transfer mode write $(kv write_mode <<< "$s"), read" \
       "$(kv read_mode <<< "$s"), streamed read $(kv stream_mode <<< "$s"); wrong values" \
       "read back: $(kv wrong <<< "$s"))"
done
echo
printf '%-38s %5s %10s %12s %9s %8s %8s %8s %8s\n' "ingest (median of $ingest_runs runs)" \
  ranks "input MB/s" "(min..max)" "wall MB/s" "parse s" "gates s" "write s" "cpu s"
for src in idx csv; do
  name="fashion-mnist train idx.gz (${in_mb[$src]} MB)"
  [[ $src == csv ]] && name="generated csv, $csv_features features (${in_mb[$src]} MB)"
  for np in 1 2; do
    k=$src.$np
    printf '%-38s %5s %10.1f %12s %9.1f %8.2f %8.2f %8.2f %8.2f\n' "$name" $np \
      "$(med rate.$k)" "$(tr ' ' '\n' <<< "${runs[rate.$k]}" | grep . | minmax)" \
      "$(med wall.$k)" "$(med parse.$k)" "$(med gates.$k)" "$(med write.$k)" "$(med cpu.$k)"
  done
done
echo "(ratio: of medians; paired: median of per-rep ratios. input MB/s: as locus-ingest" \
     "reports it (parse + gates + write + publish); wall MB/s: around mpirun, start-up" \
     "included; cpu s: user + sys of all ranks. Load average before $load_before, after" \
     "$(cut -d' ' -f1-3 /proc/loadavg); CPU pressure (some, avg300) before $psi_before%, after" \
     "$(psi)%.)"
