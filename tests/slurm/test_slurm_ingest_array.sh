#!/usr/bin/env bash
# slurm/ingest-array.sbatch: one job array ingests several CSV shards, each task its own shard
# into its own dataset. Entries are given both ways (a CSV path, and a line of overrides), and
# the list has comments and blank lines. Every task must be COMPLETED and every dataset must
# hold its own shard: the shard's row count and its labels in order.
#   test_slurm_ingest_array.sh APPS_DIR      (the directory holding locus-ingest)
set -euo pipefail
# shellcheck source=scripts/slurm-lib.sh
. "$(dirname "$0")/../../scripts/slurm-lib.sh"
# shellcheck source=tests/slurm/locus-jobs-lib.sh
. "$(dirname "$0")/locus-jobs-lib.sh"

LOCUS_BIN=$(readlink -f "${1:?usage: $0 APPS_DIR}")
export LOCUS_BIN
[ -x "$LOCUS_BIN/locus-ingest" ] || slurm_fail "$LOCUS_BIN/locus-ingest is not an executable: build locus-ingest"

slurm_cluster_setup
cd "$LSC_WORK"

# Shards of different sizes, so that a task ingesting another task's shard shows.
rows=(120 75 203 98)
mkdir -p in
for i in "${!rows[@]}"; do locus_make_csv "in/part-$i.csv" "${rows[$i]}" "$((10 + i))"; done
cat >shards.txt <<EOF
# four shards; the last one names its own output

in/part-0.csv
in/part-1.csv
   # an indented comment
in/part-2.csv
--ingest.source=csv --ingest.csv=in/part-3.csv --ingest.output=custom/last.h5
EOF
mkdir -p custom
cat >shards.ini <<'EOF'
[ingest]
csv_label = label
normalize = standardize
num_classes = 4
[gates]
features = 12
min_rows = 50
EOF
outputs=(out/shards/part-0.h5 out/shards/part-1.h5 out/shards/part-2.h5 custom/last.h5)

# 2 ranks per task: 4 tasks x 2 CPUs on a 4-CPU node, so two run at a time.
array=$(slurm_submit --array=0-3 --ntasks=2 "$LOCUS_REPO/slurm/ingest-array.sbatch" shards.txt shards.ini)
# A task beyond the list fails with a configuration error instead of ingesting anything.
beyond=$(slurm_submit --array=4 "$LOCUS_REPO/slurm/ingest-array.sbatch" shards.txt shards.ini)

for i in "${!rows[@]}"; do
  task=${array}_$i
  slurm_wait_state "$task" COMPLETED 90 || slurm_fail "array task $task did not complete"
  [ "$(slurm_job_field "$task" ExitCode)" = 0:0 ] || slurm_fail "task $task ExitCode $(slurm_job_field "$task" ExitCode)"
  log=locus-ingest-array-${array}_$i.out
  grep -q "array task $i of job $array: entry '.*part-$i.csv" "$log" || slurm_fail "task $i did not take entry $i: $(cat "$log")"
  grep -q "mpirun -n 2 " "$log" || slurm_fail "task $i did not run 2 ranks under mpirun: $(cat "$log")"
  f=${outputs[$i]}
  [ -f "$f" ] || slurm_fail "task $i wrote no $f"
  n=$(locus_h5_rows "$f") || slurm_fail "h5dump -H cannot read $f"
  [ "$n" = "${rows[$i]}" ] || slurm_fail "$f holds $n rows, its shard in/part-$i.csv ${rows[$i]}"
  [ "$(locus_h5_rows "$f" /labels)" = "${rows[$i]}" ] || slurm_fail "$f: /labels is not ${rows[$i]} long"
  [ "$(locus_h5_labels "$f" | tr '\n' ' ')" = "$(locus_csv_labels "in/part-$i.csv" | tr '\n' ' ')" ] ||
    slurm_fail "$f: labels differ from those of in/part-$i.csv"
done
[ "$(find out custom -name '*.h5' | wc -l)" = 4 ] || slurm_fail "expected 4 datasets: $(find out custom -name '*.h5')"

slurm_wait_state "${beyond}_4" FAILED 60 || slurm_fail "array task ${beyond}_4 beyond the list did not fail"
[ "$(slurm_job_field "${beyond}_4" ExitCode)" = 2:0 ] || slurm_fail "task ${beyond}_4: ExitCode $(slurm_job_field "${beyond}_4" ExitCode), expected 2:0"
grep -q "has 4 entries (0..3)" "locus-ingest-array-${beyond}_4.out" ||
  slurm_fail "task beyond the list: $(cat "locus-ingest-array-${beyond}_4.out")"

echo "PASS: a job array ingests each shard into its own dataset"
