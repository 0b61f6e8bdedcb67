#!/usr/bin/env bash
# locus-ingest with one slow rank: 2 ranks, rank 1 parsing every unit 4x slower
# (LOCUS_TEST_HOOK=ingest-unit:slow4@1: after each unit it waits 3x the time the unit took, and
# stops waiting when another rank finished the unit), against the time an ideal schedule needs,
# with the static split (ingest.schedule=static: rank r its block of units, no speculation) for
# comparison. Rounds alternate the runs so load spikes on a shared machine hit all of them;
# figures are medians over rounds.
#   bench/io/run_ingest_straggler.sh BUILD_DIR [WORKDIR]   (env: ROUNDS=7 CSV_MB=300)
# Only the unit loop is slowed (the checksums of the inputs, the gates, the write and the
# publication are not), so the ideal is: the 2-rank run's time outside its unit loop + its loop
# time x 2 / 1.25 (two ranks, one at 1/4 speed, have 1.25 ranks' speed; as bench/infer), and,
# stricter where 2 ranks scale below 2x, the 1-rank loop time / 1.25. The loop time of a run is
# its slowest rank's (the gate report's schedule.per_rank[].seconds).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=$1 work=${2:-$(mktemp -d /tmp/locus-ingest-straggler.XXXXXX)}
rounds=${ROUNDS:-7} csv_mb=${CSV_MB:-300}
ingest=$build/apps/locus-ingest
mkdir -p "$work"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OPENBLAS_NUM_THREADS=1
fm=/usr/share/datasets/fashion-mnist
csv=$work/in-${csv_mb}mb.csv
[[ -s $csv ]] || /usr/bin/python3 "$here/make_csv.py" "$csv" --mb "$csv_mb" --features 32
declare -A args=(
  [idx]="--ingest.images=$fm/train-images-idx3-ubyte.gz --ingest.labels=$fm/train-labels-idx1-ubyte.gz"
  [csv]="--ingest.source=csv --ingest.csv=$csv --ingest.csv_label=y --gates.features=32 --ingest.num_classes=10"
)
median() { sort -g | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
# run SRC NAME [HOOK] ARGS...: prints "total_s loop_s reruns rerun_wins"
run() {
  local src=$1 name=$2 hook=$3; shift 3
  # shellcheck disable=SC2086  # the argument lists are meant to split
  LOCUS_TEST_HOOK=$hook mpiexec --oversubscribe --bind-to none -n "${NP:-2}" -x LOCUS_TEST_HOOK "$ingest" \
    --overwrite ${args[$src]} "--ingest.output=$work/$src-$name.h5" "$@" > "$work/$src-$name.log"
  local total
  total=$(awk '/^  input / {print $5}' "$work/$src-$name.log")
  /usr/bin/python3 - "$work/$src-$name.h5.gates.json" "$total" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))["schedule"]
r = s["per_rank"]
print(sys.argv[2], max(x["seconds"] for x in r), sum(x["reruns"] for x in r),
      sum(x["rerun_wins"] for x in r))
PY
}
declare -A res
for ((i = 0; i <= rounds; i++)); do  # round 0: an untimed warm-up
  for src in idx csv; do
    l1=$(NP=1 run $src l1 "") l2=$(run $src l2 "") slow=$(run $src slow ingest-unit:slow4@1)
    st=$(run $src static ingest-unit:slow4@1 --ingest.schedule=static)
    ((i == 0)) && continue
    res[$src.l1]+="$l1"$'\n' res[$src.l2]+="$l2"$'\n' res[$src.slow]+="$slow"$'\n' res[$src.static]+="$st"$'\n'
  done
done
col() { printf '%s' "${res[$1]}" | awk -v c="$2" 'NF {print $c}' | median; }
echo "locus-ingest, 2 ranks, rank 1 slowed 4x; $rounds rounds, medians; $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg), git $(git -C "$here" rev-parse --short HEAD 2>/dev/null || echo '?')"
for src in idx csv; do
  t1=$(col $src.l1 1) l1=$(col $src.l1 2) t2=$(col $src.l2 1) l2=$(col $src.l2 2)
  # The stricter ideal from 1 rank: its loop's work at 1.25 ranks' speed (perfect scaling).
  ideal1=$(awk -v t="$t2" -v l="$l2" -v l1="$l1" 'BEGIN {printf "%.3f", t - l + l1 / 1.25}')
  loop_ideal1=$(awk -v l1="$l1" 'BEGIN {printf "%.3f", l1 / 1.25}')
  ideal=$(awk -v t="$t2" -v l="$l2" 'BEGIN {printf "%.3f", t - l + 2 * l / 1.25}')
  loop_ideal=$(awk -v l="$l2" 'BEGIN {printf "%.3f", 2 * l / 1.25}')
  ts=$(col $src.slow 1) ls=$(col $src.slow 2) tst=$(col $src.static 1) lst=$(col $src.static 2)
  r() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.2f", a / b}'; }
  echo "== $src ($(grep -o 'units: [0-9]* of [0-9.]* MiB' "$work/$src-l2.log"))"
  echo "  1 rank:                   total $t1 s, unit loop $l1 s"
  echo "  2 ranks, nobody slowed:   total $t2 s, unit loop $l2 s"
  echo "  slowed, dynamic:          total $ts s = $(r "$ts" "$ideal") x ideal $ideal s; unit loop $ls s = $(r "$ls" "$loop_ideal") x ideal $loop_ideal s   (target <= 1.15)"
  echo "  slowed, static split:     total $tst s = $(r "$tst" "$ideal") x ideal; unit loop $lst s = $(r "$lst" "$loop_ideal") x ideal"
  echo "  against the 1-rank ideal (loop $loop_ideal1 s): dynamic total $(r "$ts" "$ideal1"), loop $(r "$ls" "$loop_ideal1"); static total $(r "$tst" "$ideal1"), loop $(r "$lst" "$loop_ideal1")"
  # Paired: each round's slowed runs against that round's own ideal (the runs of one round sit
  # side by side, so they share its load), then the median over rounds.
  paired() {  # paired KIND COLUMN(1 total, 2 loop) IDEAL(2: from 2 ranks, 1: from 1 rank)
    paste -d' ' <(printf '%s' "${res[$src.$1]}") <(printf '%s' "${res[$src.l2]}") \
      <(printf '%s' "${res[$src.l1]}") | awk -v c="$2" -v w="$3" 'NF {
        l2 = $6; l1 = $10; t2 = $5; loop = (w == 2) ? 2 * l2 / 1.25 : l1 / 1.25
        ideal = (c == 1) ? t2 - l2 + loop : loop; print $c / ideal }' | median
  }
  printf '  paired medians (slowed / ideal of its round): dynamic loop %.2f, total %.2f; static loop %.2f, total %.2f; against the 1-rank ideal: dynamic loop %.2f, total %.2f; static loop %.2f\n' \
    "$(paired slow 2 2)" "$(paired slow 1 2)" "$(paired static 2 2)" "$(paired static 1 2)" \
    "$(paired slow 2 1)" "$(paired slow 1 1)" "$(paired static 2 1)"
  echo "  re-runs/wins per round (slowed, dynamic): $(printf '%s' "${res[$src.slow]}" | awk 'NF {printf "%s/%s ", $3, $4}')"
done
echo "raw (total s, unit loop s, re-runs, re-run wins):"
for k in idx.l1 idx.l2 idx.slow idx.static csv.l1 csv.l2 csv.slow csv.static; do
  printf '  %s: %s\n' "$k" "$(printf '%s' "${res[$k]}" | tr '\n' ';')"
done
