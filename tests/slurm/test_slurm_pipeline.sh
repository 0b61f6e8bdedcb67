#!/usr/bin/env bash
# The whole pipeline through slurm/submit-pipeline.sh on configs/tiny.ini: ingest-train ->
# ingest-test (drift-gated) -> train -> infer, each a 2-rank mpirun gang in its own job. Every
# stage must complete in dependency order, the model and predictions must exist and agree
# (locus-infer's accuracy is the trainer's final test accuracy), and a second scoring under
# LOCUS_LAUNCHER=srun (PMIx) must write the same predictions byte for byte.
# With --nodes 2 the same on a 2-node cluster (slurm-cluster.sh --nodes 2), every stage and the
# srun scoring a 4-rank gang of 2 nodes x 2 tasks; each stage's mpirun must map ranks 0,1 to one
# node and 2,3 to the other (its --display-map).
#   test_slurm_pipeline.sh APPS_DIR [--nodes 2]  (APPS_DIR holds locus-ingest, -train, -infer)
set -euo pipefail
# shellcheck source=scripts/slurm-lib.sh
. "$(dirname "$0")/../../scripts/slurm-lib.sh"
# shellcheck source=tests/slurm/locus-jobs-lib.sh
. "$(dirname "$0")/locus-jobs-lib.sh"

