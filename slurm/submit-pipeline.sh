#!/usr/bin/env bash
# Submits the whole locus pipeline as four Slurm jobs chained with --dependency=afterok:
#   ingest-train -> ingest-test (drift-gated against the train set) -> train -> infer
# A stage that fails (e.g. a quality gate, exit code 4) cancels every stage after it
# (--kill-on-invalid-dep=yes). Prints "STAGE JOBID", one line per stage. See docs/SLURM.md.
#
#   slurm/submit-pipeline.sh [--overwrite] [--dry-run] CONFIG [--section.key=value ...]
#
# Overrides go to the app that owns their section: [ingest] [gates] to both ingest stages,
# [data] [model] [optim] [train] [loader] [eval] [checkpoint] to locus-train, [infer] to
# locus-infer, [pipeline] to this script. [pipeline] test_ingest holds the overrides of the
# test-set ingest (its input, the drift thresholds), word-split. --overwrite goes to the
# ingest and infer stages. The stages are wired through the config: the train set is
# [ingest] output, the test set [data] test, the model [train] output.
#
# Environment: LOCUS_BIN, LOCUS_LAUNCHER, ... (slurm/locus-job.sh); LOCUS_LOG_DIR (job logs,
# default logs); LOCUS_SBATCH_ARGS (sbatch options for every stage) and LOCUS_SBATCH_ARGS_INGEST,
# LOCUS_SBATCH_ARGS_TRAIN, LOCUS_SBATCH_ARGS_INFER (for one kind of stage), word-split.
set -euo pipefail

prog=${0##*/}
LOCUS_ROOT=$(cd "$(dirname "$0")/.." && pwd)
export LOCUS_ROOT # the jobs use this repository's scripts and, by default, its build
readonly train_sections="data model optim train loader eval checkpoint"

die() {
  echo "$prog: error: $*" >&2
  exit 2
}
usage() {
  sed -n '7p' "$0" | sed 's/^# *//' >&2
  exit 2
}

# The value of KEY (section.name) in INI file FILE, or nothing: the last assignment wins and
# '#' starts a comment anywhere, as in the apps' config reader.
ini_get() {
  awk -v want="$2" '
    { sub(/#.*/, ""); gsub(/^[ \t]+|[ \t\r]+$/, "") }
    /^\[.*\]$/ { section = substr($0, 2, length($0) - 2); next }
    index($0, "=") {
      key = substr($0, 1, index($0, "=") - 1); val = substr($0, index($0, "=") + 1)
      gsub(/[ \t]+$/, "", key); gsub(/^[ \t]+/, "", val)
      if (section "." key == want) { found = val; seen = 1 }
    }
    END { if (seen) print found }' "$1"
}

overwrite=0 dry_run=0
while [ $# -gt 0 ]; do
  case "$1" in
    --overwrite) overwrite=1 ;;
    --dry-run) dry_run=1 ;;
    --help | -h) usage ;;
    *) break ;;
  esac
  shift
done
[ $# -gt 0 ] && [ "${1#-}" = "$1" ] || usage
config=$1
shift
[ -r "$config" ] || die "cannot read config file '$config'"
config=$(cd "$(dirname "$config")" && pwd)/${config##*/} # the jobs may run elsewhere (--chdir)

# Route each override to its stage; remember every value for the wiring below.
ingest_args=() train_args=() infer_args=()
declare -A given=()
for a in "$@"; do
  [[ "$a" =~ ^--([a-z_]+)\.([a-z_0-9]+)=(.*)$ ]] ||
    die "'$a' is not an override: give --section.key=value (flags before CONFIG: --overwrite, --dry-run)"
  section=${BASH_REMATCH[1]}
  given[$section.${BASH_REMATCH[2]}]=${BASH_REMATCH[3]}
  case " ingest gates $train_sections infer pipeline " in
    *" $section "*) ;;
    *) die "'$a': unknown section [$section]; known: ingest gates $train_sections infer pipeline" ;;
  esac
  case "$section" in
    ingest | gates) ingest_args+=("$a") ;;
    infer) infer_args+=("$a") ;;
    pipeline) [ "${BASH_REMATCH[2]}" = test_ingest ] || die "'$a': [pipeline] has one key, test_ingest" ;;
    *) train_args+=("$a") ;;
  esac
done

