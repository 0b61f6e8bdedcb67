#!/usr/bin/env bash
# The cost of ingest.join: locus-ingest of a generated CSV (32 features, a key column k of
# 10000 distinct keys) plain (k left out) and joined to a 10000-row table of 4 numeric columns
# by k, side by side. Rounds alternate the two runs so load spikes on a shared machine hit both;
# figures are medians over rounds (round 0 is an untimed warm-up), plus the median of each
# round's ratio joined / plain.
#   bench/io/run_ingest_join.sh BUILD_DIR [WORKDIR]   (env: ROUNDS=7 CSV_MB=100 NP=2)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=$1 work=${2:-$(mktemp -d /tmp/locus-ingest-join.XXXXXX)}
rounds=${ROUNDS:-7} csv_mb=${CSV_MB:-100} np=${NP:-2}
ingest=$build/apps/locus-ingest
mkdir -p "$work"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OPENBLAS_NUM_THREADS=1
csv=$work/in-${csv_mb}mb-keys.csv dim=$work/dim.csv
[[ -s $csv ]] || /usr/bin/python3 "$here/make_csv.py" "$csv" --mb "$csv_mb" --features 32 --keys 10000
[[ -s $dim ]] || /usr/bin/python3 - "$dim" <<'PY'
import sys
import numpy as np
rng = np.random.default_rng(2)
with open(sys.argv[1], "w") as f:
    f.write("k,d0,d1,d2,d3\n")
    for k in range(10000):
        f.write(f"{k}," + ",".join(f"{v:.6g}" for v in rng.normal(size=4)) + "\n")
PY
features=$(seq -s, -f 'f%g' 0 31)
common=(--overwrite --ingest.source=csv "--ingest.csv=$csv" --ingest.csv_label=y
        "--ingest.csv_features=$features" --ingest.num_classes=10 --gates.features=0)
median() { sort -g | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
# run NAME ARGS...: prints "total_s loop_s" (loop: the slowest rank's unit loop)
run() {
  local name=$1; shift
  mpiexec --oversubscribe --bind-to none -n "$np" "$ingest" "${common[@]}" \
    "--ingest.output=$work/$name.h5" "$@" > "$work/$name.log"
  local total
  total=$(awk '/^  input / {print $5}' "$work/$name.log")
  /usr/bin/python3 -c 'import json, sys; r = json.load(open(sys.argv[1]))["schedule"]["per_rank"]; print(sys.argv[2], max(x["seconds"] for x in r))' \
    "$work/$name.h5.gates.json" "$total"
}
plain_t="" join_t="" ratio_t="" ratio_l="" plain_l="" join_l=""
for ((i = 0; i <= rounds; i++)); do
  if ((i % 2)); then  # alternate which goes first
    j=$(run joined "--ingest.join=$dim" --ingest.join_key=k) p=$(run plain)
  else
    p=$(run plain) j=$(run joined "--ingest.join=$dim" --ingest.join_key=k)
  fi
  echo "round $i: plain $p, joined $j" >&2
  ((i == 0)) && continue
  read -r pt pl <<< "$p"; read -r jt jl <<< "$j"
  plain_t+="$pt"$'\n' join_t+="$jt"$'\n' plain_l+="$pl"$'\n' join_l+="$jl"$'\n'
  ratio_t+=$(awk -v a="$jt" -v b="$pt" 'BEGIN {print a / b}')$'\n'
  ratio_l+=$(awk -v a="$jl" -v b="$pl" 'BEGIN {print a / b}')$'\n'
done
echo "locus-ingest plain vs joined, $np ranks, $(du -m "$csv" | cut -f1) MiB CSV; $rounds rounds, medians; $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg), git $(git -C "$here" rev-parse --short HEAD 2>/dev/null || echo '?')"
m() { printf '%s' "$1" | median; }
echo "whole run (s): plain $(m "$plain_t"), joined $(m "$join_t"); paired ratio joined/plain $(m "$ratio_t")"
echo "unit loop (s): plain $(m "$plain_l"), joined $(m "$join_l"); paired ratio joined/plain $(m "$ratio_l")"