LOCUS_BIN=$(readlink -f "${1:?usage: $0 APPS_DIR [--nodes 2]}")
export LOCUS_BIN LOCUS_LOG_DIR=logs
nodes=1 ranks=2 sbatch_args=()
if [ $# -gt 1 ]; then
  [ "$2" = --nodes ] && [ "${3:-}" = 2 ] || slurm_fail "usage: $0 APPS_DIR [--nodes 2]"
  nodes=2 ranks=4 sbatch_args=(--nodes=2 --ntasks=4 --ntasks-per-node=2)
  # Every stage (submit-pipeline.sh) and the srun scoring on both nodes; mpirun prints its map.
  export LOCUS_SBATCH_ARGS="${sbatch_args[*]}"
  export LOCUS_MPIRUN_ARGS="--bind-to none --mca mpi_yield_when_idle 1 --display-map"
fi
for app in locus-ingest locus-train locus-infer; do
  [ -x "$LOCUS_BIN/$app" ] || slurm_fail "$LOCUS_BIN/$app is not an executable: build $app"
done
readonly test_rows=500

slurm_cluster_setup --nodes $nodes
cd "$LSC_WORK"
locus_make_csv tiny-train.csv 2000 1
locus_make_csv tiny-test.csv $test_rows 2

out=$(bash "$LOCUS_REPO/slurm/submit-pipeline.sh" "$LOCUS_REPO/configs/tiny.ini" \
  "--pipeline.test_ingest=--ingest.csv=tiny-test.csv --gates.max_mean_shift=0.5 --gates.max_psi=0.5" \
  --infer.output=preds/tiny-scores.h5 --infer.top_k=2) || slurm_fail "submit-pipeline.sh failed"
slurm_log "pipeline: $(echo "$out" | tr '\n' ' ')"
mapfile -t jobs < <(echo "$out" | cut -d' ' -f2)
[ ${#jobs[@]} = 4 ] || slurm_fail "expected 4 job ids, got: $out"
# Scoring again under srun once the pipeline is done: the launcher must not change the bytes.
srun_job=$(LOCUS_LAUNCHER=srun slurm_submit "${sbatch_args[@]}" --dependency=afterok:"${jobs[3]}" -o logs/srun-%j.out \
  "$LOCUS_REPO/slurm/infer.sbatch" "$LOCUS_REPO/configs/tiny.ini" --infer.model=tiny-model.h5 \
  --infer.input=tiny-test.h5 --infer.output=preds/srun-scores.h5 --infer.top_k=2)

for j in "${jobs[@]}" "$srun_job"; do
  slurm_wait_state "$j" COMPLETED 120 || slurm_fail "job $j ($(slurm_job_field "$j" JobName)) did not complete"
  [ "$(slurm_job_field "$j" ExitCode)" = 0:0 ] || slurm_fail "job $j: ExitCode $(slurm_job_field "$j" ExitCode)"
done
# Each stage started only after the ones it depends on had ended.
after() { [[ "$(slurm_job_field "$1" StartTime)" > "$(slurm_job_field "$2" EndTime)" ]] ||
  [ "$(slurm_job_field "$1" StartTime)" = "$(slurm_job_field "$2" EndTime)" ]; }
after "${jobs[1]}" "${jobs[0]}" && after "${jobs[2]}" "${jobs[1]}" && after "${jobs[3]}" "${jobs[2]}" ||
  slurm_fail "stages overlapped: $(for j in "${jobs[@]}"; do echo "$j $(slurm_job_field "$j" StartTime)-$(slurm_job_field "$j" EndTime)"; done)"

logs=()
for j in "${jobs[@]}"; do logs+=("$(locus_job_log "$j")"); done
for l in "${logs[@]}"; do
  grep -q "mpirun -n $ranks " "$l" || slurm_fail "$l: not a $ranks-rank mpirun: $(cat "$l")"
  [ $nodes = 1 ] && continue
  # mpirun's --display-map: "Data for node: NODE ..." and then its "Process rank: R" lines.
  map=$(awk '/^ Data for node:/ { node = $4 } /Process rank:/ { for (i = 1; i < NF; i++) if ($i == "rank:") print $(i + 1), node }' "$l" | sort -n)
  echo "$map" | awk '{ node[$1] = $2; n++ } END { exit !(n == 4 && node[0] == node[1] && node[2] == node[3] && node[0] != node[2]) }' ||
    slurm_fail "$l: expected ranks 0,1 mapped to one node and 2,3 to another: $(echo "$map" | tr '\n' ';') $(cat "$l")"
done
[ $nodes = 1 ] || slurm_log "every stage's mpirun mapped ranks 0,1 and 2,3 to two nodes"
[ "$(locus_h5_rows tiny-train.h5)" = 2000 ] || slurm_fail "tiny-train.h5 does not hold 2000 rows"
[ "$(locus_h5_rows tiny-test.h5)" = $test_rows ] || slurm_fail "tiny-test.h5 does not hold $test_rows rows"
grep -q -- '--gates.reference=tiny-train.h5' "${logs[1]}" || slurm_fail "ingest-test was not gated against the train set"
[ "$(locus_json tiny-test.h5.gates.json '" ".join(x["rule"] for x in r["rules"] if x["passed"])')" = \
  "features reference_cols require_labels label_range nonfinite min_rows max_mean_shift max_psi" ] ||
  slurm_fail "the test set's drift gates did not run and pass: $(cat tiny-test.h5.gates.json)"

# The model: trained, written, readable.
train_acc=$(sed -n 's/^test accuracy \([0-9.]*\) .*/\1/p' "${logs[2]}")
[ -n "$train_acc" ] || slurm_fail "no test accuracy in ${logs[2]}: $(cat "${logs[2]}")"
grep -q "^model written to tiny-model.h5" "${logs[2]}" || slurm_fail "no model written: $(cat "${logs[2]}")"
h5dump -H tiny-model.h5 | grep -q 'DATASET "layers.0.weight"' || slurm_fail "tiny-model.h5 is not a readable model file"

# The predictions: every test row scored, accuracy printed and consistent with the trainer's.
[ "$(h5dump -a /committed_rows -y preds/tiny-scores.h5 | sed -n 's/^ *\([0-9][0-9]*\) *$/\1/p')" = $test_rows ] ||
  slurm_fail "preds/tiny-scores.h5: committed_rows is not $test_rows"
[ "$(locus_h5_rows preds/tiny-scores.h5 /predicted)" = $test_rows ] || slurm_fail "preds/tiny-scores.h5: /predicted is not $test_rows rows"
infer_acc=$(sed -n 's/^ *accuracy \([0-9.]*\), log-loss .*/\1/p' "${logs[3]}")
[ -n "$infer_acc" ] || slurm_fail "no accuracy in ${logs[3]}: $(cat "${logs[3]}")"
slurm_log "train: test accuracy $train_acc; infer: accuracy $infer_acc"
awk -v a="$train_acc" -v b="$infer_acc" 'BEGIN { exit !(a > 0.6 && (a - b) ^ 2 <= (1.5 / 500) ^ 2) }' ||
  slurm_fail "accuracies: trainer $train_acc, locus-infer $infer_acc (chance 0.25): expected > 0.6 and equal"

grep -q "srun --mpi=pmix -n $ranks " logs/srun-"$srun_job".out || slurm_fail "srun job: $(cat logs/srun-"$srun_job".out)"
grep -q "^ *accuracy $infer_acc," logs/srun-"$srun_job".out || slurm_fail "srun scoring: $(cat logs/srun-"$srun_job".out)"
h5diff preds/tiny-scores.h5 preds/srun-scores.h5 /scores /scores && h5diff preds/tiny-scores.h5 preds/srun-scores.h5 /predicted /predicted ||
  slurm_fail "predictions under srun differ from those under mpirun"

echo "PASS: the pipeline ran every stage in order on $nodes node(s), model and predictions agree"
