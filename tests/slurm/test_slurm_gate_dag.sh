#!/usr/bin/env bash
# slurm/submit-pipeline.sh on bad data: a quality gate that fails (exit code 4) must stop the
# pipeline there. Two pipelines: (A) the test set drifted from the train set, so the drift gate
# of the ingest-test stage fails; (B) the train set has labels beyond num_classes, so the first
# stage fails. Every later stage must be CANCELLED without ever running. (C) repeats B on a
# cluster without DependencyParameters=kill_invalid_depend: the submitter's own
# --kill-on-invalid-dep=yes must still cancel the later stages.
#   test_slurm_gate_dag.sh APPS_DIR      (the directory holding locus-ingest)
set -euo pipefail
# shellcheck source=scripts/slurm-lib.sh
. "$(dirname "$0")/../../scripts/slurm-lib.sh"
# shellcheck source=tests/slurm/locus-jobs-lib.sh
. "$(dirname "$0")/locus-jobs-lib.sh"

LOCUS_BIN=$(readlink -f "${1:?usage: $0 APPS_DIR}")
export LOCUS_BIN LOCUS_LOG_DIR=logs
[ -x "$LOCUS_BIN/locus-ingest" ] || slurm_fail "$LOCUS_BIN/locus-ingest is not an executable: build locus-ingest"
readonly exit_gate=4

slurm_cluster_setup
cd "$LSC_WORK"

locus_make_csv train.csv 400 1
locus_make_csv drifted.csv 200 2 3.0 # every feature moved by 3 standard deviations
locus_make_csv badlabels.csv 400 3 0 6 # labels 0..5, num_classes is 4
cat >pipeline.ini <<'EOF'
# configs/tiny.ini's model on generated data; each pipeline overrides the paths.
[ingest]
source = csv
csv = train.csv
csv_label = label
normalize = none
num_classes = 4
[gates]
features = 12
min_rows = 100
[model]
widths = 12,16,4
[train]
epochs = 1
batch = 32
[pipeline]
test_ingest = --ingest.csv=drifted.csv --gates.max_mean_shift=0.5 --gates.min_rows=50
EOF

# submit_pipeline NAME OVERRIDES...: runs the submitter with outputs under NAME/; sets the
# array jobs to its job ids (ingest-train, ingest-test, train, infer).
submit_pipeline() {
  local name=$1 out
  shift
  out=$(bash "$LOCUS_REPO/slurm/submit-pipeline.sh" pipeline.ini "--ingest.output=$name/train.h5" \
    "--data.test=$name/test.h5" "--train.output=$name/model.h5" "--train.metrics=$name/metrics.jsonl" \
    "--infer.output=$name/scores.h5" "$@") || slurm_fail "submit-pipeline.sh failed for $name"
  slurm_log "pipeline $name: $(echo "$out" | tr '\n' ' ')"
  [ "$(echo "$out" | cut -d' ' -f1 | tr '\n' ' ')" = "ingest-train ingest-test train infer " ] ||
    slurm_fail "submit-pipeline.sh printed '$out', expected one 'STAGE JOBID' line per stage"
  mapfile -t jobs < <(echo "$out" | cut -d' ' -f2)
}

# The gate job ended FAILED with ExitCode 4:0, said so in its log, and its report names RULE.
expect_gate_failure() {
  local job=$1 report=$2 rule=$3 log
  slurm_wait_state "$job" FAILED 60 || slurm_fail "gate job $job did not fail"
  [ "$(slurm_job_field "$job" ExitCode)" = "$exit_gate:0" ] ||
    slurm_fail "gate job $job: ExitCode $(slurm_job_field "$job" ExitCode), expected $exit_gate:0"
  log=$(locus_job_log "$job")
  grep -q "locus-ingest exited with code $exit_gate$" "$log" || slurm_fail "$log does not report exit code $exit_gate: $(cat "$log")"
  [ "$(locus_json "$report" '(r["passed"], " ".join(r["failed"]))')" = "(False, '$rule')" ] ||
    slurm_fail "gate report $report does not blame $rule alone: $(cat "$report")"
}

# Jobs that must be CANCELLED because a stage before them failed, and never have run.
expect_never_ran() {
  local job log
  for job in "$@"; do
    slurm_wait_state "$job" CANCELLED 60 || slurm_fail "job $job after a failed gate was not cancelled"
    [ "$(slurm_job_field "$job" Reason)" = DependencyNeverSatisfied ] ||
      slurm_fail "job $job: Reason=$(slurm_job_field "$job" Reason), expected DependencyNeverSatisfied"
    log=$(locus_job_log "$job")
    [ ! -e "$log" ] || slurm_fail "job $job ran although its dependency failed: $log exists: $(cat "$log")"
  done
}

expect_no_outputs() {
  local f
  for f in "$@"; do [ ! -e "$f" ] || slurm_fail "$f exists, but the stage that writes it must not have run"; done
}

# (A) drift: ingest-train passes, ingest-test fails its drift gate against the train set.
submit_pipeline A
a=("${jobs[@]}")
# (B) bad labels in the train set: the first stage fails.
submit_pipeline B --ingest.csv=badlabels.csv
b=("${jobs[@]}")

slurm_wait_state "${a[0]}" COMPLETED 60 || slurm_fail "ingest-train of pipeline A did not complete"
[ "$(locus_h5_rows A/train.h5)" = 400 ] || slurm_fail "A/train.h5 does not hold the 400 rows of train.csv"
expect_gate_failure "${a[1]}" A/test.h5.gates.json max_mean_shift
[ "$(locus_json A/test.h5.gates.json 'r["reference"]')" = A/train.h5 ] ||
  slurm_fail "the drift gate did not compare against A/train.h5: $(cat A/test.h5.gates.json)"
expect_never_ran "${a[2]}" "${a[3]}"
expect_no_outputs A/test.h5 A/model.h5 A/scores.h5

expect_gate_failure "${b[0]}" B/train.h5.gates.json label_range
expect_never_ran "${b[1]}" "${b[2]}" "${b[3]}"
expect_no_outputs B/train.h5 B/test.h5 B/model.h5 B/scores.h5

# (C) A cluster without kill_invalid_depend would leave the later stages PENDING
# (DependencyNeverSatisfied) forever; the submitter's per-job flag must cancel them anyway.
sed -i 's/^DependencyParameters=.*/# &/' "$SLURM_CONF"
scontrol reconfigure
dep_params=$(scontrol show config | grep '^DependencyParameters')
[[ "$dep_params" =~ =\ *\(null\)$ ]] || slurm_fail "kill_invalid_depend still configured: $dep_params"
submit_pipeline C --ingest.csv=badlabels.csv
c=("${jobs[@]}")
expect_gate_failure "${c[0]}" C/train.h5.gates.json label_range
expect_never_ran "${c[1]}" "${c[2]}" "${c[3]}"
expect_no_outputs C/train.h5 C/test.h5 C/model.h5 C/scores.h5

echo "PASS: a failed gate cancels every later stage of the pipeline"