# The effective value of KEY: the last override, else the config file.
value() {
  if [ -n "${given[$1]+set}" ]; then echo "${given[$1]}"; else ini_get "$config" "$1"; fi
}
# KEY must be VALUE when set; when unset the pipeline sets it (appended to array $3).
wire() {
  local key=$1 want=$2 now
  now=$(value "$key")
  if [ -z "$now" ]; then
    eval "$3+=(\"--\$key=\$want\")"
  elif [ "$now" != "$want" ]; then
    die "[${key%%.*}] ${key#*.} = $now, but the pipeline feeds it $want ($4): make them equal or leave ${key} out"
  fi
}

train_set=$(value ingest.output)
test_set=$(value data.test)
model=$(value train.output)
predictions=$(value infer.output)
for key in ingest.output data.test train.output infer.output; do
  [ -n "$(value $key)" ] || die "the pipeline needs [${key%%.*}] ${key#*.} in $config (or --$key=...)"
done
wire data.train "$train_set" train_args "[ingest] output, the train set"
wire infer.model "$model" infer_args "[train] output, the model"
wire infer.input "$test_set" infer_args "[data] test, the test set"
# Without its own input the test-set stage would ingest the train set's input a second time.
[ -n "$(value pipeline.test_ingest)" ] ||
  die "the pipeline needs [pipeline] test_ingest in $config: the test set's input and drift gates, e.g. test_ingest = --ingest.csv=test.csv --gates.max_psi=0.1"
# shellcheck disable=SC2207 # [pipeline] test_ingest is a list of words
test_ingest=($(value pipeline.test_ingest))
flags=()
[ $overwrite = 0 ] || flags=(--overwrite)

log_dir=${LOCUS_LOG_DIR:-logs}
bin=${LOCUS_BIN:-$LOCUS_ROOT/build/apps}
for app in locus-ingest locus-train locus-infer; do
  [ -x "$bin/$app" ] || echo "$prog: warning: $bin/$app does not exist yet: its stage will fail unless it is built first (LOCUS_BIN)" >&2
done
if [ $dry_run = 0 ]; then
  mkdir -p "$log_dir"
  for path in "$train_set" "$test_set" "$model" "$predictions" "$(value train.metrics)"; do
    [ -z "$path" ] || mkdir -p "$(dirname "$path")"
  done
fi

submitted=()
on_exit() {
  local rc=$?
  if [ $rc != 0 ] && [ ${#submitted[@]} -gt 0 ]; then
    echo "$prog: submission failed; cancelling the jobs already submitted: ${submitted[*]}" >&2
    scancel "${submitted[@]}" || true
  fi
}
trap on_exit EXIT

# submit STAGE KIND DEPENDENCY SCRIPT ARGS...: prints "STAGE JOBID"; the id goes to $job.
submit() {
  local stage=$1 kind=$2 dep=$3 script=$4 extra=() cmd
  shift 4
  local per_kind_var=LOCUS_SBATCH_ARGS_${kind^^}
  # shellcheck disable=SC2206
  extra=(${LOCUS_SBATCH_ARGS:-} ${!per_kind_var:-})
  cmd=(sbatch --parsable --job-name="locus-$stage" --output="$log_dir/%x-%j.out"
    --kill-on-invalid-dep=yes ${dep:+"--dependency=afterok:$dep"} "${extra[@]}"
    "$LOCUS_ROOT/slurm/$script" "$config" "$@")
  if [ $dry_run = 1 ]; then
    job="<$stage>"
    echo "${cmd[*]}" >&2
  else
    job=$("${cmd[@]}") || die "sbatch failed for stage $stage: ${cmd[*]}"
    job=${job%%;*}
    submitted+=("$job")
  fi
  echo "$stage $job"
}

submit ingest-train ingest "" ingest.sbatch "${ingest_args[@]}" "${flags[@]}"
j_train_set=$job
submit ingest-test ingest "$j_train_set" ingest.sbatch "${ingest_args[@]}" "${test_ingest[@]}" \
  "--ingest.output=$test_set" "--gates.reference=$train_set" "${flags[@]}"
j_test_set=$job
submit train train "$j_train_set:$j_test_set" train.sbatch "${train_args[@]}"
j_model=$job
submit infer infer "$j_model" infer.sbatch "${infer_args[@]}" "${flags[@]}"
